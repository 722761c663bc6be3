"""`dflashkit eval`: acceptance length and speed of drafters, online or offline (docs/conventions.md).

Online (default): the target verifies for real. For each prompt, plain autoregressive decoding
(same engine, same caches) and then every drafter with DFlash and DDTree at each node budget;
greedy outputs must be token-identical to the autoregressive ones (checked and reported).

Offline (`--features DIR`): no target layers at all (docs/conventions.md, mistake 8: only the embedding and
LM head are read from disk). For every answer position p of a cached sample the drafter sees the
cached features of positions < p and the bonus token p, and we count the leading draft tokens
(DDTree: the deepest tree path) that equal the data's tokens. Decoding rounds are then replayed
over the answer: a round at p commits τ(p) tokens and the next one starts at p + τ(p). When the
data is the target's own greedy output (`regenerate` with temperature 0), these rounds are
exactly the rounds of online greedy decoding, so offline τ equals online τ.

Suites (default online): the held-out suites of `data.prompts.EVAL_SUITES` (code, math, chat,
multi-turn...), each with its own prompt count and answer length, evaluated one after the other
and reported side by side; the headline is the mean over suites, beside the worst suite.

Partings (greedy, online): where a speculative output parts from the autoregressive one, the
target's top logits at that position, as recorded by the two passes that chose the two tokens
(a one-token step of the autoregressive run, the verification block of the speculative run,
with the caches each run had built), are classified by `classify_parting`: numerical when both
tokens lie within a few units of rounding of the top logit in both passes. Beyond that bound, in
bf16 or fp16, `arbitrate_parting` measures both passes against float32 arithmetic at the same
position: numerical when the verification pass is about as exact as the one-token step and the
two tokens are as close as the passes' own measured errors allow (or float32 puts them closer
than either pass's error). Anything else is unexplained, which fails the evaluation.

τ of a round = accepted draft tokens + 1; the final round of an answer counts only the tokens up
to its end (stop token or length limit), online and offline alike. Reports: τ mean, histogram,
per-slot acceptance P(τ > k), rounds, tokens/s and speed-up; JSON + Markdown + PNG plots.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from dflashkit import versions
from dflashkit.decode.engine import padded
from dflashkit.decode.generation import Sampling
from dflashkit.decode.loop import generate, make_engine
from dflashkit.decode.tree import TOP_K, Trees, best_first, candidates, chains, verification, walk
from dflashkit.drafter import DFlashDrafter, training_hidden
from dflashkit.objective import replay_rounds
from dflashkit.target import Target

log = logging.getLogger(__name__)


# ---- summaries ------------------------------------------------------------------------------------


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


# ---- offline: from cached features -----------------------------------------------------------------


class FeatureItem(Protocol):
    """What offline evaluation reads per sample (`data.features.FeatureSample` is one)."""

    id: str
    input_ids: Tensor  # [T]
    loss_mask: Tensor  # [T]
    features: Tensor  # [T, n_taps * H], taps in the drafter's target_layer_ids order


def answer_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised tokens: one generated answer each."""
    m = loss_mask.bool().tolist()
    spans, start = [], None
    for i, v in enumerate(m + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


def draft_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """The answer spans that a decoding round can draft in (two tokens or more)."""
    return [(a, e) for a, e in answer_spans(loss_mask) if e - a >= 2]


@torch.no_grad()
def drafted_blocks(drafter: DFlashDrafter, head: Target, item: FeatureItem, spans: list[tuple[int, int]],
                   chunk: int = 32) -> Iterator[tuple[list[int], Tensor, Tensor, Tensor]]:
    """The drafter's block at every position p of `item`'s answer spans (`draft_spans`; bonus =
    token p, context < p), `chunk` positions at a time: (positions, logits [n, B-1, V], bonus
    tokens [n], truth [n, B]: the data's token after depth d of a tree rooted at p, -1 past the
    answer, where nothing matches)."""
    B, dev = drafter.config.block_size, head.device
    ids = item.input_ids.long().to(dev)
    anchors = [p for a, e in spans for p in range(a, e - 1)]
    end_of = {p: e for a, e in spans for p in range(a, e - 1)}
    feats = item.features.to(device=dev, dtype=head.dtype)[None]
    for i in range(0, len(anchors), chunk):
        part = anchors[i:i + chunk]
        h = training_hidden(drafter, head.embed, ids[None], feats, torch.tensor([part], device=dev))
        logits = head.lm_head(h).view(len(part), B, -1)[:, 1:]
        at = torch.tensor(part, device=dev)
        pos = at[:, None] + 1 + torch.arange(B, device=dev)
        ends = torch.tensor([end_of[p] for p in part], device=dev)[:, None]
        yield part, logits, ids[at], torch.where(pos < ends, ids[pos.clamp(max=len(ids) - 1)], -1)


@torch.no_grad()
def offline_accepted(drafter: DFlashDrafter, head: Target, item: FeatureItem, labels: list[tuple[str, str, int | None]],
                     top_k: int | None, chunk: int = 32) -> tuple[dict[str, dict[int, int]], list[tuple[int, int]]]:
    """Accepted draft tokens at every answer position p (bonus = token p, context < p), per method.
    Returns ({label: {p: accepted}}, spans). Positions past the answer's end never match."""
    out: dict[str, dict[int, int]] = {label: {} for label, _, _ in labels}
    spans = draft_spans(item.loss_mask)
    for part, logits, roots, truth in drafted_blocks(drafter, head, item, spans, chunk):
        # the same ops as online decoding (`tree.draft_trees`), the top-k taken once for every budget
        ks = {budget: candidates(budget, top_k, logits.shape[-1]) for _, m, budget in labels if m == "ddtree"}
        top = torch.log_softmax(logits.float(), -1).topk(max(ks.values()), dim=-1) if ks else None
        for label, method, budget in labels:
            chain = method == "dflash"
            trees = chains(logits.argmax(-1)) if chain else \
                best_first(top.values[..., :ks[budget]], top.indices[..., :ks[budget]], budget)
            out[label].update(zip(part, accepted(trees, roots, truth, chain).tolist()))
    return out, spans


def accepted(trees: Trees, roots: Tensor, truth: Tensor, chain: bool = False) -> Tensor:
    """[n] draft tokens that the data accepts of trees under roots (`drafted_blocks`' truth [n, B])."""
    _, depths, anc = verification(roots, trees, chain)
    return walk(trees, anc, truth.gather(1, depths), chain).accepted


def evaluate_offline(drafters: dict[str, DFlashDrafter], head: Target, items: Iterable[FeatureItem], *,
                     methods: Sequence[str] = ("dflash", "ddtree"), budgets: Sequence[int] = (8, 16, 32, 64),
                     top_k: int | None = TOP_K, limit: int | None = None) -> dict[str, Any]:
    labels = method_labels(methods, budgets)
    taus = {n: {lab: ([], []) for lab, _, _ in labels} for n in drafters}
    samples, tokens = 0, 0
    total = len(items) if hasattr(items, "__len__") else None
    total = min(x for x in (total, limit) if x is not None) if (total or limit) else None
    for item in tqdm(items, desc="offline eval", unit="sample", total=total, disable=None):
        if limit is not None and samples >= limit:
            break
        samples += 1
        for name, drafter in drafters.items():
            acc, spans = offline_accepted(drafter, head, item, labels, top_k)
            for lab, _, _ in labels:
                r, p = replay_rounds(acc[lab], spans)
                taus[name][lab][0].extend(r)
                taus[name][lab][1].extend(p)
        tokens += sum(e - a for a, e in answer_spans(item.loss_mask))
    report: dict[str, Any] = {"mode": "offline", "samples": samples, "answer_tokens": tokens, "drafters": {}}
    for name, drafter in drafters.items():
        B = drafter.config.block_size
        report["drafters"][name] = {"block_size": B, "methods": {
            lab: {**summarize(r, B), "tau_per_position": sum(p) / len(p) if p else 0.0} for lab, (r, p) in taus[name].items()}}
    return report


def heldout_items(cache: Any, eval_samples: int, seed: int) -> list[FeatureItem]:
    """The samples of `cache` that `train` holds out for tau_sim with these settings (same split,
    suite by suite when the ids carry suite labels)."""
    from dflashkit.train import sample_ids, split_eval

    return [cache[i] for i in split_eval(len(cache), eval_samples, seed, sample_ids(cache))[1]]


def _weight_file(src: str, tensor: str) -> Path:
    """The safetensors file holding `tensor`: a local directory, or (online) a hub repository."""
    local = Path(src).expanduser()

    def get(name: str) -> Path | None:
        if local.is_dir():
            return local / name if (local / name).is_file() else None
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(src, name))
        except Exception:  # absent file, or no network: reported below with what was looked for
            return None

    index = get("model.safetensors.index.json")
    name = json.loads(index.read_text())["weight_map"].get(tensor) if index else "model.safetensors"
    path = get(name) if name else None
    if path is None:
        raise FileNotFoundError(f"target {src}: no safetensors file holds {tensor} (offline evaluation reads the "
                                "embedding and LM head from the target's safetensors)")
    return path


