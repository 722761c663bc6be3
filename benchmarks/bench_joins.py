"""How a continuous batch's joins are prefilled: staging passes (CUDA graphs on a GPU) or eagerly.

Continuous batching (`decode.loop.generate_batch(rows=...)`, as `serve` runs) admits requests
into the places of finished rows once `--refill` of the rows are free. On a graph engine a join
is prefilled in power-of-two groups by staging engines whose passes replay captured graphs, and
only a group no staging pass holds runs eagerly on a fresh engine, which every running row waits
for (`Engine.join`). This script runs the graph engine's scheduling and join logic without the
graphs, so it runs on a CPU too, on the SmolLM2 testbed with the bundled drafter and the first N
HumanEval prompts, and prints each join's group sizes, how many ran eagerly, τ, the batch's
rounds and its occupancy (rows that decoded in a round over the rows a round runs: on a graph
engine, finished rows waiting for enough free places to admit cost as much as decoding ones),
beside the rounds groups mode would run and the rounds with every row always busy. Which groups
form depends on when rows end, that is on the drafter's acceptance: AR's rows of equal length end
together, DFlash's do not. What each part of a join costs on a GPU: `profile_joins.py`.

    python benchmarks/bench_joins.py --rows 32 --prompts 128 --max-new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_batch import counting
from dflashkit.checkpoint import load_drafter
from dflashkit.data.prompts import load_prompts
from dflashkit.decode import static
from dflashkit.decode.engine import Engine
from dflashkit.decode.loop import generate_batch
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts
from dflashkit.target import load_target
from dflashkit.vocab import stop_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="rows of the batch (default 32)")
    p.add_argument("--prompts", type=int, default=128, help="first N HumanEval prompts (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--method", default="dflash", choices=("ar", "dflash"))
    p.add_argument("--refill", type=float, default=0.25, help="share of free rows that admits a join (default 0.25)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    target = load_target()
    drafter = load_drafter(bundled_drafter_dir(), target, dtype=target.dtype)
    prompts = [pr.ids for pr in eval_prompts(load_prompts("humaneval", limit=args.prompts), target.tokenizer)]
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    # The graph engine's settings (`static.static_engine` on CUDA), its passes run eagerly.
    engine = Engine(target, drafter if args.method == "dflash" else None,
                    static.StaticRunner(target, list(drafter.config.target_layer_ids)))
    engine.slot_bucket, engine.fixed_rows = static.SLOT_BUCKET, True
    engine.small_pass, engine.join_pass = static.SMALL_PASS_TOKENS, static.JOIN_PASS_TOKENS
    groups: list[tuple[int, bool]] = []  # (prompts, eagerly) per prefill of a join group
    stage = engine._stage

    def recorded(ps):
        eager = engine.eager_joins
        new = stage(ps)
        groups.append((len(ps), engine.eager_joins > eager))
        return new

    engine._stage = recorded
    counts = {"batch_rounds": 0}
    counting(engine, counts, verify="batch_rounds")
    t0 = time.perf_counter()
    gens = generate_batch(engine, prompts, rows=args.rows, refill=args.refill, method=args.method,
                          max_new_tokens=args.max_new_tokens, stop_ids=stops)
    row_rounds = sum(g.rounds for g in gens)
    out = {"settings": vars(args), "seconds": time.perf_counter() - t0,
           "tau": sum(len(g.tokens) for g in gens) / max(1, row_rounds),
           # the batch's passes, and the rows that decoded in them over the rows they ran
           **counts, "occupancy": row_rounds / max(1, counts["batch_rounds"] * args.rows),
           # groups mode (`bench_batch.py --modes groups`): each group of `rows` prompts runs to its
           # slowest row (a prompt's rounds do not depend on its batch; its first token is the prefill's)
           "groups_rounds": sum(max(g.rounds for g in gens[i:i + args.rows]) for i in range(0, len(gens), args.rows)),
           "ideal_rounds": row_rounds / args.rows,
           "join_groups": [m for m, _ in groups], "eager_groups": [m for m, e in groups if e]}
    print(f"{args.method}, {args.rows} rows, {len(prompts)} prompts: τ {out['tau']:.2f}; {counts['batch_rounds']} batch rounds "
          f"(groups mode: {out['groups_rounds']}, all rows busy: {out['ideal_rounds']:.1f}), "
          f"occupancy {out['occupancy']:.2f}; "
          f"{len(groups)} join groups prefilled, {len(out['eager_groups'])} eagerly "
          f"(sizes {out['eager_groups']}); group sizes {out['join_groups']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
