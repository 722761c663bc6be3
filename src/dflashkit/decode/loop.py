"""The one round loop: b prompts, any method, greedy or sampled, lossless.

A round, for every running row, starting with its bonus token at position `length` (the first
token whose target features are not yet in the drafter's cache):

  draft   the drafter turns the features of the tokens verified last round plus the bonus into
          per-slot distributions for positions length+1 .. length+B-1;
  tree    DFlash: one chain of the B-1 argmax tokens; DDTree: a best-first tree of `budget`
          nodes from the top-`top_k` tokens per slot; autoregressive decoding: no node at all;
  verify  one target pass over [bonus, nodes...] of every row at positions length + depth, each
          node seeing the prefix and its ancestors;
  commit  walk from the root while the target's token at the current node (its argmax, or a
          sample of its own distribution) is a child; keep the accepted path in the caches; the
          target's token at the last node is the next bonus.

Lossless: every committed token is the target's argmax (greedy) or a sample of the target's own
distribution drawn before looking at the draft ("accept while draft == target sample"), so the
output is exactly what the target alone produces; the drafter only decides how many of those
tokens one target pass yields.

τ (acceptance length) of a round = accepted draft tokens + 1 (the target's token at the end of
the path), 1 <= τ <= B. The final round counts only tokens up to the stop token or the token
limit (named convention: it makes online τ equal offline τ from cached features).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from dflashkit.decode import cost
from dflashkit.decode.engine import Engine
from dflashkit.decode.generation import (METHODS, Generation, GenerationChunk, Sampling, new_generator, target_tokens,
                                         usage_stats)
from dflashkit.decode.static import static_engine, supported
from dflashkit.decode.tree import Tree, build_tree, prefix, walk


RESERVE = 2048  # answer tokens the caches make room for at the start


class _Stages:
    """Wall time per stage; synchronises CUDA at each boundary so that the times are honest."""

    def __init__(self, on: bool, device: torch.device) -> None:
        self.on, self.cuda = on, device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.t = 0.0

    def start(self) -> None:
        if self.on:
            if self.cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.on:
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.seconds[stage] += now - self.t
            self.t = now


def check_request(method: str, max_new_tokens: int, drafter: Any, budget: int | None = None) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter; use method 'ar' without one")
    if method == "ddtree" and (budget is None or budget < 1):
        raise ValueError(f"ddtree needs a node budget >= 1, got {budget}")


def row_tokens(logits: Tensor, samplings: Sequence[Sampling], gens: Sequence[torch.Generator | None]) -> Tensor:
    """logits [b, q, V] -> [b, q]: each row through `target_tokens` with its own sampling and
    random stream, so a row draws exactly what it would draw decoded alone."""
    if all(s.temperature == 0 for s in samplings):
        return logits.argmax(-1)
    return torch.stack([target_tokens(lg, s, g) for lg, s, g in zip(logits, samplings, gens)])


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} prompts")
    return values


def _trees(dlogits: Tensor | None, bonus: Tensor, method: str, budget: int | None, top_k: int,
           curve: cost.CostCurve | None = None) -> tuple[list[Tree], Tensor, Tensor, Tensor | None, Tensor | None]:
    """Each row's draft tree from the drafter's logits [b, B-1, V], and what verification needs:
    tokens and depths [b, q], ancestors [b, q, q] (None for chains), and the DFlash chain's
    tokens still on the device (or None). With a cost `curve`, only the prefix of the draft
    that maximises expected tokens per second is kept (the same size for every row)."""
    b, dev = bonus.shape[0], bonus.device
    if method == "ar":
        return [Tree([], [], [])] * b, bonus[:, None], torch.zeros(b, 1, dtype=torch.long, device=dev), None, None
    if method == "dflash":  # the chain stays on the device: one host transfer per round, after verify
        if curve is None:
            chain = dlogits.argmax(-1)
        else:
            conf, chain = torch.softmax(dlogits.float(), -1).max(-1)
            chain = chain[:, :curve.best_width(cost.chain_expectation(conf.cpu())) - 1]
        depths = torch.arange(chain.shape[1] + 1, device=dev).expand(b, -1)
        return [], torch.cat([bonus[:, None], chain], 1), depths, None, chain
    lp, ids = torch.log_softmax(dlogits.float(), -1).topk(top_k, dim=-1)
    trees = [build_tree(l, i, budget) for l, i in zip(lp.cpu(), ids.cpu())]
    if curve is not None:
        m = curve.best_width(cost.tree_expectation([t.scores for t in trees], budget)) - 1
        trees = [prefix(t, m) for t in trees]
    q = 1 + max(len(t) for t in trees)
    tokens = torch.tensor([t.tokens + [0] * (q - 1 - len(t)) for t in trees], dtype=torch.long)
    depths = torch.tensor([[0, *t.depths] + [0] * (q - 1 - len(t)) for t in trees])
    anc = torch.stack([t.ancestors(q) for t in trees])
    return trees, torch.cat([bonus[:, None], tokens.to(dev)], 1), depths.to(dev), anc.to(dev), None


@torch.no_grad()
def decode_stream(
    engine: Engine,
    prompts: Sequence[Tensor],  # b x [T_i] or [1, T_i]
    *,
    max_new_tokens: int | Sequence[int],
    method: str = "dflash",
    budget: int | None = None,
    top_k: int = 4,
    sampling: Sampling | Sequence[Sampling] | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    cancelled: Callable[[int], bool] = lambda i: False,
    profile: bool = False,
    cost_aware: bool = False,
) -> Iterator[list[tuple[int, list[int], Generation]]]:
    """Decode every prompt to its first stop token (included) or its token limit. Yields, after
    the prefill and after each round, (prompt index, newly committed tokens, its running
    `Generation`) for each row that was still running. Per row, the tokens, τ per round and
    random draws equal decoding that prompt alone (same seed). A row for which
    `cancelled(prompt index)` turns true stops before the next round, unfinished (it leaves the
    batch, or stays in it idle on an engine with `fixed_rows`).

    method: 'ar' (no drafter), 'dflash' (one chain of B-1 argmax tokens), 'ddtree' (a tree of
    `budget` nodes from the top-`top_k` tokens of each slot). cost_aware: measure what
    verification costs here, then verify per round only the draft prefix that maximises expected
    tokens per second (`decode/cost.py`); the sizes chosen go to `Generation.draft_sizes`."""
    prompts = [p.reshape(-1) if p.ndim == 2 and p.shape[0] == 1 else p for p in prompts]
    if not prompts or any(p.ndim != 1 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of [T] or [1, T] token tensors")
    n = len(prompts)
    limits = _per_row(max_new_tokens, n, "max_new_tokens")
    samplings = [s or Sampling() for s in _per_row(sampling, n, "sampling")]
    for lim in limits:
        check_request(method, lim, engine.drafter, budget)
    if engine.target.max_positions:  # the answer ends where the model's positions do
        limits = [min(lim, engine.target.max_positions - len(p)) for lim, p in zip(limits, prompts)]
    B = engine.drafter.config.block_size if engine.drafter is not None else 1
    dev = engine.target.device
    gens = [new_generator(s, dev) for s in samplings]
    stages = _Stages(profile, dev)

    t0 = time.perf_counter()
    # Room for the answer up to a few thousand tokens; the caches grow beyond that only if the
    # answer does (a request without a token limit must not reserve the model's whole context).
    room = max(len(p) + min(m, RESERVE) for p, m in zip(prompts, limits)) + (budget or 0) + 2 * B
    logits = engine.prefill(prompts, capacity=room)
    bonus = row_tokens(logits[:, None], samplings, gens)[:, 0]  # [b], stays on the device
    first = bonus.tolist()  # waits for the prefill: time to first token is honest on CUDA too
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = [Generation([], [], "", len(p), prefill_s, 0.0) for p in prompts]
    rows = list(range(n))  # prompt index of each row of the running batch
    yield [(i, res[i].extend([t], limits[i], stop_ids), res[i]) for i, t in enumerate(first)]
    curve = None
    if cost_aware and method != "ar":
        top = B if method == "dflash" else budget + 1
        curve = cost.measure(engine, sorted({w for w in (1, 2, 4, 8, 16, 32, 64, top) if w <= top}))
        t1 = time.perf_counter()  # the measurement is not decoding time
    while True:
        running = [not res[i].finish_reason and not cancelled(i) for i in rows]
        if not any(running):
            break
        if not all(running) and not engine.fixed_rows:  # finished rows leave the batch
            keep = [k for k, r in enumerate(running) if r]
            engine.keep_rows(keep)
            bonus, rows, running = bonus[torch.tensor(keep, device=dev)], [rows[k] for k in keep], [True] * len(keep)
        stages.start()
        t_draft = time.perf_counter()
        dlogits = engine.draft(bonus) if method != "ar" else None  # [b, B-1, V]
        stages.mark("draft")
        trees, tokens, depths, anc, chain = _trees(dlogits, bonus, method, budget, top_k, curve)
        if curve is not None:  # the tree's host transfer has waited for the draft: its time is known
            spent = time.perf_counter() - t_draft
            curve.draft_seconds = spent if not curve.draft_seconds else 0.8 * curve.draft_seconds + 0.2 * spent
        stages.mark("tree")
        picked = row_tokens(engine.verify(tokens, depths, anc), [samplings[i] for i in rows], [gens[i] for i in rows])
        stages.mark("verify")
        if chain is not None:
            host = torch.cat([chain, picked], 1).tolist()  # the round's one transfer to the host
            c = chain.shape[1]
            trees, host = [Tree.chain(h[:c]) for h in host], [h[c:] for h in host]
        else:
            host = picked.tolist()
        walks = [walk(t, h) for t, h in zip(trees, host)]  # (accepted path, the target's token after it)
        engine.commit([path if run else [] for (path, _), run in zip(walks, running)])  # idle rows commit nothing
        bonus = torch.tensor([last for _, last in walks], device=dev)
        stages.mark("commit")
        step = []
        for i, tree, (path, last), run in zip(rows, trees, walks, running):
            if not run:
                continue
            new = res[i].extend([tree.tokens[j - 1] for j in path[1:]] + [last], limits[i], stop_ids)
            res[i].accept_lengths.append(len(new))
            if curve is not None:
                res[i].draft_sizes.append(tokens.shape[1] - 1)
            res[i].decode_seconds = time.perf_counter() - t1
            if profile:
                res[i].stage_seconds = dict(stages.seconds)
            step.append((i, new, res[i]))
        yield step


def generate_batch(engine: Engine, prompts: Sequence[Tensor], **kw: Any) -> list[Generation]:
    """`decode_stream` to the end: one finished `Generation` per prompt, in order."""
    out: dict[int, Generation] = {}
    for step in decode_stream(engine, prompts, **kw):
        out.update((i, g) for i, _, g in step)
    return [out[i] for i in range(len(prompts))]


def generate(engine: Engine, prompt_ids: Tensor, **kw: Any) -> Generation:
    """One prompt ([1, T] or [T]) to the end: its finished `Generation`."""
    if prompt_ids.ndim == 2 and prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids: expected shape [1, T] or [T], got {tuple(prompt_ids.shape)}; "
                         "use generate_batch for several prompts")
    return generate_batch(engine, [prompt_ids], **kw)[0]


def make_engine(target: Any, drafter: Any, kind: str = "auto") -> Engine:
    """'hf' (any Transformers model); 'static' (own layers, CUDA graphs on CUDA); or 'auto': on
    CUDA, for the targets the static runner supports, static + torch.compile + fused q/k/v and
    gate/up weights (the fastest measured, docs/benchmarks.md), else hf; hybrids with linear
    attention always run on the static runner (Transformers' layers cannot roll their state back)."""
    if kind not in ("auto", "hf", "static"):
        raise ValueError(f"engine: expected 'auto', 'hf' or 'static', got {kind!r}")
    if kind == "auto" and target.device.type == "cuda" and supported(target) is None:
        return static_engine(target, drafter, compile=True)
    if kind == "static" or (kind == "auto" and "linear_attention" in target.layer_kinds):
        return static_engine(target, drafter)
    return Engine(target, drafter)


class DecodingGenerator:
    """The server's generator (`generation.BatchedGenerator`): requests decoded by the round loop,
    one chunk per round; each request keeps its own sampling parameters, seed and token limit.
    Speculative methods add their acceptance statistics to the usage block."""

    def __init__(self, engine: Engine, *, method: str = "dflash", budget: int | None = None, top_k: int = 4) -> None:
        check_request(method, 1, engine.drafter, budget)
        self.engine, self.method, self.budget, self.top_k = engine, method, budget, top_k
        self.label = None if method == "ar" else method if method != "ddtree" else f"ddtree-{budget}"

    def generate_batch(self, requests: Sequence[tuple[list[int], dict[str, Any]]],
                       cancelled: Callable[[int], bool] = lambda i: False) -> Iterator[list[tuple[int, GenerationChunk]]]:
        """requests: (input ids, `generate` keyword arguments); the stop ids are the server's, the
        same for every request. Yields (request index, chunk) per round."""
        params = [kw for _, kw in requests]
        steps = decode_stream(
            self.engine, [torch.tensor(ids) for ids, _ in requests], method=self.method, budget=self.budget,
            top_k=self.top_k, max_new_tokens=[kw["max_new_tokens"] for kw in params],
            sampling=[Sampling(kw["temperature"], kw["top_p"], kw["seed"]) for kw in params],
            stop_ids=params[0]["stop_ids"], cancelled=cancelled)
        for step in steps:
            yield [(i, GenerationChunk(new, g.finish_reason, {**usage_stats(g, self.label), "batch_size": len(requests)})
                    if g.finish_reason else GenerationChunk(new)) for i, new, g in step]

    def generate(self, input_ids: list[int], **kw: Any) -> Iterator[GenerationChunk]:
        for step in self.generate_batch([(input_ids, kw)]):
            yield step[0][1]
