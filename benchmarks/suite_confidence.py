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
as a decoding round rooted there would (`bench.confidence.drafted_tokens`). Each drafted token that a
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

from dflashkit.bench.confidence import BINS, conf_bin, drafted_tokens
from dflashkit.checkpoint import atomic_write_bytes, load_drafter
from dflashkit.data.prompts import EVAL_SUITES, get_suite, load_prompts
from dflashkit.decode.loop import generate_batch
from dflashkit.decode.static import static_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts, summarize
from dflashkit.progress import progress
from dflashkit.target import load_target
from dflashkit.vocab import stop_token_ids


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
