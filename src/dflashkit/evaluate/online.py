"""Online evaluation: the target verifies for real.

For each prompt, plain autoregressive decoding (same engine kind, same caches) and every drafter
with DFlash and DDTree at each node budget; greedy outputs must be token-identical to the
autoregressive ones (checked, and every parting explained: `partings`). τ of a round = accepted
draft tokens + 1; the final round of an answer counts only the tokens up to its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from dflashkit.decode.engine import padded
from dflashkit.decode.generation import Sampling
from dflashkit.decode.loop import generate, make_engine
from dflashkit.decode.tree import TOP_K
from dflashkit.drafter import DFlashDrafter
from dflashkit.evaluate.partings import TOP_RECORDED, exact_logits, where_parted
from dflashkit.evaluate.summary import method_labels, summarize
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


# A parting counts as numerical when both tokens are within this many units in the last place (of


@torch.no_grad()
def warm_up(engines: Sequence[Any], labels: Sequence[tuple[str, str, int | None]], prompts: Sequence[Tensor],
            kw: dict[str, Any]) -> None:
    """Untimed passes, so that no method's tokens/s pays for graph captures and compilation: the
    first prompt by every engine (the first one autoregressive, the others each method of
    `labels`), then two tokens of one prompt per length bucket of the others (small prefills and
    first drafts replay a CUDA graph per bucket, `Engine.small_pass`)."""
    small = engines[0].small_pass
    buckets = {padded(1, ids.shape[-1], small): ids for ids in prompts[1:] if ids.shape[-1] <= small}
    for ids, n in [(prompts[0], kw["max_new_tokens"])] + [(ids, 2) for ids in buckets.values()]:
        for i, eng in enumerate(engines):
            for lab, method, budget in [("ar", "ar", None)] if i == 0 else labels:
                generate(eng, ids, method=method, budget=budget, cost_aware=lab.endswith("+cost"),
                         **{**kw, "max_new_tokens": n})


def evaluate_online(target: Target, drafters: dict[str, DFlashDrafter], prompts: Sequence[Prompt], *,
                    methods: Sequence[str] = ("dflash", "ddtree"), budgets: Sequence[int] = (8, 16, 32, 64),
                    top_k: int | None = TOP_K, max_new_tokens: int = 128, sampling: Sampling | None = None,
                    stop_ids: set[int] | frozenset[int] = frozenset(), engine: str = "auto",
                    cost_aware: bool = False, draft_tokens: int | None = None, desc: str = "online eval") -> dict[str, Any]:
    """Every prompt: autoregressive baseline, then each drafter x method, on the same engine kind.
    cost_aware: each speculative method also runs cost-aware (label suffix '+cost'); draft_tokens:
    tokens drafted a round (`make_engine`); desc: the progress bar's label."""
    sampling = sampling or Sampling()
    greedy = sampling.temperature == 0
    labels = method_labels(methods, budgets)
    if cost_aware:
        labels += [(f"{lab}+cost", method, budget) for lab, method, budget in labels]
    base_engine = make_engine(target, None, engine)
    engines = {n: make_engine(target, d, engine, draft_tokens) for n, d in drafters.items()}
    exact_fp32 = exact_logits(target)
    base = {"tokens": 0, "seconds": 0.0, "decode_seconds": 0.0}
    runs = {n: {lab: {"taus": [], "tokens": 0, "seconds": 0.0, "decode_seconds": 0.0, "mismatches": [], "unexplained": [],
                      "draft_sizes": []}
                for lab, _, _ in labels} for n in drafters}
    if target.device.type == "cuda" and prompts:  # (CUDA graphs are captured and kernels compiled on first use)
        warm_up([base_engine, *engines.values()], labels, [pr.ids for pr in prompts],
                dict(max_new_tokens=max_new_tokens, top_k=top_k, sampling=sampling, stop_ids=stop_ids))
    per_prompt = []
    for i, pr in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=None)):
        samp = Sampling(sampling.temperature, sampling.top_p, None if sampling.seed is None else sampling.seed + i)
        kw = dict(max_new_tokens=max_new_tokens, top_k=top_k, sampling=samp, stop_ids=stop_ids,
                  record_top=TOP_RECORDED if greedy else 0)
        ar = generate(base_engine, pr.ids, method="ar", **kw)
        base["tokens"] += len(ar.tokens)
        base["seconds"] += ar.prefill_seconds + ar.decode_seconds
        base["decode_seconds"] += ar.decode_seconds
        row = {"id": pr.id, "prompt_tokens": pr.ids.shape[1], "ar_tokens": len(ar.tokens), "tau": {}}
        if pr.text:
            row["request"] = pr.text
        for name, eng in engines.items():
            for lab, method, budget in labels:
                g = generate(eng, pr.ids, method=method, budget=budget, cost_aware=lab.endswith("+cost"), **kw)
                r = runs[name][lab]
                r["taus"] += g.accept_lengths
                r["draft_sizes"] += g.draft_sizes
                r["tokens"] += len(g.tokens)
                r["seconds"] += g.prefill_seconds + g.decode_seconds
                r["decode_seconds"] += g.decode_seconds
                if greedy and g.tokens != ar.tokens:
                    r["mismatches"].append(pr.id)
                    parting = where_parted(ar, g, pr.ids, target.dtype, exact_fp32)
                    row.setdefault("partings", {})[f"{name}/{lab}"] = parting
                    if not parting["numerical"]:
                        r["unexplained"].append(pr.id)
                row["tau"][f"{name}/{lab}"] = round(g.tau, 3)
                row.setdefault("rounds", {})[f"{name}/{lab}"] = g.rounds
        per_prompt.append(row)
    report: dict[str, Any] = {
        "mode": "online", "prompts": len(prompts), "greedy": greedy, "dtype": str(target.dtype).removeprefix("torch."),
        "baseline": {**base, "tokens_per_s": base["tokens"] / max(base["seconds"], 1e-9)},
        "drafters": {}, "per_prompt": per_prompt}
    for name in drafters:
        B = engines[name].block
        out = {}
        for lab, r in runs[name].items():
            out[lab] = {**summarize(r["taus"], B), "tokens": r["tokens"], "seconds": r["seconds"],
                        "decode_seconds": r["decode_seconds"],
                        "tokens_per_s": r["tokens"] / max(r["seconds"], 1e-9),
                        "speedup": (r["tokens"] / max(r["seconds"], 1e-9)) / report["baseline"]["tokens_per_s"],
                        "decode_speedup": (r["tokens"] / max(r["decode_seconds"], 1e-9)) / (base["tokens"] / max(base["decode_seconds"], 1e-9)),
                        "identical": (not r["mismatches"]) if greedy else None, "mismatches": r["mismatches"],
                        "unexplained_partings": r["unexplained"],
                        "identical_prompts": len(prompts) - len(r["mismatches"]) if greedy else None}
            if r["draft_sizes"]:  # cost-aware: the draft tokens verified per round (0: a round without a draft)
                sizes = r["draft_sizes"]
                out[lab]["draft_sizes"] = {"mean": sum(sizes) / len(sizes),
                                           "drafted_share": sum(s > 0 for s in sizes) / len(sizes)}
        # cost-aware: each method's verification curve as measured (the widths worth choosing)
        curves = {f"{m}-{bud}" if bud else m: {"batch": b, "widths": c.widths, "seconds": c.seconds,
                                                 "stall_seconds": c.stall_seconds, "overhead_seconds": c.overhead_seconds,
                                                 "chosen_round_seconds": [c.chosen_seconds(w) for w in c.widths]}
                  for (m, bud, b), (c, _) in engines[name].cost_state.items()}
        report["drafters"][name] = {"block_size": B, "methods": out, **({"cost_curves": curves} if curves else {})}
    return report
