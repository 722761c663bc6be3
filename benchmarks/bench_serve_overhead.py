"""What the server costs outside decoding: detokenisation of streamed answers, and the HTTP/SSE
path under the load of `bench_serve.py` over a generator that costs nothing.

1. Detokenising one answer in chunks of 2 tokens, as the server streams it: incremental
   (`serve.text_so_far` with the fast tokenizer's DecodeStream) against decoding the whole answer
   again at every chunk (`text_so_far`'s fallback for tokenizers without a fast backend).
2. `dflashkit serve`'s app (`build_app`, `--max-batch` rows) in a child process over a generator
   that gives every running request 2 tokens every `--round-ms` milliseconds, under `--clients`
   streaming clients: the tokens/s that the HTTP path and the worker carry when decoding is free.

    python benchmarks/bench_serve_overhead.py --json out.json
    python benchmarks/bench_serve_overhead.py --loop asyncio --http h11    # uvicorn's pure-Python stack

Reported besides the load's numbers: the HTTP process's CPU time per streamed token (the engine
runs in a process of its own, as in `dflashkit serve`, so this no longer takes the interpreter
lock from the decoding rounds; it takes a core).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import load  # noqa: E402

from dflashkit.data.chat import load_tokenizer  # noqa: E402
from dflashkit.data.prompts import load_suite  # noqa: E402
from dflashkit.decode.generation import GenerationChunk  # noqa: E402
from dflashkit.serve import Admission, EngineProcess, Served, build_app, text_so_far  # noqa: E402
from dflashkit.vocab import stop_token_ids  # noqa: E402


class Free:
    """A `BatchedGenerator` that costs nothing: 2 tokens per running request every `dt` seconds."""

    def __init__(self, dt: float) -> None:
        self.dt = dt

    def generate(self, input_ids, **kw):
        yield from (chunk for step in self.generate_batch([(input_ids, kw)]) for _, chunk in step)

    def generate_batch(self, requests, cancelled=lambda i: False, admit=None):
        left = {i: kw["max_new_tokens"] for i, (_, kw) in enumerate(requests)}
        n = len(requests)
        while True:
            for _, kw in admit(len(left)) if admit is not None else []:
                left[n] = kw["max_new_tokens"]
                n += 1
            if not left:
                return
            time.sleep(self.dt)
            step = []
            for i in list(left):
                k = 0 if cancelled(i) else min(2, left[i])
                left[i] -= k
                if k:
                    step.append((i, GenerationChunk([300 + i % 50, 301][:k], None if left[i] else "length")))
                if not k or not left[i]:
                    del left[i]
            yield step


def detokenisation(tok, lengths: list[int]) -> list[dict]:
    class Fallback:  # no fast backend: the whole answer decoded again at every chunk
        decode = tok.decode

    rows, rng = [], random.Random(0)
    for n in lengths:
        ids = [rng.randrange(200, min(tok.vocab_size, 40000)) for _ in range(n)]
        ms = {}
        for name, t in (("incremental", tok), ("whole", Fallback())):
            step, t0 = text_so_far(t), time.perf_counter()
            for i in range(0, n, 2):
                step(ids[i:i + 2])
            ms[name] = 1e3 * (time.perf_counter() - t0)
        rows.append({"answer_tokens": n, "whole_ms": ms["whole"], "incremental_ms": ms["incremental"]})
        print(f"{n:5d} tokens: whole decode at every chunk {ms['whole']:7.1f} ms, incremental "
              f"{ms['incremental']:6.1f} ms ({ms['whole'] / ms['incremental']:.1f}x)", flush=True)
    return rows


def free_engine(dt: float):
    """In the engine's process: the generator that costs nothing."""
    tok = load_tokenizer()
    return Served(tok, "free", frozenset(stop_token_ids(tok, None)), 1 << 30), Free(dt)


def serve_free(port: int, rows: int, dt: float, loop: str, http: str) -> None:
    """`dflashkit serve`'s two processes (HTTP here, the engine in its own) over `Free`."""
    import uvicorn

    engine = EngineProcess(functools.partial(free_engine, dt), rows, 0, Admission())
    uvicorn.run(build_app(engine.served, engine), host="127.0.0.1", port=port, log_level="warning", loop=loop,
                http=http)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="128,512,2048", help="answer lengths for the detokenisation table")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--client-procs", type=int, default=1, metavar="N", help="spread the clients over N processes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=64, help="the server's --max-batch")
    p.add_argument("--round-ms", type=float, default=4.0)
    p.add_argument("--duration", type=float, default=25.0)
    p.add_argument("--loop", default="auto", help="uvicorn's event loop: auto (uvloop where installed), asyncio, uvloop")
    p.add_argument("--http", default="auto", help="uvicorn's HTTP protocol: auto (httptools where installed), h11, httptools")
    p.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--json")
    args = p.parse_args()
    if args.serve_port:
        return serve_free(args.serve_port, args.rows, args.round_ms / 1e3, args.loop, args.http)
    out = {"detokenisation": detokenisation(load_tokenizer(), [int(x) for x in args.lengths.split(",")])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, __file__, "--serve-port", str(port), "--rows", str(args.rows),
                              "--round-ms", str(args.round_ms), "--loop", args.loop, "--http", args.http])
    try:
        url = f"http://127.0.0.1:{port}/v1"
        import httpx
        for _ in range(600):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        prompts = [c.messages for c in load_suite("humaneval")]
        cpu0 = cpu_seconds(child.pid)
        r = load(url, args.clients, args.requests, args.duration, args.max_tokens, prompts, 0, args.client_procs)
        # The HTTP process's CPU time per token: what the HTTP path costs, whatever the machine's other load.
        r["server_cpu_us_per_token"] = 1e6 * (cpu_seconds(child.pid) - cpu0) / max(1, r["tokens"])
    finally:
        child.terminate()
        child.wait(30)
    out["free_generator"] = {k: v for k, v in r.items() if not isinstance(v, list) or k == "errors"}
    print(json.dumps(out["free_generator"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
