"""Batched decoding throughput: AR, DFlash and DDTree at several batch sizes on the SmolLM2 testbed
with the bundled drafter, first N HumanEval prompts through the chat template (as `dflashkit eval`).

Each configuration decodes the same N prompts in consecutive groups of `batch` (the last group
may be smaller), or in mode `continuous` (`--modes`) through `batch` rows that take the next
prompt once `--refill` of them are free (a group waits for its slowest row: at τ ≈ 2.7 some rows
need half as many rounds again as the mean), with `decode.loop.generate_batch` on one engine (`--engine`; 'auto' is the static
runner with CUDA graphs on a GPU). Rows stop at the target's stop tokens or `--max-new-tokens`, so
batches shrink as rows finish. tokens/s = generated tokens / wall time including prefill;
"vs AR" is against AR at the same batch size and mode, "speed-up" against AR at the smallest batch
size measured (1 by default); "tail" (groups
only): the row-rounds the groups ran (each row as many as its group's slowest) over those its
rows needed, what waiting for the slowest row costs. "rounds": the batch's verification passes in the
timed pass, "ms/round" the wall time per pass, "occupancy" the rows that decoded in a pass over the
rows a pass runs (`batch` on a CUDA-graph engine; elsewhere finished rows leave the batch and cost
nothing) (a finished row that waits for its group, or an idle row of a CUDA-graph batch
waiting for enough free rows to admit, costs as much as a decoding one), "joins" the admissions
(continuous; the JSON also counts the join groups prefilled eagerly, `eager_joins`: a prompt too long
for a staging pass), "captures" the CUDA graphs captured in the timed pass (0 unless it met a shape the
untimed passes did not). At each
batch size every method first runs its work untimed (CUDA-graph capture and compilation happen once
per shape; a shorter warm-up left them in whichever method ran first), again while a pass still
captured graphs (a cache that grew drops the graphs over its old buffers); then the methods take
turns for `--trials` timed passes each, and a row is its method's median trial (the JSON keeps
every trial's seconds). CUDA is synchronised before each clock read. "identical" counts rows
whose tokens equal AR's at the same batch size and mode (greedy; bf16 near-ties may part).

    python benchmarks/bench_batch.py --prompts 8 --max-new-tokens 64 --json runs/bench-batch-cpu.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts 32 --json out.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts 128 \
        --max-new-tokens 64 --methods ar,dflash --modes groups,continuous --json out.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 32 --prompts 164 --repeat 4 \
        --max-new-tokens 256 --methods ar,dflash --modes continuous --draft-tokens 7 --trials 5 --json out.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench_decode import add_baseline_options, apply_baseline_options
from dflashkit.commands import DRAFT_TOKENS_HELP, positive_int
from dflashkit.checkpoint import atomic_write_json, load_drafter
from dflashkit.decode.engine import Engine
from dflashkit.decode.generation import Generation
from dflashkit.decode.loop import generate_batch, make_engine
from dflashkit.decode.static import Graphs
from dflashkit.demo import bundled_drafter_dir
from dflashkit.target import load_target


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_method(label: str) -> tuple[str, int | None, bool]:
    """'ar' | 'dflash' | 'ddtree-N', each but 'ar' optionally with '+cost' -> (method, budget, cost-aware)."""
    name, _, budget = label.removesuffix("+cost").partition("-")
    if name not in ("ar", "dflash", "ddtree") or (budget and not budget.isdigit()) or (name == "ar" and label != "ar"):
        raise SystemExit(f"--methods: expected ar, dflash or ddtree-N (the last two optionally with +cost), got {label!r}")
    return name, int(budget) if budget else None, label.endswith("+cost")


WARM_PASSES = 3  # at most, before the timed one


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
    method, budget, cost_aware = parse_method(label)
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


def timed(engine: Engine, groups: list[list[torch.Tensor]], kw: dict[str, Any]) -> tuple[float, list[Generation], dict]:
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


def trial(run: tuple[float, list[Generation], dict]) -> dict[str, float]:
    """A timed pass as the JSON keeps it before its row exists."""
    tokens = tokens_of(run[1])
    return {"seconds": run[0], "tokens": tokens, "tokens_per_s": tokens / run[0]}


def save(path: str | None, payload: dict[str, Any]) -> None:
    """The JSON so far, atomically: a run cut short (a command's time limit) keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(path), payload)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="first N HumanEval prompts (default 8)")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--methods", default="ar,dflash,ddtree-16", help="comma list of ar, dflash, ddtree-N; "
                   "'+cost' after dflash or ddtree-N decodes cost-aware (`decode/cost.py`: verify only the draft "
                   "prefix that pays at this batch size, skip drafts that do not), e.g. dflash+cost")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "static"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default="groups",
                   help="comma list: groups (consecutive groups of `batch` prompts, each run to its longest row), "
                   "continuous (continuous batching, as `serve`: every prompt through `batch` rows, a finished "
                   "row's place going to the next prompt); both side by side in one process")
    p.add_argument("--continuous", action="store_true", help="the same as --modes continuous")
    p.add_argument("--refill", type=float, default=0.25,
                   help="with --continuous: prompts join once this share of the rows is free (default 0.25)")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="K",
                   help="queue the prompts K times (default 1). A continuous run ends by draining its rows, and there "
                   "the rows slowest to decode run nearly alone (for DFlash, those of the lowest τ); K > 1 comes "
                   "closer to a server under steady load")
    p.add_argument("--trials", type=positive_int, default=1, metavar="N",
                   help="time each configuration N times, the methods taking turns, and report each method's median "
                   "trial (default 1). Trials in one process agreed to a few percent; processes differed more "
                   "(AR at batch 32: 1.42-1.83 ms a round over four on one H100), so run it more than once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--target", default=None, help="target path (default: the SmolLM2 testbed)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help=DRAFT_TOKENS_HELP)
    p.add_argument("--json", help="write settings and rows here")
    add_baseline_options(p)
    args = p.parse_args()
    baselines = apply_baseline_options(args)
    from dflashkit.data.prompts import load_prompts
    from dflashkit.evaluate import eval_prompts
    from dflashkit.vocab import stop_token_ids

    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    methods = args.methods.split(",")
    modes = ["continuous"] if args.continuous else args.modes.split(",")
    if not set(modes) <= {"groups", "continuous"}:
        raise SystemExit(f"--modes: expected a comma list of groups and continuous, got {args.modes!r}")
    for label in methods:
        parse_method(label)
    if methods[0] != "ar":
        raise SystemExit(f"--methods must start with ar (the baselines are AR's), got {args.methods!r}")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    prompts = [pr.ids for pr in eval_prompts(load_prompts("humaneval", limit=args.prompts), target.tokenizer)] * args.repeat
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))

    engines = {"ar": make_engine(target, None, args.engine), "spec": make_engine(target, drafter, args.engine, args.draft_tokens)}
    rows = []
    for mode in modes:
        for batch in sizes:
            work = [(engines["ar" if m == "ar" else "spec"],
                     *plan(prompts, m, batch, args.max_new_tokens, stops, mode == "continuous", args.refill)) for m in methods]
            warm(work)
            # The methods take turns, trial after trial, so that a drift of the machine's speed
            # weighs on all of them alike; each row is its method's median trial.
            trials: list[list[tuple[float, list[Generation], dict]]] = [[] for _ in methods]
            for i in range(args.trials):
                for method, runs, w in zip(methods, trials, work):
                    runs.append(timed(*w))
                    done = {m: [trial(r) for r in rs] for m, rs in zip(methods, trials) if rs}  # for a run cut short
                    save(args.json, {"rows": rows, "unfinished": {"mode": mode, "batch": batch, "trials": done}})
                    last = done[method][-1]
                    print(f"{mode} {method} batch {batch}, trial {i + 1}: {last['seconds']:.3f} s, {last['tokens']} tokens",
                          flush=True)
            medians = [sorted(runs, key=lambda r: r[0])[len(runs) // 2] for runs in trials]
            ar_gens = medians[0][1]  # (--methods starts with ar)
            for method, runs, (seconds, gens, counts) in zip(methods, trials, medians):
                tokens = tokens_of(gens)
                rounds = sum(g.rounds for g in gens)
                row = {"mode": mode, "method": method, "batch": batch, "prompts": len(prompts), "tokens": tokens,
                       "seconds": seconds, "tokens_per_s": tokens / seconds, "trial_seconds": [r[0] for r in runs],
                       "tau": sum(sum(g.accept_lengths) for g in gens) / max(1, rounds),
                       "identical": sum(g.tokens == f.tokens for g, f in zip(gens, ar_gens)), **counts,
                       # rows that decoded in a round, over the rows a round runs (idle and waiting rows cost the same)
                       "occupancy": rounds / max(1, counts["batch_rounds"] * batch),
                       "ms_per_round": 1e3 * seconds / max(1, counts["batch_rounds"])}
                if mode == "groups":  # a group runs as many rounds as its slowest row
                    groups = [gens[i:i + batch] for i in range(0, len(gens), batch)]
                    row["tail"] = sum(max(g.rounds for g in grp) * len(grp) for grp in groups) / max(1, rounds)
                rows.append(row)
                spread = f" (trials {min(row['trial_seconds']):.2f}-{max(row['trial_seconds']):.2f} s)" if args.trials > 1 else ""
                print(f"{mode} {method} batch {batch}: {tokens / seconds:.1f} tokens/s{spread}, τ {row['tau']:.2f}, "
                      f"{counts['batch_rounds']} rounds of {row['ms_per_round']:.2f} ms, occupancy {row['occupancy']:.2f}, "
                      f"{counts['joins']} joins ({counts['eager_joins']} groups eagerly), "
                      f"{counts['captures']} graphs captured", flush=True)
            save(args.json, {"rows": rows})

    def ar(mode: str, batch: int) -> float:
        return next(a for a in rows if a["method"] == "ar" and a["mode"] == mode and a["batch"] == batch)["tokens_per_s"]

    for r in rows:  # against AR in the same mode
        r["speedup"], r["vs_ar"] = r["tokens_per_s"] / ar(r["mode"], sizes[0]), r["tokens_per_s"] / ar(r["mode"], r["batch"])
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    settings = {"prompts": len(prompts), "repeat": args.repeat, "trials": args.trials, "max_new_tokens": args.max_new_tokens, "modes": modes,
                "refill": args.refill if "continuous" in modes else None,
                "speedup_against_batch": sizes[0], "device": device, "dtype": args.dtype,
                "engine": args.engine, "runner": type(engines["spec"].run).__name__, **baselines,
                "threads": torch.get_num_threads(), "target": args.target or "SmolLM2-135M-Instruct (testbed)",
                "drafter": str(args.drafter or "bundled smollm2-drafter"), "draft_tokens": engines["spec"].block - 1}
    print(f"\n{settings}\n\n{table(rows)}")
    save(args.json, {"settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
