"""Partings: where a greedy speculative output parts from the autoregressive one, and why.

The target's top logits at that position, as recorded by the two passes that chose the two tokens
(a one-token step of the autoregressive run, the verification block of the speculative run, with
the caches each run had built), are classified by `classify_parting`: numerical when both tokens
lie within a few units of rounding of the top logit in both passes. Beyond that bound, in bf16 or
fp16, `arbitrate_parting` measures both passes against float32 arithmetic at the same position:
numerical when the verification pass is about as exact as the one-token step and the two tokens
are as close as the passes' own measured errors allow (or float32 puts them closer than either
pass's error). Anything else is unexplained, which fails the evaluation.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable

import torch
from torch import Tensor

from dflashkit.target import Target


# A parting counts as numerical when both tokens are within this many units in the last place (of
# the evaluation dtype, at the logit's magnitude) of the top logit, in both passes. The two passes
# round hidden states differently through every layer, so their logits may sit a few final-
# rounding steps apart; a real decoding error puts the speculative token far below the top.
# round hidden states differently through every layer, so their logits may sit a few final-
# rounding steps apart; a real decoding error puts the speculative token far below the top.
NUMERICAL_ULPS = 4
TOP_RECORDED = 8  # logits per output token that greedy decoding records for this check


def rounding_bound(magnitude: float, dtype: torch.dtype, ulps: int = NUMERICAL_ULPS) -> float:
    """`ulps` spacings of `dtype` at `magnitude` (bf16: 2**(e - 7) for |x| in [2**e, 2**(e+1)))."""
    fi = torch.finfo(dtype)
    return ulps * fi.eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), fi.tiny)))


def classify_parting(ar_top: tuple[list[int], list[float]], spec_top: tuple[list[int], list[float]], ar_token: int,
                     spec_token: int, dtype: torch.dtype, ulps: int = NUMERICAL_ULPS) -> dict[str, Any]:
    """Where greedy outputs part: AR chose `ar_token`, the speculative method `spec_token`. Per
    pass (the target's top-k ids and logits at the parting position, recorded by the pass that
    chose the token: a one-token step, a verification block): the top-2 margin and how far each
    of the two tokens lies below the top logit (a token outside the recorded top-k: at least the
    k-th gap). Numerical iff both gaps are within `rounding_bound` in both passes."""
    passes, magnitude = {}, 0.0
    for name, (ids, values) in (("ar", ar_top), ("verify", spec_top)):
        def gap(token: int) -> float:
            return values[0] - (values[ids.index(token)] if token in ids else values[-1])

        passes[name] = {"top2_margin": values[0] - values[1], "ar_token_gap": gap(ar_token),
                        "spec_token_gap": gap(spec_token), "in_top_k": ar_token in ids and spec_token in ids}
        magnitude = max(magnitude, abs(values[0]))
    bound = rounding_bound(magnitude, dtype, ulps)
    numerical = ar_token != spec_token and all(
        p["in_top_k"] and max(p["ar_token_gap"], p["spec_token_gap"]) <= bound for p in passes.values())
    return {"ar_token": ar_token, "spec_token": spec_token, "bound": bound, "ulps": ulps,
            "dtype": str(dtype).removeprefix("torch."), "passes": passes, "numerical": numerical}


# Beyond the ulp bound, a parting is checked against float32 arithmetic at the same position
# (`arbitrate_parting`): each pass's error is measured there, on the recorded tokens other than the
# two that parted, and the two must be as close as those errors allow.
PAIR_SLACK = 1.5  # the parting pair's error may exceed the largest of the others by this factor
VERIFY_SLACK = 4.0  # the verification pass may be this many times as far from float32 as the one-token step


def arbitrate_parting(parting: dict[str, Any], ar_top: tuple[list[int], list[float]],
                      spec_top: tuple[list[int], list[float]], exact: Tensor) -> dict[str, Any]:
    """A parting that `classify_parting` could not call numerical, against `exact` [V]: the
    target's logits at the parting position computed in float32 over the common prefix. Per pass,
    the deviation from float32 of each recorded logit, less the pass's common shift (the median
    deviation: a shift moves no argmax); `error` is the largest over the recorded tokens other than
    the two that parted, and `pair_error` how far the pass's gap between the two lies from
    float32's. Numerical iff both tokens are recorded in both passes, the verification pass's
    error is within VERIFY_SLACK x the one-token step's, plus the ulp bound (a verification that
    saw the wrong context, positions or mask would be far from float32 where the one-token step
    is not), and either each pass's pair_error is within PAIR_SLACK x its error (the parting pair
    is as rounded as any other token) or float32 puts the two tokens closer than both passes' errors
    (neither pass can order them: which one wins is decided by rounding)."""
    a, b = parting["ar_token"], parting["spec_token"]
    out: dict[str, Any] = {"exact_gap": float(exact[a] - exact[b]), "passes": {}}
    for name, (ids, values) in (("ar", ar_top), ("verify", spec_top)):
        if a not in ids or b not in ids:
            return {**out, "numerical": False, "reason": f"the {name} pass did not record both tokens"}
        dev = {i: v - float(exact[i]) for i, v in zip(ids, values)}
        shift = sorted(dev.values())[len(dev) // 2]
        others = [abs(d - shift) for i, d in dev.items() if i not in (a, b)]
        out["passes"][name] = {"error": max(others, default=0.0), "pair_error": abs(dev[a] - dev[b])}
    ar, ver = out["passes"]["ar"], out["passes"]["verify"]
    passes = out["passes"].values()
    tied = abs(out["exact_gap"]) <= min(p["error"] for p in passes)
    numerical = ((tied or all(p["pair_error"] <= PAIR_SLACK * p["error"] for p in passes))
                 and ver["error"] <= VERIFY_SLACK * ar["error"] + parting["bound"])
    return {**out, "numerical": numerical}


def exact_logits(target: Target) -> Callable[[list[int]], Tensor | None]:
    """ids [T] -> the target's float32 logits at the last position [V], from a float32 copy of the
    model made on first use (None where the copy does not fit)."""

    @functools.cache
    def fp32_model() -> Any:
        try:
            return copy.deepcopy(target.model).float()
        except torch.OutOfMemoryError:
            return None

    def logits(ids: list[int]) -> Tensor | None:
        model = fp32_model()
        if model is None:
            return None
        return model(input_ids=torch.tensor([ids], device=target.device), logits_to_keep=1).logits[0, -1].float()

    return logits


def where_parted(ar: Any, spec: Any, prompt_ids: Tensor, dtype: torch.dtype,
                 exact: Callable[[list[int]], Tensor | None]) -> dict[str, Any]:
    """Where a greedy speculative output (`spec`) parts from the autoregressive one (`ar`), and
    whether that is a numerical near-tie (`classify_parting`; beyond its bound in bf16/fp16,
    `arbitrate_parting` against float32 logits from `exact`)."""
    k = next((k for k, (a, b) in enumerate(zip(spec.tokens, ar.tokens)) if a != b), None)
    if k is None:  # one output a prefix of the other: no token choice to explain
        return {"position": min(len(spec.tokens), len(ar.tokens)), "numerical": False,
                "reason": "one output is a prefix of the other"}
    parting = classify_parting(ar.top[k], spec.top[k], ar.tokens[k], spec.tokens[k], dtype)
    if not parting["numerical"] and dtype != torch.float32:
        logits = exact(prompt_ids[0].tolist() + ar.tokens[:k])
        if logits is not None:
            parting["float32"] = arbitrate_parting(parting, ar.top[k], spec.top[k], logits)
            parting["numerical"] = parting["float32"]["numerical"]
    return {"position": k, **parting}


def _prompt_label(row: dict[str, Any]) -> str:
    """'suite/prompt' of a per_prompt row ('prompt' outside suites)."""
    return f"{row.get('suite', '') and row['suite'] + '/'}{row['id']}"


def unexplained_partings(report: dict[str, Any]) -> list[str]:
    """'suite/prompt drafter/method at position k' for every parting not classified numerical."""
    out = []
    for row in report.get("per_prompt", []):
        for key, p in row.get("partings", {}).items():
            if not p["numerical"]:
                out.append(f"{_prompt_label(row)} {key} at output position {p['position']}")
    return out


def check_partings(report: dict[str, Any]) -> None:
    """Raise when a greedy output parted from autoregressive decoding other than at a near-tie."""
    bad = unexplained_partings(report)
    if bad:
        raise RuntimeError(f"{len(bad)} greedy output(s) part from autoregressive decoding where the target's top "
                           f"logits are not tied within rounding (not a numerical effect): " + "; ".join(bad[:10]))


def parting_summary(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"drafter/method": {partings, numerical, unexplained: [suite/prompt ...]}}: every greedy
    output that parted from autoregressive decoding, and how `classify_parting` classified it."""
    out: dict[str, dict[str, Any]] = {}
    for row in report.get("per_prompt", []):
        for key, p in row.get("partings", {}).items():
            s = out.setdefault(key, {"partings": 0, "numerical": 0, "unexplained": []})
            s["partings"] += 1
            if p["numerical"]:
                s["numerical"] += 1
            else:
                s["unexplained"].append(_prompt_label(row))
    return out