def load_target_head(name_or_path: str | None = None, *, gguf_file: str | None = None, dtype: str = "auto",
                     device: str = "cpu") -> Target:
    """The target with only its embedding, LM head and final norm read from disk; every decoder
    layer stays on the meta device and cannot run (offline evaluation, docs/conventions.md, mistake 8)."""
    from safetensors import safe_open

    from dflashkit.target import load_target

    t = load_target(name_or_path, gguf_file=gguf_file, dtype=dtype, weights=False)
    if gguf_file or t.name.endswith(".gguf"):
        raise ValueError(f"target {t.name}: offline evaluation reads the embedding and LM head from safetensors, "
                         "which a GGUF file has not: convert it to a Transformers directory first (the default testbed is)")
    emb, head = t.model.get_input_embeddings(), t.model.get_output_embeddings()
    names: dict[int, str] = {}
    for n, p in t.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied LM head keeps the embedding's name
    tied = head.weight is emb.weight
    for module, part in [(emb, "embedding"), (t.final_norm, "final norm")] + ([] if tied else [(head, "LM head")]):
        name = names[id(module.weight)]
        path = _weight_file(t.name, name)
        with safe_open(str(path), "pt") as f:
            if name not in f.keys():
                raise ValueError(f"{path}: tensor {name} (the target's {part}) not found")
            module.weight = torch.nn.Parameter(f.get_tensor(name).to(device=device, dtype=t.dtype), requires_grad=False)
    if tied:
        head.weight = emb.weight
    return t


