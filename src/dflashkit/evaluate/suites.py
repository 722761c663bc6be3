"""Evaluation suites side by side: one online evaluation per suite, saved as each finishes
(`--resume`), pooled, with the mean over suites as the headline and bootstrap intervals over prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from dflashkit import versions
from dflashkit.drafter import DFlashDrafter
from dflashkit.evaluate.online import Prompt, evaluate_online
from dflashkit.evaluate.speed import speedup_stats
from dflashkit.target import Target

log = logging.getLogger(__name__)

SAVED_FORMAT = 2  # of a saved report (2: per-prompt round costs, speed-up spreads); one saved in another is evaluated again


def pooled_method(ms: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """One drafter's method over several reports (`ms`, their per_prompt `rows`): sums of tokens,
    seconds and rounds; τ, histogram and slot acceptance weighted by rounds; the speed-up from
    every prompt's round cost (`speed.speedup_stats`)."""
    rounds = sum(m["rounds"] for m in ms)
    tokens, seconds = sum(m["tokens"] for m in ms), sum(m["seconds"] for m in ms)
    tau = sum(m["tau"] * m["rounds"] for m in ms) / max(rounds, 1)
    costs = [row["round_cost"][key] for row in rows if key in row.get("round_cost", {})]
    out = {"tau": tau, "rounds": rounds, "hist": [sum(h) for h in zip(*(m["hist"] for m in ms))],
           "slot_acceptance": [sum(m["slot_acceptance"][i] * m["rounds"] for m in ms) / max(rounds, 1)
                               for i in range(len(ms[0]["slot_acceptance"]))],
           "tokens": tokens, "seconds": seconds, "decode_seconds": sum(m["decode_seconds"] for m in ms),
           "tokens_per_s": tokens / max(seconds, 1e-9),
           **speedup_stats(tau, [c for c, _ in costs], [d for _, d in costs]),
           "identical": None if ms[0]["identical"] is None else all(m["identical"] for m in ms),
           "mismatches": [x for m in ms for x in m["mismatches"]],
           "unexplained_partings": [x for m in ms for x in m["unexplained_partings"]],
           "identical_prompts": None if ms[0]["identical"] is None else sum(m["identical_prompts"] for m in ms)}
    if all("draft_sizes" in m for m in ms):
        out["draft_sizes"] = {k: sum(m["draft_sizes"][k] * m["rounds"] for m in ms) / max(rounds, 1)
                              for k in ("mean", "drafted_share")}
    return out


