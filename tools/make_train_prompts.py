#!/usr/bin/env python3
"""Write the built-in training prompt set, ``src/dflashkit/assets/train_prompts.jsonl``, with
``dflashkit.data.trainset.generate`` (templates: ``src/dflashkit/assets/train_prompts.yaml``).

    python3 tools/make_train_prompts.py                               # rewrites the asset (2,200)
    python3 tools/make_train_prompts.py --count 22000 --out big.jsonl  # ten times more

Training needs no file for other sizes: ``data.prompts: builtin:22000`` generates them in memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # runnable from a checkout without installing the package

from dflashkit.checkpoint import atomic_write_bytes  # noqa: E402
from dflashkit.data.prompts import builtin_prompts_path, near_evaluation  # noqa: E402
from dflashkit.data.trainset import COUNT, SEED, generate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=COUNT, help=f"prompts to generate (default {COUNT})")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=str(builtin_prompts_path()), help="output JSONL (default: the packaged asset)")
    a = p.parse_args()
    records = generate(near_evaluation(), a.count, a.seed)
    atomic_write_bytes(Path(a.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    print(f"wrote {len(records)} prompts to {a.out}")


if __name__ == "__main__":
    main()