# ---- online: the target verifies -------------------------------------------------------------------


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
# the evaluation dtype, at the logit's magnitude) of the top logit, in both passes. The two passes
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


def pool_reports(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Online reports of disjoint prompt sets -> one report over all of their prompts (sums of
    tokens, seconds and rounds; τ, histogram and slot acceptance weighted by rounds)."""
    first = parts[0]
    base = {k: sum(p["baseline"][k] for p in parts) for k in ("tokens", "seconds", "decode_seconds")}
    base["tokens_per_s"] = base["tokens"] / max(base["seconds"], 1e-9)
    drafters: dict[str, Any] = {}
    for name, d in first["drafters"].items():
        methods = {}
        for lab in d["methods"]:
            ms = [p["drafters"][name]["methods"][lab] for p in parts]
            rounds = sum(m["rounds"] for m in ms)
            tokens, seconds = sum(m["tokens"] for m in ms), sum(m["seconds"] for m in ms)

            def weighted(key: str) -> float:
                return sum(m[key] * m["rounds"] for m in ms) / max(rounds, 1)

            decode_s = sum(m["decode_seconds"] for m in ms)
            methods[lab] = {
                "tau": weighted("tau"), "rounds": rounds, "hist": [sum(h) for h in zip(*(m["hist"] for m in ms))],
                "slot_acceptance": [sum(m["slot_acceptance"][i] * m["rounds"] for m in ms) / max(rounds, 1)
                                    for i in range(len(ms[0]["slot_acceptance"]))],
                "tokens": tokens, "seconds": seconds, "decode_seconds": decode_s, "tokens_per_s": tokens / max(seconds, 1e-9),
                "speedup": tokens / max(seconds, 1e-9) / base["tokens_per_s"],
                "decode_speedup": tokens / max(decode_s, 1e-9) / (base["tokens"] / max(base["decode_seconds"], 1e-9)),
                "identical": None if ms[0]["identical"] is None else all(m["identical"] for m in ms),
                "mismatches": [x for m in ms for x in m["mismatches"]],
                "unexplained_partings": [x for m in ms for x in m["unexplained_partings"]],
                "identical_prompts": None if ms[0]["identical"] is None else sum(m["identical_prompts"] for m in ms)}
            if all("draft_sizes" in m for m in ms):
                methods[lab]["draft_sizes"] = {k: sum(m["draft_sizes"][k] * m["rounds"] for m in ms) / max(rounds, 1)
                                               for k in ("mean", "drafted_share")}
        drafters[name] = {"block_size": d["block_size"], "methods": methods,
                          **({"cost_curves": d["cost_curves"]} if "cost_curves" in d else {})}
    return {"mode": "online", "prompts": sum(p["prompts"] for p in parts), "greedy": first["greedy"],
            "dtype": first["dtype"], "baseline": base, "drafters": drafters,
            "per_prompt": [row for p in parts for row in p["per_prompt"]]}


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
    settings = {"versions": versions(), "target": target.name, "dtype": str(target.dtype), "device": device, "suite": suite.name,
                "max_new_tokens": suite.max_new_tokens,
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
                             "drafters": {n: {lab: {k: m[k] for k in ("tau", "rounds", "speedup", "identical", "mismatches",
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


# ---- reports ---------------------------------------------------------------------------------------


def method_table(report: dict[str, Any]) -> list[str]:
    """One row per drafter and method: the online or offline columns."""
    online = report["mode"] == "online"
    if online:
        lines = ["| drafter | method | τ | rounds | tokens/s | speed-up | decode speed-up | greedy identical |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    else:
        lines = ["| drafter | method | τ (rounds) | rounds | τ (every position) |", "| --- | --- | ---: | ---: | ---: |"]
    for name, d in report["drafters"].items():
        for lab, m in d["methods"].items():
            if online:
                lines.append(f"| {name} | {lab} | {m['tau']:.3f} | {m['rounds']} | {m['tokens_per_s']:.2f} | "
                             f"{m['speedup']:.2f}x | {m['decode_speedup']:.2f}x | {_identical(m)} |")
            else:
                lines.append(f"| {name} | {lab} | {m['tau']:.3f} | {m['rounds']} | {m['tau_per_position']:.3f} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    online = report["mode"] == "online"
    lines = [f"# dflashkit eval ({report['mode']})", ""]
    for k in ("date", "versions", "target", "device", "settings"):
        if k in report:
            lines.append(f"- {k}: `{json.dumps(report[k]) if isinstance(report[k], dict) else report[k]}`")
    if report.get("reused_suites"):
        lines.append(f"- suites reused from an earlier run of the same evaluation (timings are that run's): "
                     f"{', '.join(report['reused_suites'])}")
    if "heldout" in report:
        h = report["heldout"]
        lines += ["", f"## Held-out split of the training domain ({h['samples']} samples, {h['answer_tokens']} answer "
                  "tokens, decoding rounds replayed offline)", "", *method_table(h)]
    if "suites" in report:
        lines += ["", "## Evaluation suites", "", *suite_table(report), "", "Over all prompts of the suites together:", ""]
    if online:
        b = report["baseline"]
        lines.append(f"- prompts: {report['prompts']}; autoregressive baseline: {b['tokens']} tokens, {b['tokens_per_s']:.2f} tokens/s")
    else:
        lines.append(f"- samples: {report['samples']}, answer tokens: {report['answer_tokens']}")
    lines += ["", *method_table(report)]
    lines += ["", "τ = accepted draft tokens + 1 per round (the final round of an answer counts tokens up to its end). "
              "Per-slot acceptance P(τ > k) and histograms: report.json, tau_hist.png, slot_acceptance.png"
              + (", suites.png (τ per suite)." if report.get("headline") else ".")]
    if online and report["greedy"]:
        lines += ["", f"Greedy outputs are compared with autoregressive decoding token by token. Where one parts, the "
                  f"target's top logits at that position, as recorded by the two passes that chose the two tokens "
                  f"(a one-token step and a verification block), are compared: "
                  f"the parting is numerical when both tokens are within {NUMERICAL_ULPS} units of {report.get('dtype')} "
                  "rounding of the top logit in both passes, or, beyond that in bf16 or fp16, when float32 arithmetic "
                  "at the same position puts the two tokens as close as both passes' own measured errors allow (or "
                  "closer than either pass's error) and the verification pass is about as exact as the one-token "
                  "step (report.json: per_prompt[].partings, `float32`); any other parting fails the evaluation."]
        if str(report.get("device", "")).startswith("cuda"):  # docs/recipe.md, "How far a suite's τ could move"
            lines.append("On a GPU, where the near-ties fall also depends on what else a run decodes (suites, drafters, "
                         "methods): compare drafters within one report, not across runs of different commands.")
    return "\n".join(lines) + "\n"


def _identical(m: dict[str, Any]) -> str:
    if m["identical"] is None:
        return "n/a (sampled)"
    if m["identical"]:
        return "yes"
    bad = m.get("unexplained_partings", [])
    numerical = len(m["mismatches"]) - len(bad)
    return (f"NO, unexplained: {', '.join(bad)}" if bad else "") or f"{numerical} parting(s), all numerical near-ties"


def training_tau_sim(paths: dict[str, Path]) -> dict[str, Any]:
    """For drafters that are a training run's `best/` (best.json): {'tau_sim': {drafter: {suite:
    tau_sim}}} where its held-out split had suite labels (tau_sim_by_suite), and {'tau_rounds_probes':
    {drafter: {suite: τ}}} where training replayed decoding rounds on the suites' own answers
    (`train.probes`); {} when none has either."""
    found: dict[str, dict[str, Any]] = {}
    for name, path in paths.items():
        best = Path(path).parent / "best.json"
        if Path(path).name == "best" and best.is_file():
            saved = json.loads(best.read_text())
            for key, field in (("tau_sim", "tau_sim_by_suite"), ("tau_rounds_probes", "tau_rounds_probes")):
                if saved.get(field):
                    found.setdefault(key, {})[name] = saved[field]
    return found


def tau_sim_vs_online(report: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """{drafter: {suite: {tau, tau_sim, rel_diff, tau_rounds_probe, rel_diff_probe}}} (the keys
    that apply) for every suite that the drafter's training measured (`training_tau_sim`): `tau`
    is online DFlash on the suite; τ_sim the mean acceptance over anchors of the held-out answers
    of the training category of the suite's name; τ_rounds_probe the decoding rounds replayed on
    the target's own answers to the suite's prompts (`train.probes`); rel_diff = value / τ - 1."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, value, diff in (("tau_sim", "tau_sim", "rel_diff"), ("tau_rounds_probes", "tau_rounds_probe", "rel_diff_probe")):
        for name, sims in report.get(key, {}).items():
            for suite, t in report["suites"].items():
                online = t["drafters"].get(name, {}).get("dflash")
                if suite in sims and online:
                    row = out.setdefault(name, {}).setdefault(suite, {"tau": online["tau"]})
                    row[value] = sims[suite]
                    row[diff] = sims[suite] / max(online["tau"], 1e-9) - 1
    return out


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


