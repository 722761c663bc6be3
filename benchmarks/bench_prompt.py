"""What a prompt costs besides its rounds: prefill (time to first token), the first round (whose
draft takes in the whole prompt's features), later rounds, and tokens/s of short answers, on the
engine `make_engine` gives (random weights: τ = 1, so every round does its full work).

Prompts of `--prompt-len` + 7 i tokens (ragged, i < --prompts) are decoded in groups of `batch`
rows, one stream per group, after an untimed pass over the same work (graph captures and
compilation happen once per shape). Each group runs to 2 tokens (prefill + one round) and to
`--new-tokens`: "first round" is the 2-token run's round, "round" the mean of the others.

    python benchmarks/bench_prompt.py --target smollm2 --batches 1,8 --json out.json   # GPU
    python benchmarks/bench_prompt.py --tiny                                           # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_decode import DRAFTER_LAYERS, SHAPES, make_models, sync
from dflashkit.decode.loop import generate_batch, make_engine


def timed(engine, prompts: list[torch.Tensor], batch: int, method: str, new: int) -> dict:
    sync(engine.target.device)
    t0 = time.perf_counter()
    gens = []
    for i in range(0, len(prompts), batch):
        gens += generate_batch(engine, prompts[i:i + batch], max_new_tokens=new, method=method)
    sync(engine.target.device)
    seconds = time.perf_counter() - t0
    rounds = sum(g.rounds for g in gens)
    return {"seconds": seconds, "tokens": sum(len(g.tokens) for g in gens),
            "prefill_ms": 1e3 * sum(g.prefill_seconds for g in gens) / len(gens),
            "round_ms": 1e3 * sum(g.decode_seconds for g in gens) / max(1, rounds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same kind, on the CPU")
    ap.add_argument("--methods", default="ar,dflash")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.target][1 if args.tiny else 0]
    target, drafter = make_models(shape, device, dtype, drafter_layers=2 if args.tiny else DRAFTER_LAYERS.get(args.target, 5),
                                  llama=args.target == "smollm2")
    torch.manual_seed(0)
    prompts = [torch.randint(0, shape["vocab_size"] - 2, (args.prompt_len + 7 * i,), device=device)
               for i in range(args.prompts)]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "target": args.target, "tiny": args.tiny, "prompts": args.prompts,
                 "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": []}
    print(f"| method | batch | prefill ms | first round ms | round ms | tokens/s ({args.new_tokens} new) |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        engine = make_engine(target, drafter if method != "ar" else None)
        for batch in (int(b) for b in args.batches.split(",")):
            for new in (2, args.new_tokens):  # untimed: captures and compilation
                timed(engine, prompts, batch, method, new)
            first, full = timed(engine, prompts, batch, method, 2), timed(engine, prompts, batch, method, args.new_tokens)
            row = {"method": method, "batch": batch, "prefill_ms": full["prefill_ms"], "first_round_ms": first["round_ms"],
                   "round_ms": full["round_ms"], "tokens_per_s": full["tokens"] / full["seconds"]}
            res["rows"].append(row)
            print(f"| {method} | {batch} | {row['prefill_ms']:.2f} | {row['first_round_ms']:.2f} | {row['round_ms']:.3f} "
                  f"| {row['tokens_per_s']:.1f} |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
