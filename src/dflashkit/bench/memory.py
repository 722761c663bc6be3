"""Searching for the longest length whose work fits a memory budget."""

from __future__ import annotations

from typing import Any, Callable


def bisect_longest(fits: Callable[[int], bool], start: int, known_fit: int | None, mult: int,
                   tries: int) -> dict[str, Any]:
    """The longest length (a multiple of `mult`) for which `fits`, monotone in the length, holds:
    try `start`, grow by a quarter while it fits and nothing failed yet, else bisect between the
    longest length that fitted and the shortest that did not, for at most `tries` calls. ->
    {fits: longest that fitted (None: none tried did), fails_at: shortest that did not, tried}."""
    lo, hi, tried, T = known_fit, None, [], start
    for _ in range(tries):
        tried.append(T)
        if fits(T):
            lo = T
        else:
            hi = T
        if hi is None:
            T = (T * 5 // 4) // mult * mult
        elif lo is None:
            T = (T * 3 // 4) // mult * mult
        else:
            T = (lo + hi) // 2 // mult * mult
        if (hi is not None and lo is not None and hi - lo <= mult) or T in tried:
            break
    return {"fits": lo, "fails_at": hi, "tried": tried}
