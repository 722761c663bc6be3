"""The built-in training prompt set, generated from the templates and vocabularies of
``assets/train_prompts.yaml`` (code, math, chat, writing, multi-turn).

Deterministic (a fixed seed): ``generate()`` is the packaged ``assets/train_prompts.jsonl``
(2,200 prompts; ``tools/make_train_prompts.py`` rewrites it), and ``load_prompts("builtin:N")``
calls ``generate(N)`` for a set of any size. A candidate is dropped when it repeats an earlier one
or comes near an evaluation prompt (``near_eval``: ``data.prompts.near_evaluation()`` tests every
suite and all of HumanEval for a shared run of words or a near-copy).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any
from importlib import resources
from pathlib import Path

import yaml


SEED = 20261201
COUNT = 2200  # the size of the packaged set
SLOT = re.compile(r"\{(\w+?)(\d*)(?::(\d+)-(\d+))?\}")


def templates_path() -> Path:
    return Path(str(resources.files("dflashkit") / "assets" / "train_prompts.yaml"))


def domain_path() -> Path:
    """The demo's domain: structured-output requests that the built-in set does not cover."""
    return Path(str(resources.files("dflashkit") / "assets" / "demo_domain.yaml"))


def fill(template: str, vocab: dict[str, list[str]], values: dict[str, str], r: random.Random) -> str:
    """Replace every slot; `values` keeps one value per slot name across a prompt's turns."""
    def one(m: re.Match) -> str:
        base, suffix, lo, hi = m.groups()
        key = base + suffix
        if key not in values:
            if lo is not None:
                values[key] = str(r.randint(int(lo), int(hi)))
            else:
                pool = vocab.get(key) or vocab.get(base)
                if pool is None:
                    raise KeyError(f"template slot {{{key}}} has no vocabulary {base!r}")
                taken = {values.get(base + s) for s in ("", "2", "3")}
                values[key] = r.choice([v for v in pool if v not in taken] or pool)
        return values[key]
    return SLOT.sub(one, template)


def generate(near_eval: Callable[[str], bool], count: int = COUNT, seed: int = SEED,
             spec_path: Path | None = None) -> list[dict]:
    """`count` records {"id": "<category>-NNNNN", "messages", "category"}, categories interleaved;
    none for which `near_eval(text)` is true. spec_path: templates and vocabularies (default
    the built-in set's, `templates_path()`)."""
    spec_path = spec_path or templates_path()
    spec = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    vocab, weights, categories = spec["vocab"], spec["weights"], spec["categories"]
    r = random.Random(seed)
    names = list(categories)
    quota = quotas(count, {c: weights[c] for c in names})
    seen: set[str] = set()
    made: dict[str, list[list[dict]]] = {c: [] for c in names}
    for c in names:
        tries = 0
        while len(made[c]) < quota[c]:
            tries += 1
            if tries > 50 * quota[c]:
                raise RuntimeError(f"{spec_path}: category {c!r} ran out of distinct prompts after "
                                   f"{len(made[c])}; add templates or vocabulary")
            template = r.choice(categories[c])
            turns = template if isinstance(template, list) else [template]
            values: dict[str, str] = {}
            try:
                texts = [fill(t, vocab, values, r) for t in turns]
            except KeyError as e:
                raise KeyError(f"{spec_path}: {e.args[0]}") from None
            key = "\n".join(texts)
            if key in seen or near_eval(key):
                continue
            seen.add(key)
            made[c].append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)])
    return [{"id": f"{c}-{i:05d}", "messages": m, "category": c} for i, (c, m) in enumerate(interleave(made, r), 1)]


def quotas(count: int, weights: dict[str, float]) -> dict[str, int]:
    """How many of `count` each category gets, in proportion to its weight (summing to `count`)."""
    quota = {c: round(count * w / sum(weights.values())) for c, w in weights.items()}
    quota[next(iter(quota))] += count - sum(quota.values())
    return quota


def interleave(made: dict[str, list], r: random.Random) -> list[tuple[str, Any]]:
    """(category, item) for every item, categories shuffled together (seeded) and each category's
    items kept in order, so that any prefix of the set covers every category."""
    order = [c for c in made for _ in made[c]]
    r.shuffle(order)
    its = {c: iter(items) for c, items in made.items()}
    return [(c, next(its[c])) for c in order]