def pool_reports(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Online reports of disjoint prompt sets -> one report over all of their prompts (`pooled_method`)."""
    first = parts[0]
    base = {k: sum(p["baseline"][k] for p in parts) for k in ("tokens", "seconds", "decode_seconds")}
    base["tokens_per_s"] = base["tokens"] / max(base["seconds"], 1e-9)
    rows = [row for p in parts for row in p["per_prompt"]]
    drafters: dict[str, Any] = {}
    for name, d in first["drafters"].items():
        methods = {lab: pooled_method([p["drafters"][name]["methods"][lab] for p in parts], rows, f"{name}/{lab}")
                   for lab in d["methods"]}
        drafters[name] = {"block_size": d["block_size"], "kind": d.get("kind", "dflash"), "methods": methods,
                          **({"cost_curves": d["cost_curves"]} if "cost_curves" in d else {})}
    return {"mode": "online", "prompts": sum(p["prompts"] for p in parts), "greedy": first["greedy"],
            "dtype": first["dtype"], "baseline": base, "drafters": drafters, "per_prompt": rows}


def drafters_digest(drafters: dict[str, DFlashDrafter]) -> str:
    """SHA-256 of the drafters' names and weights (hashed once per evaluation: a drafter may be GBs)."""
    h = hashlib.sha256()
    for name, d in drafters.items():
        h.update(name.encode())
        for key, t in sorted(d.state_dict().items()):
            h.update(key.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def suite_fingerprint(target: Target, drafters_sha: str, suite: Any, prompts: Sequence[Prompt],
                      kw: dict[str, Any]) -> str:
    """What a suite's result depends on: the target (name, dtype, device), the drafters (their
    `drafters_digest`), the suite's prompts and answer length, every decoding setting, and the
    versions of dflashkit, torch and transformers."""
    h = hashlib.sha256(drafters_sha.encode())
    for pr in prompts:
        h.update(pr.id.encode())
        h.update(pr.ids.cpu().numpy().tobytes())
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else target.device.type
    settings = {"format": SAVED_FORMAT, "versions": versions(), "target": target.name, "dtype": str(target.dtype),
                "device": device, "suite": suite.name, "max_new_tokens": suite.max_new_tokens,
                **{k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in kw.items()}}
    h.update(json.dumps(settings, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def saved_suite(path: Path, key: str) -> dict[str, Any] | None:
    """The suite report saved at `path` if its fingerprint is `key`, else None."""
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict) or not isinstance(old.get("report"), dict):
            raise ValueError("expected {fingerprint, report}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable saved suite ({e}); delete it to evaluate the suite again") from None
    if old.get("fingerprint") != key:
        log.info("%s was saved with other drafters, prompts or settings; evaluating the suite again", path)
        return None
    log.info("reusing the suite saved in %s", path)
    return old["report"]


def evaluate_suites(target: Target, drafters: dict[str, DFlashDrafter], suites: Sequence[tuple[Any, Sequence[Prompt]]],
                    *, keep: Path | None = None, reuse: bool = False, **kw: Any) -> dict[str, Any]:
    """`evaluate_online` per suite ((Suite, prompts) pairs: each with its own answer length), then
    the suites side by side: per drafter and method the τ and speed-up of each suite, their mean
    (the headline: every suite weighs the same, whatever its prompt count) and the worst suite.
    The pooled report over all prompts keeps the single-set fields (histograms, plots).

    keep: a directory where each finished suite's report is saved (`SUITE.json`, atomically), so
    that a stopped evaluation loses at most the suite it was in; reuse: take a saved suite instead
    of evaluating it again when its fingerprint (`suite_fingerprint`) matches."""
    from dflashkit.checkpoint import atomic_write_bytes

    parts, table, reused = [], {}, []
    weights_sha = drafters_digest(drafters) if keep is not None else ""
    for suite, prompts in suites:
        saved = keep / f"{suite.name}.json" if keep is not None else None
        key = suite_fingerprint(target, weights_sha, suite, prompts, kw) if saved is not None else None
        rep = saved_suite(saved, key) if reuse and saved is not None else None
        if rep is not None:
            reused.append(suite.name)
        else:
            rep = evaluate_online(target, drafters, prompts, max_new_tokens=suite.max_new_tokens,
                                  desc=f"suite {len(parts) + 1}/{len(suites)} {suite.name}", **kw)
            for row in rep["per_prompt"]:
                row["suite"] = suite.name
            if saved is not None:  # key order kept: the report lists drafters and methods as given
                keep.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(saved, json.dumps({"fingerprint": key, "report": rep}).encode())
        parts.append(rep)
        table[suite.name] = {"prompts": rep["prompts"], "max_new_tokens": suite.max_new_tokens,
                             "baseline_tokens_per_s": rep["baseline"]["tokens_per_s"],
                             "drafters": {n: {lab: {k: m[k] for k in ("tau", "rounds", "speedup", "speedup_interval", "spread_wide",
                                                                     "above_tau", "identical", "mismatches",
                                                                     "draft_sizes", "slot_acceptance") if k in m}
                                              for lab, m in d["methods"].items()} for n, d in rep["drafters"].items()}}
    report = pool_reports(parts)
    headline: dict[str, Any] = {}
    for name, d in report["drafters"].items():
        headline[name] = {}
        for lab in d["methods"]:
            per = {s: t["drafters"][name][lab] for s, t in table.items()}
            worst = min(per, key=lambda s: per[s]["tau"])
            best = max(per, key=lambda s: per[s]["tau"])
            headline[name][lab] = {"mean_tau": sum(m["tau"] for m in per.values()) / len(per),
                                   "mean_speedup": sum(m["speedup"] for m in per.values()) / len(per),
                                   "worst_suite": worst, "worst_tau": per[worst]["tau"],
                                   "best_suite": best, "best_tau": per[best]["tau"],
                                   # how evenly the drafter serves the suites: 1 = alike
                                   "worst_to_best": per[worst]["tau"] / max(per[best]["tau"], 1e-9)}
            spread = bootstrap_intervals(prompt_rounds(report, name, lab, list(table)))
            for s in table:
                table[s]["drafters"][name][lab]["tau_interval"] = spread[s]
            headline[name][lab].update(mean_tau_interval=spread["mean"], worst_to_best_interval=spread["worst_to_best"])
    report.update(suites=table, headline=headline)
    if reused:  # their timings come from the earlier run that saved them
        report["reused_suites"] = reused
    report["differences"] = paired_differences(report, list(table))
    return report


def paired_differences(report: dict[str, Any], suites: list[str]) -> dict[str, dict[str, Any]]:
    """The first drafter named (the new one, as `--drafter new=... --drafter old=...` is written)
    against each later one, per method: τ differences per suite and of the mean, with paired 90 %
    intervals over prompts (`bootstrap_intervals(..., against=...)`)."""
    first, *others = list(report["drafters"])
    per = {s: report["suites"][s]["drafters"] for s in suites}
    out: dict[str, dict[str, Any]] = {}
    for other in others:
        for lab in report["drafters"][first]["methods"]:
            spread = bootstrap_intervals(prompt_rounds(report, first, lab, suites),
                                         against=prompt_rounds(report, other, lab, suites))
            out.setdefault(f"{first} - {other}", {})[lab] = {
                **{s: {"diff": per[s][first][lab]["tau"] - per[s][other][lab]["tau"], "interval": spread[s]}
                   for s in suites},
                "mean": {"diff": report["headline"][first][lab]["mean_tau"] - report["headline"][other][lab]["mean_tau"],
                         "interval": spread["mean"]}}
    return out


def prompt_rounds(report: dict[str, Any], name: str, lab: str, suites: list[str]) -> dict[str, list[tuple[float, int]]]:
    """Per suite, each prompt's (τ, rounds) for one drafter and method: what `bootstrap_intervals` resamples."""
    key = f"{name}/{lab}"
    return {s: [(r["tau"][key], r["rounds"][key]) for r in report["per_prompt"] if r["suite"] == s] for s in suites}


def bootstrap_intervals(rows: dict[str, list[tuple[float, int]]], against: dict[str, list[tuple[float, int]]] | None = None,
                        draws: int = 2000, level: float = 0.9, seed: int = 0) -> dict[str, tuple[float, float]]:
    """How far a suite's τ could move with other prompts of the same kind: `rows` holds per suite
    each prompt's (τ, rounds); every draw resamples each suite's prompts with replacement and pools
    them (τ = tokens / rounds, as the suite's own τ). -> per suite, and for the mean over suites and
    the worst/best ratio, the central `level` interval of the draws. against: another drafter's
    rows on the same prompts: then the intervals are of the differences (rows - against), each draw
    taking the same prompts for both (paired, so a difference is known far better than either τ)."""
    rng = random.Random(seed)
    names = [s for s in rows if rows[s]]
    samples: dict[str, list[float]] = {s: [] for s in [*names, "mean", "worst_to_best"]}

    def pooled(prompts: list[tuple[float, int]], idx: list[int]) -> float:
        return sum(prompts[i][0] * prompts[i][1] for i in idx) / max(sum(prompts[i][1] for i in idx), 1)

    def summary(taus: dict[str, float]) -> dict[str, float]:
        return {**taus, "mean": sum(taus.values()) / len(taus),
                "worst_to_best": min(taus.values()) / max(max(taus.values()), 1e-9)}

    for _ in range(draws if names else 0):
        idx = {s: [rng.randrange(len(rows[s])) for _ in rows[s]] for s in names}
        stats = summary({s: pooled(rows[s], idx[s]) for s in names})
        if against is not None:
            other = summary({s: pooled(against[s], idx[s]) for s in names})
            stats = {k: v - other[k] for k, v in stats.items()}
        for k, v in stats.items():
            samples[k].append(v)

    def central(xs: list[float]) -> tuple[float, float]:
        xs = sorted(xs)
        if not xs:
            return (math.nan, math.nan)
        cut = (1 - level) / 2
        return (xs[int(cut * (len(xs) - 1))], xs[math.ceil((1 - cut) * (len(xs) - 1))])

    return {s: central(v) for s, v in samples.items()}