def suite_table(report: dict[str, Any]) -> list[str]:
    """The suites side by side: τ (speed-up) per suite, the mean over suites and the worst suite;
    τ_sim per suite beside it when the report carries one (`tau_sim`: {drafter: {suite: value}})."""
    names = list(report["suites"])
    head = "| drafter | method | " + " | ".join(f"{s} ({report['suites'][s]['prompts']}×{report['suites'][s]['max_new_tokens']})"
                                                for s in names) + " | **mean** | worst | worst/best |"
    lines = [head, "| --- | --- | " + "---: | " * (len(names) + 1) + "--- | ---: |"]
    for name, methods in report["headline"].items():
        for lab, h in methods.items():
            cells = [f"{report['suites'][s]['drafters'][name][lab]['tau']:.2f} ({report['suites'][s]['drafters'][name][lab]['speedup']:.2f}x)"
                     for s in names]
            lines.append(f"| {name} | {lab} | " + " | ".join(cells) +
                         f" | **{h['mean_tau']:.2f} ({h['mean_speedup']:.2f}x)** | {h['worst_suite']} {h['worst_tau']:.2f} | "
                         f"{h['worst_to_best']:.2f} |")
    for key, what in (("tau_sim", "τ_sim (held-out, training)"), ("tau_rounds_probes", "τ replayed (the suite's answers, training)")):
        for name, sims in report.get(key, {}).items():
            if not any(s in sims for s in names):  # measured on other data than these suites (the demo's domain)
                continue
            lines.append(f"| {name} | {what} | " + " | ".join(
                f"{sims[s]:.2f}" if s in sims else "–" for s in names) + " | | | |")
    lines += ["", "Cells: τ (speed-up over autoregressive decoding of the same suite); column heads: prompts × answer "
              "tokens. The mean weighs every suite the same; worst/best: the lowest suite τ over the highest."]
    first = next(iter(report["headline"].values()), {})
    if any("mean_tau_interval" in h for h in first.values()):
        lines += ["", "τ with 90 % intervals over prompts (bootstrap: each suite's prompts resampled, 2,000 draws): "
                  "differences narrower than these do not tell two drafters, or two runs, apart.", "",
                  "| drafter | method | " + " | ".join(names) + " | mean | worst/best |",
                  "| --- | --- | " + "---: | " * (len(names) + 2)]
        for name, methods in report["headline"].items():
            for lab, h in methods.items():
                cells = [report["suites"][s]["drafters"][name][lab]["tau_interval"] for s in names]
                lines.append(f"| {name} | {lab} | " + " | ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in cells) +
                             " | {:.2f}-{:.2f} | {:.2f}-{:.2f} |".format(*h["mean_tau_interval"], *h["worst_to_best_interval"]))
    lines += slot_table(report, names)
    lines += extremes_table(report, names)
    if report.get("differences"):
        lines += ["", "τ differences between drafters on the same prompts, with paired 90 % intervals (an interval "
                  "that holds 0: these suites do not tell the two apart):", "",
                  "| drafters | method | " + " | ".join(names) + " | mean |", "| --- | --- | " + "---: | " * (len(names) + 1)]
        for pair, methods in report["differences"].items():
            for lab, d in methods.items():
                lines.append(f"| {pair} | {lab} | " + " | ".join(
                    "{:+.2f} ({:+.2f} to {:+.2f})".format(d[s]["diff"], *d[s]["interval"]) for s in [*names, "mean"]) + " |")
    return lines


