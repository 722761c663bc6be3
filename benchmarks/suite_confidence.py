"""How predictable each evaluation suite's answers are: the target's own confidence along its
greedy answers, beside the DFlash τ the drafter reaches on them, and how much of the gap between
suites that confidence explains.

For each suite (SmolLM2 testbed and the bundled drafter by default), the suite's prompts are
answered greedily with DFlash (`decode.loop.generate_batch`, the static engine, the suite's answer
length, stopping at the target's stop tokens). τ is pooled over rounds, as `dflashkit eval`
reports it. Then one forward pass of the target over each prompt + answer gives, at every answer
position, the probability of the token it chose (its top-1): the lower it is, the flatter the
target's distribution and the harder its argmax is to draft. Reported per suite: the mean top-1
probability and the share of positions where it is below 0.5.

The same pass gives the drafter's features, so the drafter drafts a block at every answer position
as a decoding round rooted there would (`evaluate.offline_accepted`). Each drafted token that a
round reaches (its earlier slots accepted) is a hit or a miss; grouped by the target's probability
of that token, the hit rates show whether the drafter drafts a suite's tokens worse than another's
at equal target confidence. `at best's mix` re-weights a suite's hit rates to the best suite's
shares of those bins: if that closes its gap in hit rate, the drafter is as good on the suite's
positions as on the best suite's, and the gap is how sure the target is of its own answers there.

    python benchmarks/suite_confidence.py --json runs/suite-confidence.json                 # fp32 CPU
    python benchmarks/suite_confidence.py --dtype bfloat16 --suites chat --json out.json    # bf16 target + drafter
    python benchmarks/suite_confidence.py --target MODEL_DIR --drafter DRAFTER_DIR --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflashkit.checkpoint import atomic_write_bytes, load_drafter
from dflashkit.data.features import FeatureSample
from dflashkit.data.prompts import EVAL_SUITES, get_suite, load_prompts
from dflashkit.decode.loop import generate_batch
from dflashkit.decode.static import static_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts, offline_accepted, summarize
from dflashkit.progress import progress
from dflashkit.target import load_target
from dflashkit.vocab import stop_token_ids

# Bins of the target's probability of the token it chose: edges, lowest bin first.
EDGES = (0.3, 0.5, 0.7, 0.9)
BINS = ("<0.3", "0.3-0.5", "0.5-0.7", "0.7-0.9", ">=0.9")


def conf_bin(q: float) -> int:
    return sum(q >= e for e in EDGES)


@torch.no_grad()
def drafted_tokens(target, drafter, prompt: torch.Tensor, answer: list[int]) -> tuple[list[float], list[tuple[float, bool]]]:
    """(the target's probability of each answer token given everything before it, and for every
    token that a round rooted at an answer position drafts and reaches: (that probability, hit))."""
    ids = torch.cat([prompt, torch.tensor(answer, dtype=prompt.dtype)])
    out = target.forward(ids[None].to(target.device), drafter.config.target_layer_ids)
    n, last = len(prompt), drafter.config.block_size - 1
    logits = out.logits[0, n - 1:-1].float()
    probs = logits.softmax(-1).gather(1, ids[n:, None].to(logits.device)).squeeze(1).tolist()
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[n:] = True
    acc, _ = offline_accepted(drafter, target, FeatureSample("probe", ids, mask, out.features[0]),
                              [("dflash", "dflash", None)], None)
    tokens = []
    for p, a in acc["dflash"].items():  # the block rooted at p (bonus = token p) drafts p + 1, p + 2, ...
        tokens += [(probs[p + k - n], True) for k in range(1, a + 1)]
        if a < last and p + a + 1 < len(ids):  # the first miss ends the round
            tokens.append((probs[p + a + 1 - n], False))
    return probs, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suites", default=",".join(s.name for s in EVAL_SUITES), help="comma list (default: every suite)")
    p.add_argument("--target", default=None, help="target: a directory, a .gguf file or a testbed name (default: the "
                   "embedded SmolLM2-135M-Instruct); another target needs its own --drafter")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's and drafter's")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per suite")
    p.add_argument("--json", help="write the tables here")
    args = p.parse_args()
    suites = [get_suite(name) for name in args.suites.split(",")]
    if args.target is not None and args.drafter is None:
        p.error("--target: give the drafter trained for it with --drafter (the bundled one is SmolLM2's)")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    engine = static_engine(target, drafter)
    rows = []
    for suite in suites:
        t0 = time.perf_counter()
        prompts = [pr.ids[0] for pr in eval_prompts(load_prompts(f"suite:{suite.name}", limit=args.limit), target.tokenizer)]
        gens = generate_batch(engine, prompts, max_new_tokens=suite.max_new_tokens, method="dflash", stop_ids=stops)
        probs, drafted = [], []
        for pr, g in progress(list(zip(prompts, gens)), desc=f"{suite.name}: drafting at every position", unit="answer"):
            q, d = drafted_tokens(target, drafter, pr, g.tokens)
            probs += q
            drafted += d
        bins = [[hit for c, hit in drafted if conf_bin(c) == b] for b in range(len(BINS))]
        rows.append({"suite": suite.name, "prompts": len(prompts), "tokens": len(probs),
                     "tau": summarize([t for g in gens for t in g.accept_lengths], drafter.config.block_size)["tau"],
                     "top1_mean": statistics.mean(probs), "below_half": sum(q < 0.5 for q in probs) / len(probs),
                     "hit_rate": statistics.mean(hit for _, hit in drafted),
                     "bin_share": [len(b) / len(drafted) for b in bins],
                     "bin_hit_rate": [statistics.mean(b) if b else None for b in bins],
                     "seconds": time.perf_counter() - t0})
        r = rows[-1]
        print(f"{r['suite']:10s} τ {r['tau']:.3f}  top-1 mean {r['top1_mean']:.3f}  below 0.5 {r['below_half']:.1%}"
              f"  hit rate {r['hit_rate']:.3f}  ({r['tokens']} tokens, {r['seconds']:.0f} s)", flush=True)
    best = max(rows, key=lambda r: r["hit_rate"])
    for r in rows:  # the suite's hit rate if its drafted tokens were as sure as the best suite's
        have = [b for b, h in enumerate(r["bin_hit_rate"]) if h is not None and best["bin_share"][b] > 0]
        r["at_best_mix"] = sum(best["bin_share"][b] * r["bin_hit_rate"][b] for b in have) / \
            sum(best["bin_share"][b] for b in have)
    print(f"\nhit rate of drafted tokens by the target's probability of the token (share of tokens); best: {best['suite']}\n")
    print("| suite | " + " | ".join(BINS) + " | hit rate | at best's mix | gap to best | gap at best's mix |")
    print("| --- |" + " ---: |" * (len(BINS) + 4))
    for r in rows:
        cells = [f"{h:.2f} ({s:.0%})" if h is not None else "-" for h, s in zip(r["bin_hit_rate"], r["bin_share"])]
        print(f"| {r['suite']} | " + " | ".join(cells) + f" | {r['hit_rate']:.3f} | {r['at_best_mix']:.3f} | "
              f"{r['hit_rate'] - best['hit_rate']:+.3f} | {r['at_best_mix'] - best['hit_rate']:+.3f} |")
    if args.json:
        settings = {"target": args.target or "SmolLM2-135M-Instruct (default)", "device": args.device,
                    "dtype": args.dtype, "drafter": str(args.drafter or "bundled smollm2-drafter"),
                    "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "limit": args.limit,
                    "bins": BINS}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(args.json), json.dumps({"settings": settings, "rows": rows}, indent=2).encode())


if __name__ == "__main__":
    main()
