"""Speed-ups that other load on the machine cannot skew.

Each prompt is decoded autoregressively and by every method one right after the other (in an
order that rotates from prompt to prompt), so a prompt's timings share the machine's load of the
moment. Per prompt and method, the cost of a round in autoregressive steps is

    cost = τ / speed-up = τ · (seconds / tokens) / (autoregressive seconds / autoregressive tokens),

a property of the machine and the method, not of how well the drafter guesses that prompt. A
set of prompts then reports speed-up = τ / median(cost): a load that changes between two methods
skews the one prompt it falls in, which the median ignores (a sum of seconds over prompts would
carry it into the ratio). The spread of the cost over prompts says how far the timings can be
trusted: where its central 80 % spans more than WIDE_SPREAD, the machine's load changed while it
ran, and the report says so. A round verifies at least one token with a target pass, so it costs
at least one autoregressive step and a speed-up above τ is not credible: the report flags it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

WIDE_SPREAD = 1.5  # the slow end of the central 80 % of round costs over the fast end, beyond which timings are untrusted
SPREAD = (0.1, 0.9)  # the quantiles of the round costs that bound the spread


def round_cost(tau: float, tokens: int, seconds: float, ar_tokens: int, ar_seconds: float) -> float:
    """A round's cost in autoregressive steps on one prompt (τ over that prompt's speed-up)."""
    speedup = (tokens / max(seconds, 1e-9)) / (ar_tokens / max(ar_seconds, 1e-9))
    return tau / max(speedup, 1e-9)


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of xs, linear between order statistics (NaN when empty)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    at = q * (len(s) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def speedup_stats(tau: float, costs: Sequence[float], decode_costs: Sequence[float]) -> dict[str, Any]:
    """The speed-up of a set of prompts from their τ and their per-prompt round costs (whole
    generations; `decode_costs`: after the first token), with its spread over prompts and flags."""
    if not costs:
        return {"speedup": 0.0, "decode_speedup": 0.0, "speedup_interval": (0.0, 0.0), "round_cost": math.nan,
                "spread_wide": False, "above_tau": False}
    median = quantile(costs, 0.5)
    fast, slow = (quantile(costs, q) for q in SPREAD)
    speedup = tau / median
    return {"speedup": speedup, "decode_speedup": tau / quantile(decode_costs, 0.5),
            "speedup_interval": (tau / slow, tau / fast), "round_cost": median,
            "spread_wide": slow > WIDE_SPREAD * fast, "above_tau": speedup > tau}


def speedup_mark(m: dict[str, Any]) -> str:
    """The report's mark of a speed-up: '!' above τ (not credible), '~' spread too wide to trust."""
    return ("!" if m.get("above_tau") else "") + ("~" if m.get("spread_wide") else "")


SPEEDUP_LEGEND = (f"Speed-up = τ / the median over prompts of a round's cost in autoregressive steps (each prompt "
                  f"timed by every method in turn, so a change of load between methods skews one prompt, which the "
                  f"median ignores). Marks: `~` the round cost's central 80 % over prompts spans more than "
                  f"{WIDE_SPREAD}x, too wide to trust (other load on the machine); `!` above τ, not credible (a round "
                  f"costs at least one autoregressive step).")
