"""Online evaluation: the target verifies for real.

For each prompt, plain autoregressive decoding (same engine kind, same caches) and every drafter
with DFlash and DDTree at each node budget; greedy outputs must be token-identical to the
autoregressive ones (checked, and every parting explained: `partings`). τ of a round = accepted
draft tokens + 1; the final round of an answer counts only the tokens up to its end. A prompt's
decodings run one right after the other, in an order that rotates from prompt to prompt, so that
its timings share the machine's load of the moment (speed-ups: `speed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from dflashkit.decode.engine import padded
from dflashkit.decode.generation import Generation, Sampling
from dflashkit.decode.loop import generate, make_engine
from dflashkit.drafter import DFlashDrafter
from dflashkit.evaluate.partings import TOP_RECORDED, exact_logits, where_parted
from dflashkit.evaluate.speed import round_cost, speedup_stats
from dflashkit.evaluate.summary import method_labels, summarize
from dflashkit.progress import progress
from dflashkit.method import DEFAULT_ACCEPTANCE, TOP_K
from dflashkit.target import Target
@dataclass
class Prompt:
    id: str
    ids: Tensor  # [1, T]
    text: str = ""  # the request answered (its last user message): the report names the hardest prompts by it


REQUEST_CHARS = 90  # of a request, kept per prompt in report.json


def eval_prompts(convs: Sequence[Any], tokenizer: Any, thinking: bool = False) -> list[Prompt]:
    """Conversations -> templated prompt ids, each cut after its last user turn (the model answers that)."""
    from dflashkit.data.chat import prompt_ids
    from dflashkit.data.regenerate import context_messages

    out = []
    for c in convs:
        messages = context_messages(c)  # (it ends with the request)
        out.append(Prompt(c.id, torch.tensor([prompt_ids(tokenizer, messages, thinking=thinking)]),
                          " ".join(messages[-1]["content"].split())[:REQUEST_CHARS]))
    return out



@torch.no_grad()
def warm_up(engines: Sequence[Any], labels: Sequence[tuple[str, str, int | None, str]], prompts: Sequence[Tensor],
            kw: dict[str, Any]) -> None:
    """Untimed passes, so that no method's tokens/s pays for graph captures and compilation: the
    first prompt by every engine (the first one autoregressive, the others each method of
    `labels`), then two tokens of one prompt per length bucket of the others (small prefills and
    first drafts replay a CUDA graph per bucket, `Engine.small_pass`)."""
    small = engines[0].small_pass
    buckets = {padded(1, ids.shape[-1], small): ids for ids in prompts[1:] if ids.shape[-1] <= small}
    for ids, n in [(prompts[0], kw["max_new_tokens"])] + [(ids, 2) for ids in buckets.values()]:
        for i, eng in enumerate(engines):
            for lab, method, budget, rule in [("ar", "ar", None, DEFAULT_ACCEPTANCE)] if i == 0 else labels:
                generate(eng, ids, method=method, budget=budget, cost_aware=lab.endswith("+cost"), acceptance=rule,
                         **{**kw, "max_new_tokens": n})


@dataclass
class Job:
    """One decoding of every prompt: autoregressive ('ar') or a drafter's method ('name/label')."""

    key: str
    engine: Any
    method: str
    budget: int | None = None
    cost_aware: bool = False
    acceptance: str = DEFAULT_ACCEPTANCE


def decode_prompt(jobs: Sequence[Job], prompt: Prompt, index: int, kw: dict[str, Any],
                  repeats: int = 1) -> dict[str, Generation]:
    """Every job on one prompt, one right after the other, the order rotated by the prompt's index:
    no job always runs first (on caches another prompt left) or always next to the same one.
    repeats > 1: the whole turn again (rotated once more each time), each job keeping the first
    pass's output and each phase's fastest time (other load only ever adds time)."""
    outs: dict[str, Generation] = {}
    for r in range(repeats):
        start = (index + r) % len(jobs)
        for j in [*jobs[start:], *jobs[:start]]:
            g = generate(j.engine, prompt.ids, method=j.method, budget=j.budget, cost_aware=j.cost_aware,
                         acceptance=j.acceptance, **kw)
            first = outs.setdefault(j.key, g)
            first.prefill_seconds = min(first.prefill_seconds, g.prefill_seconds)
            first.decode_seconds = min(first.decode_seconds, g.decode_seconds)
    return outs


