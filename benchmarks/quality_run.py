"""The testbed quality run: regenerate -> tokenize -> train under a wall-clock budget, then greedy
online evaluation on the first HumanEval prompts (AR vs DFlash vs DDTree), in one process.

    python benchmarks/quality_run.py --config configs/smollm2-bundled.yaml --budget-s 480 \
        --json runs/quality/result.json

The budget covers loading the target, regeneration, tokenisation and training; evaluation is
timed separately. HumanEval prompts are never trained on: the training prompts are the built-in
set, which tests/test_prompts.py checks for overlap with HumanEval.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.commands import resolve_device
from dflashkit.config import load_config
from dflashkit.data.chat import load_tokenized, prompt_ids, tokenize_file
from dflashkit.data.prompts import load_prompts
from dflashkit.data.regenerate import GenerationParams, regenerate_local
from dflashkit.decode import generate, make_engine
from dflashkit.target import load_target
from dflashkit.train import train
from dflashkit.vocab import stop_token_ids


def _engine(target, drafter):
    try:
        return make_engine(target, drafter)
    except Exception as e:  # the fast static engine is optional here: report and use the generic one
        logging.warning("static engine unavailable (%s); using the Transformers engine", e)
        return make_engine(target, drafter, "hf")


def evaluate_online(target, drafter, prompts, *, max_new_tokens: int, budgets: list[int]) -> dict:
    """Greedy AR, DFlash and DDTree(budget) on each prompt; outputs must be identical to AR."""
    stops = stop_token_ids(target.tokenizer, target.model.generation_config)
    ar_engine, sd_engine = _engine(target, None), _engine(target, drafter)
    methods = [("ar", None, ar_engine), ("dflash", None, sd_engine)] + [("ddtree", b, sd_engine) for b in budgets]
    rows = {}
    for method, budget, engine in methods:
        name = method if budget is None else f"ddtree-{budget}"
        taus, toks, secs, same = [], 0, 0.0, True
        for i, conv in enumerate(prompts):
            ids = torch.tensor([prompt_ids(target.tokenizer, conv.messages)])
            g = generate(engine, ids, max_new_tokens=max_new_tokens, method=method, budget=budget, stop_ids=stops)
            taus += g.accept_lengths
            toks += len(g.tokens)
            secs += g.prefill_seconds + g.decode_seconds
            if method == "ar":
                rows.setdefault("_ar_tokens", []).append(g.tokens)
            else:
                same &= g.tokens == rows["_ar_tokens"][i]
        rows[name] = {"tau": sum(taus) / max(1, len(taus)), "rounds": len(taus), "tokens": toks,
                      "tokens_per_s": toks / secs, "identical_to_ar": same}
    rows.pop("_ar_tokens")
    ar_tps = rows["ar"]["tokens_per_s"]
    for r in rows.values():
        r["speedup"] = r["tokens_per_s"] / ar_tps
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall clock for load + regenerate + tokenize + train")
    p.add_argument("--regen-batch", type=int, default=512)
    p.add_argument("--eval-limit", type=int, default=20)
    p.add_argument("--json", help="write the result here")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    cfg = load_config(a.config, a.overrides)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.target.device)
    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
    t_load = time.perf_counter() - t0

    d = cfg.data
    convs = load_prompts(d.prompts, limit=d.limit)
    regen = out / "regenerated.jsonl"
    rs = regenerate_local(target, convs, regen, GenerationParams(max_new_tokens=d.max_new_tokens), batch_size=a.regen_batch)
    tok_path = out / "tokenized.jsonl"
    ts = tokenize_file(regen, target.tokenizer, tok_path, max_length=d.max_length)
    samples = load_tokenized(tok_path)
    t_data = time.perf_counter() - t0

    cfg.train.time_budget_s = max(30.0, a.budget_s - t_data)
    run_dir = train(cfg, target=target, samples=samples)
    t_train = time.perf_counter() - t0

    drafter = load_drafter(run_dir / "best", target, device=target.device, dtype=target.dtype)
    prompts = load_prompts("humaneval", limit=a.eval_limit)
    rows = evaluate_online(target, drafter, prompts, max_new_tokens=cfg.eval.max_new_tokens, budgets=cfg.eval.ddtree_budgets)
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "seconds": {"load": t_load, "data": t_data - t_load, "train": t_train - t_data, "total_budgeted": t_train},
        "regenerate": {"prompts": rs.written, "completion_tokens": rs.completion_tokens, "tokens_per_s": rs.tokens_per_s},
        "tokenize": {"samples": len(samples), "dropped": ts.dropped if hasattr(ts, "dropped") else None},
        "train": json.loads((run_dir / "best.json").read_text()),
        "eval": {"prompts": len(prompts), "max_new_tokens": cfg.eval.max_new_tokens, **rows},
    }
    print(json.dumps(result, indent=2))
    print(f"\n| method | tau | tokens/s | speed-up | identical to AR |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['identical_to_ar']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
