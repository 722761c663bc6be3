"""Writing `self:N` prompts: the first pass's draft factor, side by side in one run.

The target writes `--count` prompts with the shipped `assets/self_prompts.yaml` once per factor of
`--factors` (the first pass drafts what is missing times it; later passes draft 1.1x over the
share usable before, `data.selfprompts`). A message drafted past its category's quota is written
for nothing; too few drafts cost another pass, which runs its few rows alone. The table counts
messages drafted and usable per pass, and the wall time of the whole writing (after an untimed
warm-up on a GPU: graph captures).

    python benchmarks/bench_selfprompts.py --device cuda --dtype bfloat16 --count 8000 --batch 256 --json out.json
    python benchmarks/bench_selfprompts.py --count 60 --batch 16                      # 2 CPU cores: ~3 min
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

import dflashkit.data.selfprompts as selfprompts
from dflashkit.data.prompts import near_evaluation
from dflashkit.target import load_target


class Passes(logging.Handler):
    """Collects the writer's per-pass log records: (pass, written, count, usable, drafted, seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("self-written prompts, round"):
            self.rows.append(record.args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=8000, help="prompts to write per factor")
    p.add_argument("--batch", type=int, default=256, help="messages written at once")
    p.add_argument("--factors", default=f"1.3,{selfprompts.FIRST_FACTOR}",
                   help="first-pass draft factors to compare (1.3: before 2026-12-05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None,
                   help="prompts written untimed first (graph captures, compilation; default: --batch on a GPU, 0 on a CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json")
    a = p.parse_args()
    factors = [float(f) for f in a.factors.split(",") if f]
    if not factors or min(factors) < 1.0:
        p.error(f"--factors {a.factors!r}: expected comma-separated factors >= 1 (e.g. 1.3,1.05)")
    target = load_target(device=a.device, dtype=a.dtype)
    near = near_evaluation()
    passes = Passes()
    logging.getLogger(selfprompts.__name__).addHandler(passes)
    logging.getLogger(selfprompts.__name__).setLevel(logging.INFO)
    warmup = a.warmup if a.warmup is not None else (a.batch if a.device.startswith("cuda") else 0)
    if warmup:  # another seed: the timed runs find nothing of it
        selfprompts.write_prompts(target, warmup, near_eval=near, seed=a.seed + 1, batch_size=a.batch)
    rows = []
    for factor in factors:
        selfprompts.FIRST_FACTOR = factor
        passes.rows.clear()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        convs = selfprompts.write_prompts(target, a.count, near_eval=near, seed=a.seed, batch_size=a.batch)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        drafted, usable = sum(r[4] for r in passes.rows), sum(r[3] for r in passes.rows)
        rows.append({"first_factor": factor, "prompts": len(convs), "passes": len(passes.rows),
                     "drafted": drafted, "usable": usable, "per_pass": [[r[4], r[3]] for r in passes.rows],
                     "seconds": seconds, "prompts_per_s": len(convs) / seconds})
    base = rows[0]["seconds"]
    print(f"{'first factor':>12s} {'passes':>6s} {'drafted':>8s} {'usable':>7s} {'wasted':>7s} {'seconds':>8s} {'vs first':>8s}")
    for r in rows:
        print(f"{r['first_factor']:12.2f} {r['passes']:6d} {r['drafted']:8d} {r['usable']:7d} "
              f"{r['usable'] - r['prompts']:7d} {r['seconds']:8.1f} {base / r['seconds']:7.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": {**vars(a), "target": target.name,
                                                         "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"},
                                            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
