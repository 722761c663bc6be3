"""The CPU engines side by side: tokens/s of AR and DFlash on the SmolLM2 testbed (fp32) with the
bundled drafter, per engine, in one process: the Transformers runner, the static runner with MKL's
GEMMs, the static runner with oneDNN's packed weights, and the same with the drafter in bf16
(`make_engine('auto')` on a CPU with bf16 matrix units, `loop.bf16_drafting`). One chat prompt,
greedy; each engine and method runs three times in turn and the mean of the last two is
reported, with the drafter's and the verification's ms per round.

    python benchmarks/bench_cpu_engines.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.decode.engine import Engine
from dflashkit.decode.loop import bf16_drafting, generate, make_engine
from dflashkit.decode.static import static_engine
from dflashkit.target import load_target

BUNDLED = Path(__file__).resolve().parents[1] / "src/dflashkit/assets/smollm2-drafter"
PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    target = load_target(dtype="float32")
    drafter = load_drafter(BUNDLED, target, dtype=torch.float32)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    engines = {"transformers": Engine(target, drafter), "static (MKL)": static_engine(target, drafter, pack=False),
               "static (packed)": static_engine(target, drafter)}
    if bf16_drafting(target):
        engines["static (packed, bf16 drafter)"] = make_engine(target, drafter)
    runs: dict[tuple[str, str], list] = {}
    for rep in range(3):
        for name, engine in engines.items():
            for method in ("ar", "dflash"):
                t = time.perf_counter()
                g = generate(engine, ids, max_new_tokens=args.max_new_tokens, method=method, profile=True)
                seconds = time.perf_counter() - t
                if rep:  # (the first pass warms up: allocations, oneDNN's primitives)
                    runs.setdefault((name, method), []).append((g, seconds))
    rows = []
    for (name, method), gs in runs.items():
        rounds = sum(g.rounds for g, _ in gs)
        rows.append({"engine": name, "method": method, "tokens": sum(len(g.tokens) for g, _ in gs),
                     "tokens_per_s": sum(len(g.tokens) for g, _ in gs) / sum(s for _, s in gs),
                     "tau": sum(len(g.tokens) for g, _ in gs) / rounds,
                     **{f"{k}_ms": 1e3 * sum(g.stage_seconds.get(k, 0.0) for g, _ in gs) / rounds
                        for k in ("draft", "verify")}})
    print("| engine | method | tokens/s | τ | draft ms/round | verify ms/round |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['engine']} | {r['method']} | {r['tokens_per_s']:.2f} | {r['tau']:.2f} | {r['draft_ms']:.1f} | "
              f"{r['verify_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
