"""Batched decoding throughput, measured side by side: each method decodes the same prompts in
groups of `batch` prompts or through `batch` continuously refilled rows, after untimed passes over
the same work, the methods taking turns trial after trial (`benchmarks/bench_batch.py` is the
command line; its docstring defines the columns)."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflashkit.checkpoint import atomic_write_json
from dflashkit.decode.engine import Engine
from dflashkit.decode.generation import Generation
from dflashkit.decode.loop import generate_batch, make_engine
from dflashkit.decode.static import Graphs

WARM_PASSES = 3  # at most, before the timed one

Run = tuple[float, list[Generation], dict]  # a timed pass: seconds, generations, what it ran


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Label(NamedTuple):
    """A --methods label: the method, DDTree's budget, whether it decodes cost-aware, and the
    engine it decodes on: confidence, whether a drafter's confidence head scores its drafts
    (`Engine`; False: its probabilities do, '+cost')."""

    method: str
    budget: int | None
    cost_aware: bool
    confidence: bool


def parse_method(label: str) -> Label:
    """'ar' | 'dflash' | 'ddtree-N', each but 'ar' optionally with '+cost' (cost-aware on the
    drafter's probabilities, today's rule) or '+conf' (cost-aware on its confidence head) -> its
    `Label`. Plain labels decode on the default engine, whose drafts a confidence head scores."""
    m = re.fullmatch(r"ar|(dflash|ddtree-(\d+))(?:\+(cost|conf))?", label)
    if m is None:
        raise SystemExit(f"--methods: expected ar, dflash or ddtree-N (the last two optionally with +cost or "
                         f"+conf), got {label!r}")
    name, budget, scoring = m.groups()
    return Label(name.partition("-")[0] if name else "ar", int(budget) if budget else None, scoring is not None,
                 scoring != "cost")


def check_confidence(methods: list[str], drafter: Any, name: str) -> None:
    """'+conf' needs a drafter with a confidence head (DSpark's): refused in one line, before any
    engine is built."""
    conf = [m for m in methods if m.endswith("+conf")]
    if conf and drafter.confidence() is None:
        raise SystemExit(f"--methods: {','.join(conf)}: '+conf' scores drafts by a confidence head, and the drafter "
                         f"{name} ({drafter.config.kind}) has none; use +cost")


def drafter_engines(target: Any, drafter: Any, methods: list[str], kind: str, draft_tokens: int | None
                    ) -> dict[bool, Engine]:
    """The drafter's engines that `methods` decode on, by `Label.confidence`, each built only where
    a label needs it (`make_engine`). Without a confidence head both scorings are the
    probabilities': one engine serves both."""
    wanted = {parse_method(m).confidence for m in methods if m != "ar"}
    if wanted and drafter.confidence() is None:
        return dict.fromkeys(wanted, make_engine(target, drafter, kind, draft_tokens))
    return {c: make_engine(target, drafter, kind, draft_tokens, confidence=c) for c in wanted}


def counting(engine: Engine, counts: dict[str, int], **keys: str) -> None:
    """Count each call of the engine's methods named in `keys` (method=counter) into `counts`,
    until `del engine.<method>` brings back the class's method."""
    for name, key in keys.items():
        def wrapper(*a: Any, _fn: Any = getattr(engine, name), _key: str = key, **k: Any) -> Any:
            counts[_key] += 1
            return _fn(*a, **k)
        setattr(engine, name, wrapper)


def plan(prompts: list[torch.Tensor], label: str, batch: int, max_new_tokens: int, stop_ids: set[int],
         continuous: bool = False, refill: float = 0.25) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """-> the groups of prompts one pass decodes and `generate_batch`'s keywords for them."""
    method, budget, cost_aware, _ = parse_method(label)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    kw: dict[str, Any] = dict(method=method, budget=budget, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                              cost_aware=cost_aware)
    if continuous:  # every prompt through `batch` rows, a finished row's place to the next prompt
        groups, kw["rows"], kw["refill"] = [prompts], batch, refill
    return groups, kw


def warm(work: list[tuple[Engine, list[list[torch.Tensor]], dict[str, Any]]]) -> None:
    """Untimed passes over each configuration's work, so that graph capture and compilation stay
    out of the numbers: again while a pass captured graphs, because a cache that grew in a pass
    drops the graphs captured over its old buffers, and the next pass's early shapes need them."""
    for _ in range(WARM_PASSES):
        before = Graphs.captured
        for engine, groups, kw in work:
            for grp in groups:
                generate_batch(engine, grp, **kw)
        if Graphs.captured == before:
            break


def timed(engine: Engine, groups: list[list[torch.Tensor]], kw: dict[str, Any]) -> Run:
    """One timed pass -> seconds, the generations, and what it ran: batch rounds (verification
    passes), joins, and CUDA graphs captured (none, unless a shape the untimed passes never met)."""
    counts = {"batch_rounds": 0, "joins": 0}
    counting(engine, counts, verify="batch_rounds", join="joins")
    captured, eager = Graphs.captured, engine.eager_joins
    sync(engine.target.device)
    t0 = time.perf_counter()
    try:
        gens = [g for grp in groups for g in generate_batch(engine, grp, **kw)]
        sync(engine.target.device)
        seconds = time.perf_counter() - t0
    finally:
        del engine.verify, engine.join  # the class's methods again
    counts["captures"] = Graphs.captured - captured
    counts["eager_joins"] = engine.eager_joins - eager
    return seconds, gens, counts


def tokens_of(gens: list[Generation]) -> int:
    return sum(len(g.tokens) for g in gens)


def trial(run: Run) -> dict[str, float]:
    """A timed pass as the JSON keeps it before its row exists."""
    tokens = tokens_of(run[1])
    return {"seconds": run[0], "tokens": tokens, "tokens_per_s": tokens / run[0]}


def save(path: str | None, payload: dict[str, Any]) -> None:
    """The JSON so far, atomically: a run cut short (a command's time limit) keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(path), payload)


def take_turns(work: list, methods: list[str], trials: int, where: dict[str, Any], rows: list[dict],
               json_path: str | None) -> list[list[Run]]:
    """`trials` timed passes of every method, the methods taking turns so that a drift of the
    machine's speed weighs on all of them alike; the JSON keeps every finished trial."""
    runs: list[list[Run]] = [[] for _ in methods]
    for i in range(trials):
        for method, mine, w in zip(methods, runs, work):
            mine.append(timed(*w))
            done = {m: [trial(r) for r in rs] for m, rs in zip(methods, runs) if rs}
            save(json_path, {"rows": rows, "unfinished": {**where, "trials": done}})
            last = done[method][-1]
            print(f"{where['mode']} {method} batch {where['batch']}, trial {i + 1}: {last['seconds']:.3f} s, "
                  f"{last['tokens']} tokens", flush=True)
    return runs


def rows_of(mode: str, batch: int, methods: list[str], runs: list[list[Run]], prompts: int) -> list[dict]:
    """One row per method: its median trial, against AR's generations (`methods` starts with ar)."""
    medians = [sorted(mine, key=lambda r: r[0])[len(mine) // 2] for mine in runs]
    ar_gens, rows = medians[0][1], []
    for method, mine, (seconds, gens, counts) in zip(methods, runs, medians):
        tokens, rounds = tokens_of(gens), sum(g.rounds for g in gens)
        row = {"mode": mode, "method": method, "batch": batch, "prompts": prompts, "tokens": tokens,
               "seconds": seconds, "tokens_per_s": tokens / seconds, "trial_seconds": [r[0] for r in mine],
               "tau": sum(sum(g.accept_lengths) for g in gens) / max(1, rounds),
               "identical": sum(g.tokens == f.tokens for g, f in zip(gens, ar_gens)), **counts,
               # rows that decoded in a round, over the rows a round runs (idle and waiting rows cost the same)
               "occupancy": rounds / max(1, counts["batch_rounds"] * batch),
               "ms_per_round": 1e3 * seconds / max(1, counts["batch_rounds"])}
        if mode == "groups":  # a group runs as many rounds as its slowest row
            groups = [gens[i:i + batch] for i in range(0, len(gens), batch)]
            row["tail"] = sum(max(g.rounds for g in grp) * len(grp) for grp in groups) / max(1, rounds)
        rows.append(row)
        spread = f" (trials {min(row['trial_seconds']):.2f}-{max(row['trial_seconds']):.2f} s)" if len(mine) > 1 else ""
        print(f"{mode} {method} batch {batch}: {row['tokens_per_s']:.1f} tokens/s{spread}, τ {row['tau']:.2f}, "
              f"{counts['batch_rounds']} rounds of {row['ms_per_round']:.2f} ms, occupancy {row['occupancy']:.2f}, "
              f"{counts['joins']} joins ({counts['eager_joins']} groups eagerly), "
              f"{counts['captures']} graphs captured", flush=True)
    return rows


def measure(ar: Engine, spec: Mapping[bool, Engine], prompts: list[torch.Tensor], methods: list[str],
            sizes: list[int], modes: list[str], max_new_tokens: int, stop_ids: set[int], refill: float = 0.25,
            trials: int = 1, json_path: str | None = None) -> list[dict]:
    """Every mode and batch size: untimed passes, then the timed trials; -> a row per method, with
    its tokens/s against AR's at the same batch size (`vs_ar`) and at the smallest (`speedup`).
    `methods` starts with ar, which `ar` decodes; the others decode on the drafter's engine of
    their `Label.confidence` in `spec` (`drafter_engines`)."""
    rows: list[dict] = []
    for mode in modes:
        for batch in sizes:
            work = [(ar if m == "ar" else spec[parse_method(m).confidence],
                     *plan(prompts, m, batch, max_new_tokens, stop_ids, mode == "continuous", refill)) for m in methods]
            warm(work)
            runs = take_turns(work, methods, trials, {"mode": mode, "batch": batch}, rows, json_path)
            rows += rows_of(mode, batch, methods, runs, len(prompts))
            save(json_path, {"rows": rows})

    def ar_rate(mode: str, batch: int) -> float:
        return next(a for a in rows if a["method"] == "ar" and a["mode"] == mode and a["batch"] == batch)["tokens_per_s"]

    for r in rows:  # against AR in the same mode
        r["speedup"], r["vs_ar"] = r["tokens_per_s"] / ar_rate(r["mode"], sizes[0]), r["tokens_per_s"] / ar_rate(r["mode"], r["batch"])
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ["mode", "method", "batch", "tokens", "seconds", "tokens/s", "vs AR", "speed-up", "tau", "tail",
            "rounds", "ms/round", "occupancy", "joins", "captures", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tail = f"{r['tail']:.2f}x" if "tail" in r else "-"
        lines.append(f"| {r['mode']} | {r['method']} | {r['batch']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_ar']:.2f}x | {r['speedup']:.2f}x | {r['tau']:.2f} | {tail} | {r['batch_rounds']} | "
                     f"{r['ms_per_round']:.2f} | {r['occupancy']:.2f} | {r['joins']} | {r['captures']} | "
                     f"{r['identical']}/{r['prompts']} |")
    return "\n".join(lines)
