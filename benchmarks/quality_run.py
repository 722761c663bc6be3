"""The testbed quality run: regenerate -> tokenize -> train under a wall-clock budget, then greedy
online evaluation on the evaluation suites (AR vs DFlash vs DDTree), in one process.

    python benchmarks/quality_run.py --config configs/smollm2-bundled.yaml --budget-s 480 \
        --json runs/quality/result.json

The budget covers loading the target, regeneration, tokenisation and training; evaluation is
timed separately. The suites (HumanEval, code, math, chat, multi-turn; each with its own prompt
count and answer length) are never trained on: tests/test_prompts.py checks that the built-in
training set shares no 8-word run and no near-duplicate with any of them. Any greedy output that
parts from autoregressive decoding other than at a numerical near-tie fails the run.
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
from dflashkit.data.chat import load_tokenized, tokenize_file
from dflashkit.data.prompts import EVAL_SUITES, load_prompts, load_suite
from dflashkit.data.regenerate import GenerationParams, regenerate_local
from dflashkit.evaluate import check_partings, eval_prompts, evaluate_suites, markdown, training_tau_sim, write_report
from dflashkit.target import load_target
from dflashkit.train import train
from dflashkit.vocab import stop_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall clock for load + regenerate + tokenize + train")
    p.add_argument("--regen-batch", type=int, default=512)
    p.add_argument("--suite-prompts", type=int, default=None, help="prompts per suite (default: each suite's count)")
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
    suites = [(s, eval_prompts(load_suite(s.name, a.suite_prompts), target.tokenizer)) for s in EVAL_SUITES]
    report = evaluate_suites(target, {"trained": drafter}, suites, budgets=cfg.eval.ddtree_budgets,
                             stop_ids=stop_token_ids(target.tokenizer, target.model.generation_config))
    report.update(target=target.name, device=device, date=time.strftime("%Y-%m-%d %H:%M"),
                  **training_tau_sim({"trained": run_dir / "best"}))
    write_report(report, out / "eval")  # JSON + Markdown + plots
    methods = report["drafters"]["trained"]["methods"]
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "seconds": {"load": t_load, "data": t_data - t_load, "train": t_train - t_data, "total_budgeted": t_train},
        "regenerate": {"prompts": rs.written, "completion_tokens": rs.completion_tokens, "tokens_per_s": rs.tokens_per_s},
        "tokenize": {"samples": len(samples), "dropped": ts.dropped if hasattr(ts, "dropped") else None},
        "train": json.loads((run_dir / "best.json").read_text()),
        "eval": {"prompts": report["prompts"], "ar_tokens_per_s": report["baseline"]["tokens_per_s"],
                 "headline": report["headline"]["trained"],
                 "suites": {name: t["drafters"]["trained"] for name, t in report["suites"].items()},
                 **{lab: {k: m[k] for k in ("tau", "rounds", "tokens_per_s", "speedup", "identical_prompts")}
                    for lab, m in methods.items()}},
    }
    print(json.dumps(result, indent=2))
    print(markdown(report))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    check_partings(report)


if __name__ == "__main__":
    main()
