"""Summaries shared by online and offline evaluation: τ statistics and method labels."""

from __future__ import annotations

from typing import Any, Sequence


def summarize(taus: Sequence[int], block_size: int) -> dict[str, Any]:
    """τ mean, histogram over 1..B and per-slot acceptance P(τ > k) for k = 1..B-1."""
    n = len(taus)
    hist = [sum(1 for t in taus if t == k) for k in range(1, block_size + 1)]
    return {"tau": sum(taus) / n if n else 0.0, "rounds": n, "hist": hist,
            "slot_acceptance": [sum(1 for t in taus if t > k) / n if n else 0.0 for k in range(1, block_size)]}


def method_labels(methods: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """[(label, method, budget)]: 'dflash' and 'ddtree-<budget>' for every budget."""
    out = []
    for m in methods:
        if m == "dflash":
            out.append(("dflash", "dflash", None))
        elif m == "ddtree":
            out += [(f"ddtree-{b}", "ddtree", b) for b in budgets]
        else:
            raise ValueError(f"--methods: expected 'dflash' and/or 'ddtree', got {m!r}")
    return out