def new_run() -> dict[str, Any]:
    return {"taus": [], "tokens": 0, "seconds": 0.0, "decode_seconds": 0.0, "mismatches": [], "unexplained": [],
            "draft_sizes": [], "costs": [], "decode_costs": []}


def record_prompt(runs: dict[str, dict[str, Any]], prompt: Prompt, outs: dict[str, Generation], greedy: bool,
                  parted: Callable[[Generation, Generation], dict[str, Any]]) -> dict[str, Any]:
    """Adds one prompt's generations to `runs` (keyed as `outs`: 'ar' and 'name/label'); returns
    its per_prompt row (τ, rounds, round costs, and where a greedy output parted from 'ar')."""
    ar = outs["ar"]
    row: dict[str, Any] = {"id": prompt.id, "prompt_tokens": prompt.ids.shape[1], "ar_tokens": len(ar.tokens), "tau": {}}
    if prompt.text:
        row["request"] = prompt.text
    for key, r in runs.items():  # in the jobs' order, whatever order they ran in
        g = outs[key]
        r["taus"] += g.accept_lengths
        r["draft_sizes"] += g.draft_sizes
        r["tokens"] += len(g.tokens)
        r["seconds"] += g.prefill_seconds + g.decode_seconds
        r["decode_seconds"] += g.decode_seconds
        if key == "ar":
            continue
        cost = round_cost(g.tau, len(g.tokens), g.prefill_seconds + g.decode_seconds, len(ar.tokens),
                          ar.prefill_seconds + ar.decode_seconds)
        decode_cost = round_cost(g.tau, len(g.tokens), g.decode_seconds, len(ar.tokens), ar.decode_seconds)
        r["costs"].append(cost)
        r["decode_costs"].append(decode_cost)
        if greedy and g.tokens != ar.tokens:
            r["mismatches"].append(prompt.id)
            parting = parted(ar, g)
            row.setdefault("partings", {})[key] = parting
            if not parting["numerical"]:
                r["unexplained"].append(prompt.id)
        row["tau"][key] = round(g.tau, 3)
        row.setdefault("rounds", {})[key] = g.rounds
        row.setdefault("round_cost", {})[key] = [cost, decode_cost]
    return row


def method_summary(r: dict[str, Any], block: int, prompts: int, greedy: bool) -> dict[str, Any]:
    """A drafter's method over the prompts (`new_run` totals): τ, speed-ups with their spread, identity."""
    out = {**summarize(r["taus"], block), "tokens": r["tokens"], "seconds": r["seconds"],
           "decode_seconds": r["decode_seconds"], "tokens_per_s": r["tokens"] / max(r["seconds"], 1e-9)}
    out.update(speedup_stats(out["tau"], r["costs"], r["decode_costs"]))
    out.update(identical=(not r["mismatches"]) if greedy else None, mismatches=r["mismatches"],
               unexplained_partings=r["unexplained"], identical_prompts=prompts - len(r["mismatches"]) if greedy else None)
    if r["draft_sizes"]:  # cost-aware: the draft tokens verified per round (0: a round without a draft)
        sizes = r["draft_sizes"]
        out["draft_sizes"] = {"mean": sum(sizes) / len(sizes), "drafted_share": sum(s > 0 for s in sizes) / len(sizes)}
    return out


def cost_curves(engine: Any) -> dict[str, Any]:
    """Cost-aware decoding: each method's verification curve as measured (the widths worth choosing)."""
    return {f"{m}-{bud}" if bud else m: {"batch": b, "widths": c.widths, "seconds": c.seconds,
                                         "stall_seconds": c.stall_seconds, "overhead_seconds": c.overhead_seconds,
                                         "chosen_round_seconds": [c.chosen_seconds(w) for w in c.widths]}
            for (m, bud, b), (c, _) in engine.cost_state.items()}


