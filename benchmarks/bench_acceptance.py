"""Sampled τ under the two acceptance rules: 'match' (the drafter's likeliest tokens, accepted
when equal to the target's sample) against 'rejection' (drafts drawn from the drafter's
distribution, accepted with min(1, p/q); decode/accept.py), per suite, DFlash and DDTree, at each
temperature, beside greedy τ.

Every suite's prompts (SmolLM2 testbed and the bundled drafter by default) are answered by
`decode.loop.generate_batch` at the suite's answer length, stopping at the target's stop tokens,
prompt i sampled with seed `--seed` + i. τ is pooled over rounds per suite, as `dflashkit eval`
reports it; 'rej/match' is the ratio of the two rules' τ, with the 90 % interval of their
difference over prompts (paired bootstrap, `evaluate.suites.bootstrap_intervals`); 'rej/greedy'
is sampled τ under the rejection rule over greedy τ. The mean row is the mean over suites.

Calibration (DFlash under the rejection rule, every round): per slot k reached, the rule's
expected acceptance Σ min(p, q) (= 1 − TV(p, q)), what the match rule would expect of the same
slot, p(argmax q), and the observed acceptance. Where the drafter's q is sharper than the
target's p (a drafter trained on the target's greedy answers), the two expectations meet and the
rules draft alike.

    python benchmarks/bench_acceptance.py --limit 4 --json runs/acceptance-cpu.json          # CPU fp32, a few prompts
    python benchmarks/bench_acceptance.py --device cuda --dtype bfloat16 --json runs/acceptance.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.checkpoint import atomic_write_bytes, load_drafter
from dflashkit.data.prompts import EVAL_SUITES, get_suite, load_prompts
from dflashkit.decode import accept
from dflashkit.decode.generation import Sampling, distribution
from dflashkit.decode.loop import generate_batch, make_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts
from dflashkit.evaluate.suites import bootstrap_intervals
from dflashkit.target import load_target
from dflashkit.vocab import stop_token_ids

Rows = dict[str, list[tuple[float, int]]]  # per suite, each prompt's (τ, rounds)
SLOTS = 4  # calibration columns


class Calibration:
    """Wraps `accept.picked_tokens` to sum, over DFlash's rounds (chains), per slot reached, the
    expected acceptance of either rule and the observed one (see the module's docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.key: str | None = None  # the suite and temperature of a DFlash run under the rejection rule
        self.picked = accept.picked_tokens
        accept.picked_tokens = self

    def __call__(self, trees: Any, drawn: accept.Drawn, logits: Tensor, settings: accept.Settings) -> Tensor:
        picked = self.picked(trees, drawn, logits, settings)
        if self.key is None:
            return picked
        tokens = trees.tokens
        m = min(tokens.shape[1], SLOTS)
        p = distribution(logits[:, :m], *settings.rows(m)).double()
        qm = drawn.q[:, :m].double()
        hit = (picked[:, :m] == tokens[:, :m]).long()
        reached = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], 1).cumprod(1).double()  # [b, m]
        row = torch.stack([reached, reached * accept.expected_acceptance(p, qm),
                           reached * p.gather(2, qm.argmax(-1, keepdim=True))[..., 0], reached * hit]).sum(1).cpu()
        total = self.sums.setdefault(self.key, torch.zeros(4, SLOTS, dtype=torch.float64))
        total[:, :m] += row
        return picked

    def table(self) -> dict[str, list[dict[str, float]]]:
        print("\n| suite, T | slot | rounds reaching it | expected, rejection: Σ min(p, q) | expected, match: p(argmax q) "
              "| observed, rejection |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        out: dict[str, list[dict[str, float]]] = {}
        for key, (n, rej, match, seen) in self.sums.items():
            for k in range(SLOTS):
                if n[k] > 0:
                    out.setdefault(key, []).append({
                        "slot": k + 1, "rounds": float(n[k]), "expected_rejection": float(rej[k] / n[k]),
                        "expected_match": float(match[k] / n[k]), "observed": float(seen[k] / n[k])})
                    r = out[key][-1]
                    print(f"| {key} | {k + 1} | {int(n[k])} | {r['expected_rejection']:.3f} | {r['expected_match']:.3f} | "
                          f"{r['observed']:.3f} |")
        return out


def pooled(rows: list[tuple[float, int]]) -> float:
    return sum(t * r for t, r in rows) / max(sum(r for _, r in rows), 1)


def decode_all(args: argparse.Namespace, calibration: Calibration) -> dict[str, Rows]:
    """Per configuration 'T/label/rule' (greedy: 'T0/label'), per suite, each prompt's (τ, rounds)."""
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    engine = make_engine(target, drafter)
    methods = [("dflash", "dflash", None), (f"ddtree-{args.budget}", "ddtree", args.budget)]
    out: dict[str, Rows] = {}
    for name in args.suites.split(","):
        suite = get_suite(name)
        prompts = [pr.ids[0] for pr in eval_prompts(load_prompts(f"suite:{name}", limit=args.limit), target.tokenizer)]
        for temperature in [0.0, *args.temperatures]:
            for label, method, budget in methods:
                for rule in ("match", "rejection") if temperature > 0 else ("match",):
                    t0 = time.perf_counter()
                    sampling = [Sampling(temperature, args.top_p, args.seed + i) for i in range(len(prompts))]
                    calibration.key = f"{name}, {temperature:g}" if method == "dflash" and rule == "rejection" else None
                    limit = min(suite.max_new_tokens, args.max_new_tokens or suite.max_new_tokens)
                    gens = generate_batch(engine, prompts, max_new_tokens=limit, method=method,
                                          budget=budget, acceptance=rule, sampling=sampling, stop_ids=stops,
                                          rows=args.rows)
                    key = f"T{temperature:g}/{label}" + (f"/{rule}" if temperature > 0 else "")
                    out.setdefault(key, {})[name] = [(g.tau, g.rounds) for g in gens]
                    print(f"{name:10s} {key:28s} τ {pooled(out[key][name]):.3f}  ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
    return out


def table(res: dict[str, Rows], temperatures: list[float], labels: list[str],
          suites: list[str]) -> list[dict[str, Any]]:
    """One row per (temperature, method, suite or 'mean'), printed as a markdown table."""
    rows = []
    print("\n| T | method | suite | greedy τ | match τ | rejection τ | rej/match | rej − match (90 %) | rej/greedy |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for temperature in temperatures:
        for label in labels:
            greedy, match, rej = (res[f"T0/{label}"], res[f"T{temperature:g}/{label}/match"],
                                  res[f"T{temperature:g}/{label}/rejection"])
            diff = bootstrap_intervals(rej, against=match)
            taus = {k: {s: pooled(r[s]) for s in suites} for k, r in (("greedy", greedy), ("match", match),
                                                                       ("rejection", rej))}
            for s in [*suites, "mean"]:
                t = {k: (sum(v.values()) / len(v) if s == "mean" else v[s]) for k, v in taus.items()}
                row = {"temperature": temperature, "method": label, "suite": s, **{f"{k}_tau": v for k, v in t.items()},
                       "rejection_over_match": t["rejection"] / t["match"], "diff_interval": diff[s],
                       "rejection_over_greedy": t["rejection"] / t["greedy"]}
                rows.append(row)
                lo, hi = diff[s]
                print(f"| {temperature:g} | {label} | {s} | {t['greedy']:.3f} | {t['match']:.3f} | {t['rejection']:.3f} | "
                      f"{row['rejection_over_match']:.3f}x | [{lo:+.3f}, {hi:+.3f}] | {row['rejection_over_greedy']:.3f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suites", default=",".join(s.name for s in EVAL_SUITES), help="comma list (default: every suite)")
    p.add_argument("--target", default=None, help="target: a directory, a .gguf file or a testbed name (default: the "
                   "embedded SmolLM2-135M-Instruct); another target needs its own --drafter")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--temperatures", default="0.7,1.0", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=64, help="DDTree's node budget (default 64)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per suite")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap (default: each suite's own)")
    p.add_argument("--rows", type=int, default=8, help="prompts decoded at once (a row decodes as it would alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows and each prompt's (τ, rounds) here")
    args = p.parse_args()
    if args.target is not None and args.drafter is None:
        p.error("--target: give the drafter trained for it with --drafter (the bundled one is SmolLM2's)")
    if any(t <= 0 for t in args.temperatures):
        p.error("--temperatures: expected values > 0 (greedy τ is measured anyway)")
    calibration = Calibration()
    res = decode_all(args, calibration)
    rows = table(res, args.temperatures, ["dflash", f"ddtree-{args.budget}"], args.suites.split(","))
    slots = calibration.table()
    if args.json:
        settings = {**{k: v for k, v in vars(args).items() if k != "json"}, "date": time.strftime("%Y-%m-%d"),
                    "threads": torch.get_num_threads(), "device_name": torch.cuda.get_device_name()
                    if args.device.startswith("cuda") else "cpu"}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(args.json), json.dumps({"settings": settings, "rows": rows, "calibration": slots,
                                                        "prompts": res},
                                                       indent=2).encode())


if __name__ == "__main__":
    main()
