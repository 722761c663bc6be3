"""Serving under load: N concurrent streaming clients against `dflashkit serve` on localhost.

Each client sends chat requests one after another (prompts of an evaluation suite, in turn;
max_tokens drawn per request between a quarter of `--max-tokens` and all of it, the same
sequence for every server) until `--requests` have been sent in all or `--duration` seconds have
passed. Before the timed run, every client sends one short untimed request (CUDA-graph capture
and compilation stay out of the numbers). Reported per server: completion tokens/s over the
whole run (wall time), time to first token (first streamed text) and request latency, p50 and
p99, failed requests, and how busy the busiest client process was (CPU time over wall time: near
1.0, the load script, not the server, set the pace; `--client-procs` spreads the clients).

Servers: `--url` points at running ones; `--pythonpath DIR` launches `dflashkit serve` from the
checkout whose package lies in DIR (e.g. an older commit's `src`, unpacked as below), `--server-cmd CMD`
launches a command line; launched servers get `--port 0 SERVER_ARGS EXTRA_ARGS` and run one after
another, so several servers compare side by side in one run with the same load. `--extra-args`,
given once per launched server (in the order --pythonpath, then --server-cmd), adds arguments to
that server alone (and to its label), e.g. the old worker, joins at every round and grouped joins:

    mkdir -p /tmp/old && git archive 8f29bb1 src | tar -x -C /tmp/old
    python benchmarks/bench_serve.py --pythonpath /tmp/old/src --pythonpath src --clients 8 --max-tokens 32 \\
        --server-args "--max-batch 8 target.device=cpu"
    python benchmarks/bench_serve.py --pythonpath /tmp/old/src --pythonpath src --pythonpath src \\
        --server-args "--max-batch 8 target.device=cpu" --extra-args= --extra-args="--join-min-free 1" --extra-args=
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 --clients 64 --json runs/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shlex
import sys
import time
from typing import Any

import httpx

from dflashkit.data.prompts import load_suite
from dflashkit.serve import subprocess_server


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request -> its time to first token, latency and completion tokens."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"].get("message", "error")}
            if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return {"ttft": latency if ttft is None else ttft, "latency": latency, "tokens": tokens}


async def _clients(url: str, clients: int, work: list[tuple[list[dict], int]], duration: float,
                   ready: Any = None, go: Any = None) -> dict[str, Any]:
    """`clients` streaming clients working through `work` (one untimed short request each first)."""
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        await asyncio.gather(*(one_request(client, url, work[i % len(work)][0], 4) for i in range(clients)))
        if ready is not None:  # one of several processes: start the timed run together
            ready.put(True)
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
        results: list[dict[str, Any]] = []
        t0, cpu0 = time.perf_counter(), time.process_time()

        async def client_loop() -> None:
            while work and time.perf_counter() - t0 < duration:
                messages, n = work.pop(0)
                sent = time.perf_counter() - t0
                try:
                    results.append({**await one_request(client, url, messages, n), "sent": sent})
                except httpx.HTTPError as e:
                    results.append({"error": f"{type(e).__name__}: {e}"})

        await asyncio.gather(*(client_loop() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"results": results, "seconds": wall, "cpu_seconds": time.process_time() - cpu0}


def _client_process(url: str, clients: int, work: list, duration: float, ready: Any, go: Any, out: Any) -> None:
    out.put(asyncio.run(_clients(url, clients, work, duration, ready, go)))


def load(url: str, clients: int, requests: int, duration: float, max_tokens: int, prompts: list[list[dict]],
         seed: int, procs: int = 1) -> dict[str, Any]:
    """The timed run, its clients spread over `procs` processes so that the load script itself (one
    event loop parsing every streamed event) does not cap what a server can show."""
    rng = random.Random(seed)
    work = [(prompts[i % len(prompts)], rng.randint(max(1, max_tokens // 4), max_tokens)) for i in range(requests)]
    procs = max(1, min(procs, clients))
    if procs == 1:
        parts = [asyncio.run(_clients(url, clients, work, duration))]
    else:
        ctx = multiprocessing.get_context("spawn")
        ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
        children = [ctx.Process(target=_client_process, daemon=True,
                                args=(url, clients // procs + (p < clients % procs), work[p::procs], duration,
                                      ready, go, out)) for p in range(procs)]
        for c in children:
            c.start()
        for _ in children:
            ready.get(timeout=600)
        go.set()
        parts = [out.get() for _ in children]
        for c in children:
            c.join()
    results = [r for part in parts for r in part["results"]]
    wall = max(part["seconds"] for part in parts)
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    # Near 1, a client process was busy all the time: the load script may be what caps throughput.
    busy = max(part["cpu_seconds"] / part["seconds"] for part in parts if part["seconds"] > 0)
    return {"requests": len(ok), "failed": len(results) - len(ok), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            **{f"{key}_p{q}": percentile([r[key] for r in ok], q) for key in ("ttft", "latency") for q in (50, 99)},
            "client_procs": procs, "client_busy": busy,
            # where a tail of slow first tokens comes from: (seconds into the run it was sent, its TTFT)
            "ttft_slowest": sorted(([round(r["sent"], 3), round(r["ttft"], 3)] for r in ok), key=lambda x: -x[1])[:12],
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def table(rows: list[dict[str, Any]]) -> str:
    head = ["server", "requests", "failed", "tokens", "seconds", "tokens/s", "TTFT p50", "TTFT p99", "latency p50",
            "latency p99", "client busy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['server']} | {r['requests']} | {r['failed']} | {r['tokens']} | {r['seconds']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | "
                     f"{r['latency_p50']:.2f} s | {r['latency_p99']:.2f} s | "
                     f"{r['client_busy']:.2f} x {r['client_procs']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", default=[], help="a running server's base URL (…/v1); repeatable")
    p.add_argument("--pythonpath", action="append", default=[], metavar="DIR",
                   help="launch `dflashkit serve` with PYTHONPATH=DIR (a checkout's src); repeatable")
    p.add_argument("--server-cmd", action="append", default=[], metavar="CMD",
                   help="launch this command line (`--port 0` and the server args are appended; it must print "
                   "'listening on URL'); repeatable")
    p.add_argument("--server-args", default="--max-batch 64",
                   help="arguments of every launched server (default: %(default)s)")
    p.add_argument("--extra-args", action="append", default=[], metavar="ARGS",
                   help="more arguments for one launched server, after --server-args: give it once per launched "
                   "server, in order (--pythonpath ones, then --server-cmd ones); write --extra-args=ARGS")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    p.add_argument("--client-procs", type=int, default=min(4, max(1, (os.cpu_count() or 2) // 4)), metavar="N",
                   help="spread the clients over N processes (default: %(default)s here, a quarter of the cores "
                   "up to 4); the table's 'client busy' near 1.0 means the load script itself was the limit")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: 4 per client)")
    p.add_argument("--duration", type=float, default=600.0, help="stop sending new requests after S seconds")
    p.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens of a request (default 128)")
    p.add_argument("--suite", default="humaneval", help="prompts: an evaluation suite (default humaneval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a launched server may take to start")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if args.clients < 1 or args.max_tokens < 1 or args.duration <= 0:
        raise SystemExit("--clients and --max-tokens must be >= 1, --duration > 0")
    requests = args.requests or 4 * args.clients
    prompts = [c.messages for c in load_suite(args.suite)]
    serve = [sys.executable, "-m", "dflashkit.cli", "serve"]
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []  # e.g. wheels installed aside
    launched = [(f"PYTHONPATH={d}", serve, {"PYTHONPATH": os.pathsep.join([os.path.abspath(d), *inherited])})
                for d in args.pythonpath]
    launched += [(c, shlex.split(c), {}) for c in args.server_cmd]
    if not launched and not args.url:
        launched = [("this checkout", serve, {})]
    if args.extra_args and len(args.extra_args) != len(launched):
        raise SystemExit(f"--extra-args: {len(args.extra_args)} given for {len(launched)} launched servers "
                         "(give it once per launched server, or not at all)")
    extra = args.extra_args or [""] * len(launched)
    servers: list[tuple[str, list[str] | None, dict[str, str], str]] = [(u, None, {}, "") for u in args.url]
    servers += [(f"{label} {more}".strip(), cmd, env, more) for (label, cmd, env), more in zip(launched, extra)]
    rows = []
    for label, cmd, env, more in servers:
        if cmd is None:
            result = load(label, args.clients, requests, args.duration, args.max_tokens, prompts, args.seed,
                          args.client_procs)
        else:
            argv = [*cmd, "--port", "0", *shlex.split(args.server_args), *shlex.split(more)]
            with subprocess_server(argv, {**os.environ, **env}, args.start_timeout) as url:
                result = load(url, args.clients, requests, args.duration, args.max_tokens, prompts, args.seed,
                              args.client_procs)
        rows.append({"server": label, "clients": args.clients, "max_tokens": args.max_tokens,
                     "server_args": f"{args.server_args} {more}".strip() if cmd else None, **result})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{args.clients} clients, {requests} requests, max_tokens up to {args.max_tokens}, suite {args.suite}\n")
    print(table(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
