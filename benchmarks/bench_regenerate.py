"""`regenerate` throughput: the batched decoding engine against Transformers' `generate`, side by
side in one run, on the SmolLM2 testbed (built-in training prompts, greedy).

Every back-end answers the same prompts, longest first, with the target's stop tokens, in batches
of `--batch` (`refill`: at most `--batch` rows, a finished row refilled at once through
`decode_stream`'s admissions, as `serve` does; `refill-quarter`: refilled in groups once a quarter
of the rows is free, as `data.prompts: self:N` writes prompts; `regenerate` runs `refill` on an
engine with CUDA graphs, whole batches, `engine`, elsewhere). tokens/s = generated tokens / wall time of the whole pass (prefill included), after
an untimed pass over the first batches (graph capture, compilation). "identical" counts answers
whose tokens are equal between the two back-ends (bf16 near-ties may part).

    python benchmarks/bench_regenerate.py --device cuda --dtype bfloat16 --batch 256 --prompts 1024 --json out.json
    python benchmarks/bench_regenerate.py --prompts 8 --batch 4 --max-new-tokens 16      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_decode import add_baseline_options, apply_baseline_options
from dflashkit.data.chat import prompt_ids
from dflashkit.data.prompts import load_prompts
from dflashkit.data.regenerate import context_messages
from dflashkit.decode.loop import generate_batch, make_engine
from dflashkit.target import Target, load_target
from dflashkit.vocab import stop_token_ids


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


DRAFTER, METHOD = None, "ar"  # --drafter / --method: the same passes with speculative rounds
JOINS = {"count": 0, "seconds": 0.0}  # refill passes: admissions and the time they stopped the batch


def engine_pass(target: Target, batches: list[list[list[int]]], n: int, stops: set[int]) -> list[list[int]]:
    engine = make_engine(target, DRAFTER, "auto")
    return [g.tokens for b in batches for g in generate_batch(engine, [torch.tensor(p) for p in b], method=METHOD,
                                                              max_new_tokens=n, stop_ids=stops)]


def refill_pass(target: Target, batches: list[list[list[int]]], n: int, stops: set[int],
                refill: float = 0.0) -> list[list[int]]:
    """At most --batch rows, finished rows refilled with the next prompts once `refill` of the rows
    are free (`generate_batch(rows=...)`: continuous batching through `decode_stream`'s admissions,
    as `serve` does). JOINS: the admissions and the time the running rows waited for them."""
    engine = make_engine(target, DRAFTER, "auto")
    join = engine.join

    def timed_join(*a, **kw):
        sync(target.device)
        t = time.perf_counter()
        out = join(*a, **kw)
        sync(target.device)
        JOINS["count"] += 1
        JOINS["seconds"] += time.perf_counter() - t
        return out

    engine.join = timed_join
    JOINS.update(count=0, seconds=0.0)
    gens = generate_batch(engine, [torch.tensor(p) for b in batches for p in b], rows=len(batches[0]), refill=refill,
                          method=METHOD, max_new_tokens=n, stop_ids=stops)
    return [g.tokens for g in gens]


def transformers_pass(target: Target, batches: list[list[list[int]]], n: int, stops: set[int]) -> list[list[int]]:
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(stops)
    out = []
    for b in batches:
        w = max(len(p) for p in b)
        x = torch.tensor([[pad] * (w - len(p)) + p for p in b], device=target.device)
        real = torch.tensor([[k >= w - len(p) for k in range(w)] for p in b], device=target.device).long()
        y = target.model.generate(input_ids=x, attention_mask=real, max_new_tokens=n, do_sample=False,
                                  pad_token_id=pad, eos_token_id=sorted(stops))[:, w:].tolist()
        for row in y:
            cut = next((k for k, t in enumerate(row) if t in stops), None)
            out.append(row if cut is None else row[:cut + 1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--backends", default="engine,refill,transformers",
                   help="engine: whole batches (what regenerate runs without CUDA graphs); refill: rows refilled "
                        "as they finish (what it runs with them); refill-quarter: refilled once a quarter of the "
                        "rows is free; transformers")
    p.add_argument("--drafter", help="a drafter directory: speculative rounds (--method) instead of AR")
    p.add_argument("--method", default="dflash", choices=("dflash", "ddtree"), help="with --drafter (default dflash)")
    p.add_argument("--json")
    add_baseline_options(p)
    args = p.parse_args()
    baselines = apply_baseline_options(args)
    target = load_target(None, dtype=args.dtype, device=args.device)
    if args.drafter:
        global DRAFTER, METHOD
        from dflashkit.checkpoint import load_drafter
        DRAFTER, METHOD = load_drafter(args.drafter, target, device=target.device, dtype=target.dtype), args.method
    stops = set(stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None)))
    convs = load_prompts("builtin", limit=args.prompts)
    ids = sorted((prompt_ids(target.tokenizer, context_messages(c)) for c in convs), key=lambda x: -len(x))
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
    rows, answers = [], {}
    for name in args.backends.split(","):
        run = {"engine": engine_pass, "refill": refill_pass, "transformers": transformers_pass,
               "refill-quarter": lambda *a: refill_pass(*a, refill=0.25)}[name]
        run(target, batches[:2], min(16, args.max_new_tokens), stops)  # warm-up, untimed
        sync(target.device)
        t = time.perf_counter()
        answers[name] = run(target, batches, args.max_new_tokens, stops)
        sync(target.device)
        seconds = time.perf_counter() - t
        tokens = sum(len(a) for a in answers[name])
        rows.append({"backend": name, "prompts": len(ids), "batch": args.batch, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds, "method": METHOD,
                     **({"joins": JOINS["count"], "join_seconds": JOINS["seconds"]} if "refill" in name else {})})
        joins = f" ({JOINS['count']} joins: {JOINS['seconds']:.2f} s)" if "refill" in name else ""
        print(f"{name:12s} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tokens/s{joins}", flush=True)
    if "transformers" in answers:  # each back-end against Transformers' generate
        ref = next(r for r in rows if r["backend"] == "transformers")
        for r in rows:
            if r is not ref:
                r["identical"] = sum(x == y for x, y in zip(answers[r["backend"]], answers["transformers"]))
                r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
                print(f"{r['backend']}: {r['speedup']:.2f}x Transformers; identical answers {r['identical']}/{len(ids)}")
    device = torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                                               **baselines, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