def evaluate_online(target: Target, drafters: dict[str, DFlashDrafter], prompts: Sequence[Prompt], *,
                    methods: Sequence[str] = ("dflash", "ddtree"), budgets: Sequence[int] = (8, 16, 32, 64),
                    top_k: int | None = TOP_K, max_new_tokens: int = 128, sampling: Sampling | None = None,
                    stop_ids: set[int] | frozenset[int] = frozenset(), engine: str = "auto",
                    cost_aware: bool = False, draft_tokens: int | None = None, repeats: int = 1,
                    acceptances: Sequence[str] = (DEFAULT_ACCEPTANCE,), desc: str = "online eval") -> dict[str, Any]:
    """Every prompt: autoregressive decoding and each drafter x method, on the same engine kind,
    one right after the other (`decode_prompt`). cost_aware: each speculative method also runs
    cost-aware (label suffix '+cost'); draft_tokens: tokens drafted a round (`make_engine`); repeats:
    turns of every job per prompt, each job timed by its fastest (`decode_prompt`); acceptances:
    the acceptance rules of sampled decoding to run (`method.Acceptance`; the rows of a rule other
    than the default carry its name as a suffix, '+rejection'; greedy decoding has one rule); desc:
    the progress bar's label."""
    sampling = sampling or Sampling()
    greedy = sampling.temperature == 0
    rules = acceptances if not greedy else (DEFAULT_ACCEPTANCE,)
    labels = [(lab + ("" if rule == DEFAULT_ACCEPTANCE else f"+{rule}"), method, budget, rule)
              for rule in rules for lab, method, budget in method_labels(methods, budgets)]
    if cost_aware:
        labels += [(f"{lab}+cost", method, budget, rule) for lab, method, budget, rule in labels]
    base_engine = make_engine(target, None, engine)
    engines = {n: make_engine(target, d, engine, draft_tokens) for n, d in drafters.items()}
    jobs = [Job("ar", base_engine, "ar")] + [
        Job(f"{name}/{lab}", eng, method, budget, lab.endswith("+cost"), rule)
        for name, eng in engines.items() for lab, method, budget, rule in labels]
    if target.device.type == "cuda" and prompts:  # (CUDA graphs are captured and kernels compiled on first use)
        warm_up([base_engine, *engines.values()], labels, [pr.ids for pr in prompts],
                dict(max_new_tokens=max_new_tokens, top_k=top_k, sampling=sampling, stop_ids=stop_ids))
    exact_fp32 = exact_logits(target)
    runs = {j.key: new_run() for j in jobs}
    per_prompt = []
    for i, pr in enumerate(progress(prompts, desc=desc, unit="prompt")):
        samp = Sampling(sampling.temperature, sampling.top_p, None if sampling.seed is None else sampling.seed + i)
        kw = dict(max_new_tokens=max_new_tokens, top_k=top_k, sampling=samp, stop_ids=stop_ids,
                  record_top=TOP_RECORDED if greedy else 0)
        outs = decode_prompt(jobs, pr, i, kw, repeats)
        per_prompt.append(record_prompt(runs, pr, outs, greedy,
                                        lambda ar, g: where_parted(ar, g, pr.ids, target.dtype, exact_fp32)))
    base = {k: runs["ar"][k] for k in ("tokens", "seconds", "decode_seconds")}
    report: dict[str, Any] = {
        "mode": "online", "prompts": len(prompts), "greedy": greedy, "dtype": str(target.dtype).removeprefix("torch."),
        "baseline": {**base, "tokens_per_s": base["tokens"] / max(base["seconds"], 1e-9)},
        "drafters": {}, "per_prompt": per_prompt}
    for name, eng in engines.items():
        out = {lab: method_summary(runs[f"{name}/{lab}"], eng.block, len(prompts), greedy) for lab, *_ in labels}
        curves = cost_curves(eng)
        report["drafters"][name] = {"block_size": eng.block, "kind": eng.drafter.config.kind, "methods": out, **({"cost_curves": curves} if curves else {})}
    return report
