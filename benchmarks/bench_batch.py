"""Batched decoding throughput: AR and DFlash at several batch sizes on the SmolLM2 testbed with the
bundled drafter, first N HumanEval prompts through the chat template (as `dflashkit eval`).

Each configuration decodes the same N prompts in consecutive groups of `batch` (the last group
may be smaller); batch 1 is today's path (`decode.generate` on `HFEngine`), larger batches
`batch.generate_batch`. Rows stop at the target's stop tokens or `--max-new-tokens`, so batches
shrink as rows finish. tokens/s = generated tokens / wall time including prefill; speed-up is
against AR at batch 1. One untimed warm-up generation per configuration; CUDA is synchronised
before each clock read. "identical" counts rows whose tokens equal the same method at batch 1
(greedy; bf16 near-ties may part).

    python benchmarks/bench_batch.py --prompts 8 --max-new-tokens 64 --json runs/bench-batch-cpu.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --json runs/bench-batch-h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dflashkit.batch import generate_batch
from dflashkit.checkpoint import load_drafter
from dflashkit.decode import Generation, HFEngine, generate
from dflashkit.demo import bundled_drafter_dir
from dflashkit.drafter import DFlashDrafter
from dflashkit.target import Target, load_target


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_group(target: Target, drafter: DFlashDrafter | None, prompts: list[torch.Tensor], method: str,
              max_new_tokens: int, stop_ids: set[int]) -> list[Generation]:
    if len(prompts) == 1:
        engine = HFEngine(target, drafter if method == "dflash" else None)
        return [generate(engine, prompts[0], method=method, max_new_tokens=max_new_tokens, stop_ids=stop_ids)]
    return generate_batch(target, drafter if method == "dflash" else None, prompts, method=method,
                          max_new_tokens=max_new_tokens, stop_ids=stop_ids)


def measure(target: Target, drafter: DFlashDrafter, prompts: list[torch.Tensor], method: str, batch: int,
            max_new_tokens: int, stop_ids: set[int]) -> tuple[float, list[Generation]]:
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    run_group(target, drafter, groups[0], method, min(16, max_new_tokens), stop_ids)  # warm-up, untimed
    sync(target.device)
    t0 = time.perf_counter()
    gens = [g for grp in groups for g in run_group(target, drafter, grp, method, max_new_tokens, stop_ids)]
    sync(target.device)
    return time.perf_counter() - t0, gens


def table(rows: list[dict[str, Any]]) -> str:
    head = ["method", "batch", "tokens", "seconds", "tokens/s", "speed-up", "tau", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['tau']:.2f} | {r['identical']}/{r['prompts']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="first N HumanEval prompts (default 8)")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--methods", default="ar,dflash")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--target", default=None, help="target path (default: the SmolLM2 testbed)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--json", help="write settings and rows here")
    args = p.parse_args()
    from dflashkit.data.prompts import load_prompts
    from dflashkit.evaluate import eval_prompts
    from dflashkit.vocab import stop_token_ids

    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    methods = args.methods.split(",")
    if 1 not in sizes or "ar" not in methods:
        raise SystemExit("--batch-sizes must include 1 and --methods must include ar: the speed-up baseline is AR at batch 1")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    prompts = [pr.ids for pr in eval_prompts(load_prompts("humaneval", limit=args.prompts), target.tokenizer)]
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))

    rows, first = [], {}
    for method in methods:
        for batch in sizes:
            seconds, gens = measure(target, drafter, prompts, method, batch, args.max_new_tokens, stops)
            first.setdefault(method, gens)
            tokens = sum(len(g.tokens) for g in gens)
            rounds = sum(g.rounds for g in gens)
            rows.append({"method": method, "batch": batch, "prompts": len(prompts), "tokens": tokens,
                         "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "tau": sum(sum(g.accept_lengths) for g in gens) / max(1, rounds),
                         "identical": sum(g.tokens == f.tokens for g, f in zip(gens, first[method]))})
            print(f"{method} batch {batch}: {tokens / seconds:.1f} tokens/s", flush=True)
    base = next(r for r in rows if r["method"] == "ar" and r["batch"] == 1)["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    settings = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "device": device, "dtype": args.dtype,
                "threads": torch.get_num_threads(), "target": args.target or "SmolLM2-135M-Instruct (testbed)",
                "drafter": str(args.drafter or "bundled smollm2-drafter")}
    print(f"\n{settings}\n\n{table(rows)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