SLOT_COLUMNS = 3  # the first slots decide τ where it is low (P(τ > 1): the first draft token accepted)


def slot_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Where each suite's rounds stop: P(τ > k) for the first slots, per drafter and method. Two
    suites of equal τ can differ here: one whose rounds mostly end at the first draft token, one
    whose rounds end later."""
    ks = " / ".join(f"P(τ > {k})" for k in range(1, SLOT_COLUMNS + 1))
    lines = ["", f"Per-slot acceptance per suite ({ks}; every slot: report.json, suites.*.drafters):", "",
             "| drafter | method | " + " | ".join(names) + " |", "| --- | --- |" + " ---: |" * len(names)]
    for name, methods in report["headline"].items():
        for lab in methods:
            cells = [" / ".join(f"{p:.2f}" for p in report["suites"][s]["drafters"][name][lab]["slot_acceptance"][:SLOT_COLUMNS])
                     for s in names]
            lines.append(f"| {name} | {lab} | " + " | ".join(cells) + " |")
    return lines


def extremes_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Per suite, the prompt of the lowest and of the highest τ for the first drafter named (DFlash
    where it ran): which requests a drafter serves worst (e.g. explanations of facts) is what a mean hides."""
    name = next(iter(report["drafters"]))
    lab = "dflash" if "dflash" in report["headline"][name] else next(iter(report["headline"][name]))
    key = f"{name}/{lab}"

    def cell(row: dict[str, Any]) -> str:
        request = row.get("request", "").replace("|", "\\|")
        return f"{row['tau'][key]:.2f} {row['id']}" + (f": {request}" if request else "")

    lines = ["", f"Lowest and highest τ per suite ({name}, {lab}; every prompt: report.json, per_prompt):", "",
             "| suite | lowest | highest |", "| --- | --- | --- |"]
    for s in names:
        rows = sorted((r for r in report["per_prompt"] if r.get("suite") == s and key in r["tau"]), key=lambda r: r["tau"][key])
        if rows:
            lines.append(f"| {s} | {cell(rows[0])} | {cell(rows[-1])} |")
    return lines


def plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(f"{n}/{lab}", m) for n, d in report["drafters"].items() for lab, m in d["methods"].items()]
    files = []
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, m) in enumerate(series):
        n = max(1, m["rounds"])
        ax.bar([k + 1 + (i - len(series) / 2) * width for k in range(len(m["hist"]))], [h / n for h in m["hist"]],
               width=width, label=f"{label} (τ {m['tau']:.2f})")
    ax.set(xlabel="τ (tokens per round)", ylabel="share of rounds", title=f"acceptance length ({report['mode']})")
    ax.legend(fontsize=7)
    files.append(out_dir / "tau_hist.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, m in series:
        ax.plot(range(1, len(m["slot_acceptance"]) + 1), m["slot_acceptance"], marker="o", ms=3, label=label)
    ax.set(xlabel="slot / tree depth k", ylabel="P(τ > k)", ylim=(0, 1.02), title="per-slot acceptance")
    ax.legend(fontsize=7)
    files.append(out_dir / "slot_acceptance.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    if report.get("headline"):
        files.append(suite_plot(report, out_dir / "suites.png", plt))
    return files


def suite_plot(report: dict[str, Any], path: Path, plt: Any) -> Path:
    """τ per suite and the mean over suites, a bar per drafter and method, with its 90 % interval
    over prompts where the report has one: the suites side by side at a glance."""
    names = [*report["suites"], "mean"]
    series = [(name, lab, h) for name, methods in report["headline"].items() for lab, h in methods.items()]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, lab, h) in enumerate(series):
        per = [report["suites"][s]["drafters"][name][lab] for s in names[:-1]]
        taus = [m["tau"] for m in per] + [h["mean_tau"]]
        spans = [m.get("tau_interval") for m in per] + [h.get("mean_tau_interval")]
        err = None
        if all(sp is not None and all(math.isfinite(v) for v in sp) for sp in spans):
            # (the interval pools per-prompt τ rounded to 3 decimals: it may miss the point by a hair)
            err = [[max(0.0, t - lo) for t, (lo, _) in zip(taus, spans)], [max(0.0, hi - t) for t, (_, hi) in zip(taus, spans)]]
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in range(len(names))], taus, width=width, yerr=err,
               capsize=2, label=f"{name}/{lab}")
    ax.axvline(len(names) - 1.5, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(names)), [f"{s}\n({report['suites'][s]['prompts']})" for s in names[:-1]] + ["mean"])
    ax.set(ylabel="τ (tokens per round)", title="acceptance length per suite (90 % intervals over prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """report.json, report.md, tau_hist.png, slot_acceptance.png, and suites.png for a suite
    report (each written atomically)."""
    from dflashkit.checkpoint import atomic_write_bytes, atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "report.md", markdown(report).encode())
    tmp = out / ".plots"
    tmp.mkdir(exist_ok=True)
    files = [out / "report.json", out / "report.md"]
    for f in plots(report, tmp):
        f.replace(out / f.name)
        files.append(out / f.name)
    tmp.rmdir()
    return files


# ---- CLI -----------------------------------------------------------------------------------------

ONLINE_ONLY = ("prompts", "suites", "max_new_tokens", "temperature", "top_p", "seed", "engine", "draft_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import DRAFT_TOKENS_HELP, add_config_options, budget_list, positive_int

    p.add_argument("--drafter", action="append", default=[], metavar="[NAME=]DIR",
                   help="reference-format drafter directory (ours or published); repeat to compare several")
    p.add_argument("--features", metavar="DIR", help="offline mode: a feature cache (`dflashkit extract`); no target layers run")
    p.add_argument("--out", metavar="DIR", default="runs/eval", help="report directory (default runs/eval)")
    p.add_argument("--methods", default="dflash,ddtree", help="comma list of dflash, ddtree (default both)")
    p.add_argument("--budgets", default=None, type=budget_list,
                   help="DDTree node budgets, comma list (default eval.ddtree_budgets)")
    p.add_argument("--top-k", type=int, default=None, help="DDTree candidates per slot (default eval.ddtree_top_k: the node budget)")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite or of --prompts (online), or samples (offline)")
    p.add_argument("--heldout", action="store_true", help="offline mode: only the held-out split that `train` "
                   "measures tau_sim on (train.eval_samples, train.seed): a before/after report for fine-tuning")
    g = p.add_argument_group("online mode only")
    g.add_argument("--suites", default=None, help="comma list of evaluation suites (default eval.suites: "
                   "humaneval,code,math,chat,multiturn), each with its own prompt count and answer length")
    g.add_argument("--prompts", default=None, help="one prompt set instead of the suites: humaneval, builtin, a "
                   "JSONL/JSON/Parquet file or a datasets name (default eval.prompts)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="answer length with --prompts (suites have theirs)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (outputs checked against autoregressive)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--engine", choices=("auto", "hf", "static"), default=None)
    g.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help=DRAFT_TOKENS_HELP)
    g.add_argument("--cost-aware", action="store_true", help="also run every method cost-aware ('+cost' rows): "
                   "the draft prefix verified each round is chosen from the measured verification cost")
    g.add_argument("--resume", action="store_true", help="suites: reuse those an earlier run of the same command "
                   "finished (saved in OUT/suites/, used only where drafters, prompts and settings match)")
    add_config_options(p)


def parse_drafters(specs: list[str]) -> dict[str, Path]:
    """'[NAME=]DIR' -> {name: dir}, each checked to hold a readable drafter config."""
    from dflashkit.checkpoint import load_config

    if not specs:
        raise ValueError("eval needs at least one --drafter DIR (a reference-format drafter directory: config.json + model.safetensors)")
    out: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"--drafter {spec}: {path} is not a directory")
        load_config(path)  # a broken config.json fails here, before any model is loaded
        name = name or path.name
        while name in out:
            name += "'"
        out[name] = path
    return out


def _pick(arg: Any, default: Any) -> Any:
    """A command-line value when given, else the config's."""
    return arg if arg is not None else default


def run(args: argparse.Namespace) -> int:
    from dflashkit.checkpoint import load_drafter
    from dflashkit.commands import config_from_args, resolve_device

    cfg = config_from_args(args)
    ec = cfg.eval
    offline = args.features is not None
    given = [f"--{k.replace('_', '-')}" for k in ONLINE_ONLY if getattr(args, k) is not None]
    if args.heldout and not offline:
        raise ValueError("--heldout selects samples of a feature cache: it needs --features DIR")
    if offline and given:
        log.warning("offline evaluation replays the cached data greedily; ignoring %s", ", ".join(given))
    paths = parse_drafters(args.drafter)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = args.budgets or list(ec.ddtree_budgets)
    top_k = args.top_k if args.top_k is not None else ec.ddtree_top_k
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    method_labels(methods, budgets)  # validates --methods
    device = resolve_device(cfg.target.device)
    settings = {"methods": methods, "budgets": budgets, "top_k": top_k}
    t0 = time.perf_counter()
    if offline:
        from dflashkit.data.features import FeatureCache

        cache = FeatureCache(args.features)
        head = load_target_head(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
        problems = cache.target_problems(head)
        if problems:
            raise ValueError("the features are not this target's: " + "; ".join(problems))
        drafters = {}
        for name, path in paths.items():
            d = load_drafter(path, head, device=device, dtype=head.dtype)
            if list(cache.layer_ids) != list(d.config.target_layer_ids):
                raise ValueError(f"--drafter {path}: target_layer_ids {d.config.target_layer_ids} differ from the feature "
                                 f"cache's layers {cache.layer_ids} ({args.features}); extract features for this drafter")
            drafters[name] = d
        items = heldout_items(cache, cfg.train.eval_samples, cfg.train.seed) if args.heldout else cache
        report = evaluate_offline(drafters, head, items, methods=methods, budgets=budgets, top_k=top_k, limit=args.limit)
        report["features"] = str(args.features)
    else:
        from dflashkit.data.prompts import get_suite, load_prompts, load_suite
        from dflashkit.target import load_target
        from dflashkit.vocab import stop_token_ids

        sampling = Sampling(_pick(args.temperature, ec.temperature), _pick(args.top_p, ec.top_p), _pick(args.seed, ec.seed))
        max_new = _pick(args.max_new_tokens, ec.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
        limit, source = _pick(args.limit, ec.limit), _pick(args.prompts, ec.prompts)
        suites = [get_suite(n.strip()) for n in args.suites.split(",") if n.strip()] if args.suites else \
            [get_suite(n) for n in ec.suites]
        if source is None and not suites:
            raise ValueError("--suites: expected at least one suite name")
        convs = load_prompts(source, limit=limit) if source is not None else None
        target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
        drafters = {n: load_drafter(p, target, device=target.device, dtype=target.dtype) for n, p in paths.items()}
        kw = dict(methods=methods, budgets=budgets, top_k=top_k, sampling=sampling, engine=_pick(args.engine, "auto"),
                  cost_aware=args.cost_aware, draft_tokens=args.draft_tokens,
                  stop_ids=stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None)))
        if convs is not None:
            if args.resume:
                log.warning("--resume reuses finished suites; an evaluation of --prompts runs whole")
            prompts = eval_prompts(convs, target.tokenizer, thinking=cfg.data.thinking)
            report = evaluate_online(target, drafters, prompts, max_new_tokens=max_new, **kw)
            settings.update(prompts=source, max_new_tokens=max_new)
        else:
            keep = Path(args.out) / "suites"
            log.info("each finished suite is saved in %s; after a stop, the same command with --resume continues", keep)
            report = evaluate_suites(target, drafters, [
                (s, eval_prompts(load_suite(s.name, limit), target.tokenizer, thinking=cfg.data.thinking)) for s in suites],
                keep=keep, reuse=args.resume, **kw)
            settings.update(suites=[s.name for s in suites], limit=limit)
        settings.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                        draft_tokens=args.draft_tokens)  # None: each drafter's block_size - 1
    report.update(training_tau_sim(paths))
    report.update(date=time.strftime("%Y-%m-%d %H:%M"), versions=versions(),
                  target=str(cfg.target.path or "SmolLM2-135M-Instruct (default)"),
                  device=device, settings=settings, seconds=round(time.perf_counter() - t0, 1),
                  drafter_paths={n: str(p) for n, p in paths.items()})
    files = write_report(report, args.out)
    print(markdown(report))
    print("wrote " + ", ".join(str(f) for f in files))
    check_partings(report)  # after the report is written: it holds every parting's margins
    return 0
