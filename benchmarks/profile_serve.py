"""Where a server's time goes: its engine and round loop in-process, under the load of `bench_serve.py`.

The server's own `serve.Engine` (continuous batching, `--max-batch` rows) over the decoding
generator that `dflashkit serve` builds (SmolLM2 + the bundled drafter, DFlash), warmed up as the
server warms up, then: `--clients` concurrent clients send 4-token requests (untimed, as the load
script's warm-up), then HumanEval requests with token limits drawn between 32 and 128 for
`--duration` seconds. Reports throughput and time to first token, the round times (a round =
one verification), and every CUDA-graph capture and join with its wall time, and Dynamo's
recompilations (`TORCH_LOGS=recompiles` says why): a capture that takes seconds is a compilation
in the middle of serving. This is how the 52 s drafter compilation of docs/benchmarks.md
(serving, session 8) was found.

    python benchmarks/profile_serve.py --json out.json                 # GPU
    python benchmarks/profile_serve.py --device cpu --clients 2 --duration 2 --rows 2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

import dflashkit.decode.static as static
from dflashkit.checkpoint import load_drafter
from dflashkit.data.prompts import load_suite
from dflashkit.decode import engine as engine_mod
from dflashkit.decode.loop import DecodingGenerator, make_engine
from dflashkit.serve import Admission, Engine
from dflashkit.target import load_target

BUNDLED = Path(__file__).resolve().parents[1] / "src/dflashkit/assets/smollm2-drafter"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64, help="the server's --max-batch")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of timed requests")
    p.add_argument("--json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    events: list[dict] = []
    rounds: list[float] = []

    capture = static.Graphs.__call__

    def graphs_call(self, *a):
        key = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in a)
        new = self.buffers() != self.where or key not in self.graphs
        t = time.perf_counter()
        out = capture(self, *a)
        if new:
            sync()
            events.append({"at_s": round(t - t0, 2), "what": getattr(self.fn, "__name__", "graph"), "key": str(key),
                           "seconds": round(time.perf_counter() - t, 3)})
        return out

    verify, join = engine_mod.Engine.verify, engine_mod.Engine.join

    def timed_verify(self, *a, **kw):
        rounds.append(time.perf_counter())
        return verify(self, *a, **kw)

    def timed_join(self, prompts, rows, capacity):
        t = time.perf_counter()
        out = join(self, prompts, rows, capacity)
        sync()
        events.append({"at_s": round(t - t0, 2), "what": "join", "key": f"{len(prompts)} prompts",
                       "seconds": round(time.perf_counter() - t, 3)})
        return out

    static.Graphs.__call__ = graphs_call
    engine_mod.Engine.verify, engine_mod.Engine.join = timed_verify, timed_join

    target = load_target(dtype="bfloat16" if cuda else "float32", device=args.device)
    drafter = load_drafter(BUNDLED, target, device=target.device, dtype=target.dtype)
    gen = DecodingGenerator(make_engine(target, drafter), method="dflash", rows=args.rows)
    t = time.perf_counter()
    gen.warm_up(target.tokenizer("Hello, world!")["input_ids"])
    warm_up_s = time.perf_counter() - t
    prompts = [target.tokenizer.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=True)
               for c in load_suite("humaneval")]
    prompts = [list(x) if isinstance(x, list) else list(x["input_ids"]) for x in prompts]

    def params(n: int) -> dict:
        return dict(max_new_tokens=n, temperature=0.0, top_p=1.0, seed=None, stop_ids=set())

    async def one(engine: Engine, ids: list[int], n: int) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), None, 0
        job = engine.submit(ids, **params(n))
        while (chunk := await job.out.get()) is not None:
            if isinstance(chunk, Exception):
                raise chunk
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens += len(chunk.token_ids)
        return ttft, tokens

    async def load() -> dict:
        engine = Engine(gen, max_batch=args.rows, admission=Admission(max(1, args.rows // 4), 0.1))
        await asyncio.gather(*(one(engine, prompts[i % len(prompts)], 4) for i in range(args.clients)))
        rng = random.Random(0)
        work = [(prompts[i % len(prompts)], rng.randint(32, 128)) for i in range(4 * args.clients)]
        results, start, first_round = [], time.perf_counter(), len(rounds)

        async def client() -> None:
            while work and time.perf_counter() - start < args.duration:
                ids, n = work.pop(0)
                results.append(await one(engine, ids, n))

        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - start
        engine.close()
        ttfts = sorted(r[0] for r in results)
        gaps = sorted(b - a for a, b in zip(rounds[first_round:], rounds[first_round + 1:]))
        pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
        return {"requests": len(results), "tokens": sum(r[1] for r in results), "seconds": wall,
                "tokens_per_s": sum(r[1] for r in results) / wall, "ttft_p50": pick(ttfts, 0.5),
                "ttft_p99": pick(ttfts, 0.99), "rounds": len(gaps) + 1,
                **{f"round_ms_p{int(q * 100)}": 1000 * pick(gaps, q) for q in (0.1, 0.5, 0.9, 1.0)}}

    result = asyncio.run(load())
    stats = {k: dict(v) for k, v in __import__("torch._dynamo.utils", fromlist=["counters"]).counters.items()
             if k in ("stats", "recompiles", "graph_break")}
    print(f"warm-up {warm_up_s:.1f} s; {result['requests']} requests, {result['tokens']} tokens in "
          f"{result['seconds']:.1f} s: {result['tokens_per_s']:,.0f} tokens/s; TTFT p50 {result['ttft_p50']:.2f} s, "
          f"p99 {result['ttft_p99']:.2f} s; round ms p10/p50/p90/max {result['round_ms_p10']:.1f} / "
          f"{result['round_ms_p50']:.1f} / {result['round_ms_p90']:.1f} / {result['round_ms_p100']:.1f}")
    print("| at s | what | key | seconds |\n|---:|---|---|---:|")
    for e in events:
        print(f"| {e['at_s']} | {e['what']} | `{e['key']}` | {e['seconds']} |")
    print("dynamo:", stats)
    if args.json:
        Path(args.json).write_text(json.dumps({"warm_up_s": warm_up_s, **result, "events": events, "dynamo": stats},
                                              indent=1))


if __name__ == "__main__":
    main()
