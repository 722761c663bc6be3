"""Batched decoding on the generic Transformers path: autoregressive and DFlash, b prompts at once.

Ragged rows: row i's KV entries are left-aligned, slot j holding position j for j < lengths[i];
slots past a row's length (prompt padding, rejected drafts) are garbage marked invalid by a 4-D
mask built from `lengths`. A round appends q tokens per row at the shared end of the cache, then
`pack` moves each row's accepted entries down to its own length (q entries per row, no full
copy) and crops the cache to the longest row. The drafter's context cache follows the same
scheme, with `position_ids` [b, q] explicit everywhere.

One round per call for all unfinished rows; finished rows are dropped from the batch. DDTree is
not batched (each row's tree has its own shape and ancestor mask): use `decode.generate` per
prompt. The GPU `StaticEngine` stays batch 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from dflashkit import masks as masks_mod
from dflashkit.decode import Generation, HFEngine, Sampling, Tree, attention_masks, check_request, new_generator, \
    target_tokens, usage_stats, walk
from dflashkit.drafter import DFlashDrafter, DrafterCache, block_token_ids
from dflashkit.target import Target, _cache_layers, cache_length

BATCH_METHODS = ("ar", "dflash")


def pack(x: Tensor, start: int, lengths: Tensor, size: int) -> Tensor:
    """x [b, h, start + q, d]: row i's q entries appended at `start` move to lengths[i] + k, then
    x is cut to `size` slots (the longest row's new length, computed once by the caller: one host
    sync per cache, not per layer). Entries past a row's accepted count land beyond its new length
    (garbage, masked); lengths[i] <= start keeps every destination inside x."""
    b, h, _, d = x.shape
    new = x[:, :, start:].clone()  # [b, h, q, d]; a copy: sources and destinations overlap
    dest = lengths[:, None] + torch.arange(new.shape[2], device=x.device)  # [b, q]
    x.scatter_(2, dest[:, None, :, None].expand(b, h, -1, d), new)
    return x[:, :, :size]


class BatchHFEngine(HFEngine):
    """b sequences on one target cache and one drafter cache (ragged, see the module docstring).

    lengths [b]: committed positions per row (the next bonus token sits at lengths[i]);
    ctx_lengths [b]: positions in the drafter's cache; pending [b, c, F] with pending_counts [b]:
    target features of the tokens verified last round that the drafter has not seen yet."""

    def prefill(self, prompts: Sequence[Tensor]) -> Tensor:  # prompts: b x [T_i] -> logits [b, V]
        from transformers import DynamicCache

        dev = self.target.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=dev)  # right padding: invalid keys
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p.to(dev)
        pos = torch.arange(T, device=dev).expand(len(prompts), -1)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        vis = causal & (pos < lens[:, None])[:, None, :]  # [b, T, T]; a pad query still sees its row's tokens
        self.cache = DynamicCache() if self.sliding else self.target.new_cache()
        self.dcache = self.drafter.new_cache() if self.drafter is not None else None
        out = self.target.forward(ids, self.layer_ids, cache=self.cache, position_ids=pos, attention_mask=self._masks(vis, pos, pos))
        self.lengths, self.ctx_lengths = lens, torch.zeros_like(lens)
        self.pending, self.pending_counts = out.features, lens
        return out.logits[torch.arange(len(prompts), device=dev), lens - 1]

    def _masks(self, vis: Tensor, q_pos: Tensor, k_pos: Tensor) -> Any:
        return attention_masks(vis, q_pos, k_pos, self.target.dtype, self.window if self.sliding else None)

    def draft(self, bonus: Tensor) -> Tensor:  # bonus [b] at positions lengths -> drafter logits [b, B-1, V]
        cfg, dev = self.drafter.config, self.target.device
        b, c = self.pending.shape[:2]
        held = len(self.dcache)
        start = self.lengths  # == ctx_lengths + pending_counts
        slots = torch.arange(held, device=dev).expand(b, -1)
        new = torch.arange(c, device=dev).expand(b, -1)
        blk = start[:, None] + torch.arange(cfg.block_size, device=dev)  # [b, B]
        ctx_pos = self.ctx_lengths[:, None] + new  # [b, c]

        def ctx_id(valid: Tensor) -> Tensor:
            return torch.where(valid, masks_mod.CTX, masks_mod.PAD)

        # Padded new entries sit at positions >= start, which the rule hides anyway; stale cache slots do not.
        layout = masks_mod.Layout(
            q_anchor=start[:, None].expand(-1, cfg.block_size), q_block=torch.zeros_like(blk),
            k_pos=torch.cat([slots, ctx_pos, blk], 1),
            k_block=torch.cat([ctx_id(slots < self.ctx_lengths[:, None]), ctx_id(new < self.pending_counts[:, None]),
                               torch.zeros_like(blk)], 1))
        emb = self.target.embed(block_token_ids(bonus[:, None], cfg.block_size, cfg.mask_token_id))
        lm = masks_mod.layer_masks(layout, cfg.layer_types, cfg.sliding_window)
        h = self.drafter(emb, self.pending, blk, ctx_pos, lm, self.dcache)
        size = int(start.max())
        for i in range(len(self.dcache.keys)):
            self.dcache.keys[i] = pack(self.dcache.keys[i], held, self.ctx_lengths, size)
            self.dcache.values[i] = pack(self.dcache.values[i], held, self.ctx_lengths, size)
        self.ctx_lengths = start
        return self.target.lm_head(h[:, 1:])

    def verify(self, tokens: Tensor) -> Tensor:  # tokens [b, q], a chain at lengths + k -> logits [b, q, V]
        dev = self.target.device
        b, q = tokens.shape
        held = cache_length(self.cache)
        q_pos = self.lengths[:, None] + torch.arange(q, device=dev)  # [b, q]
        k_pos = torch.cat([torch.arange(held, device=dev).expand(b, -1), q_pos], 1)  # [b, held + q]
        prefix = (k_pos[:, None, :held] < self.lengths[:, None, None]).expand(-1, q, -1)
        chain = torch.ones(q, q, dtype=torch.bool, device=dev).tril().expand(b, -1, -1)
        mask = self._masks(torch.cat([prefix, chain], 2), q_pos, k_pos)
        out = self.target.forward(tokens, self.layer_ids, cache=self.cache, position_ids=q_pos, attention_mask=mask)
        self.verified = out.features
        return out.logits

    def commit(self, counts: Tensor) -> None:
        """Keep the first counts[i] (>= 1) verified tokens of row i: the accepted chain."""
        held = cache_length(self.cache) - self.verified.shape[1]
        size = int((self.lengths + counts).max())
        for layer in _cache_layers(self.cache):
            layer.keys = pack(layer.keys, held, self.lengths, size)
            layer.values = pack(layer.values, held, self.lengths, size)
        self.lengths = self.lengths + counts
        self.pending, self.pending_counts = self.verified, counts

    def keep_rows(self, rows: Tensor) -> None:
        """Drop every row not in `rows` (indices into the current batch); caches shrink to the longest kept row."""
        self.lengths, self.ctx_lengths = self.lengths[rows], self.ctx_lengths[rows]
        self.pending, self.pending_counts = self.pending[rows], self.pending_counts[rows]
        n = int(self.lengths.max())
        for layer in _cache_layers(self.cache):
            layer.keys, layer.values = layer.keys[rows, :, :n], layer.values[rows, :, :n]
        if self.dcache is not None and len(self.dcache):
            m = int(self.ctx_lengths.max())
            self.dcache = DrafterCache([k[rows, :, :m] for k in self.dcache.keys], [v[rows, :, :m] for v in self.dcache.values])


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


@torch.no_grad()
def generate_batch_stream(
    target: Target,
    drafter: DFlashDrafter | None,
    prompts: Sequence[Tensor],  # b x [T_i] or [1, T_i]
    *,
    max_new_tokens: int | Sequence[int],
    method: str = "dflash",
    sampling: Sampling | Sequence[Sampling] | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    cancelled: Callable[[int], bool] = lambda i: False,
) -> Iterator[list[tuple[int, list[int], Generation]]]:
    """Decode every prompt to its first stop token (included) or its token limit. Yields, after
    the prefill and after each round, (prompt index, newly committed tokens, its running
    `Generation`) for each row that was still running. Per row the tokens, τ per round and
    random draws equal `decode.generate` of that prompt alone (same seed). A row for which
    `cancelled(prompt index)` turns true leaves the batch before the next round, unfinished."""
    if method == "ddtree":
        raise ValueError("batched decoding supports 'ar' and 'dflash'; DDTree is batch 1 only (decode.generate per prompt)")
    if method not in BATCH_METHODS:
        raise ValueError(f"method: expected one of {BATCH_METHODS}, got {method!r}")
    prompts = [p.reshape(-1) if p.ndim == 2 and p.shape[0] == 1 else p for p in prompts]
    if not prompts or any(p.ndim != 1 or not len(p) for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty [T] or [1, T] token tensors")
    limits = _per_row(max_new_tokens, len(prompts), "max_new_tokens")
    samplings = _per_row(sampling or Sampling(), len(prompts), "sampling")
    for n in limits:
        check_request(method, n, drafter)
    engine = BatchHFEngine(target, drafter if method == "dflash" else None)
    dev = target.device
    gens = [new_generator(s, dev) for s in samplings]

    t0 = time.perf_counter()
    logits = engine.prefill(prompts)  # [b, V]
    bonus = row_tokens(logits[:, None], samplings, gens)[:, 0]  # [b], stays on the device
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = [Generation([], [], "", len(p), prefill_s, 0.0) for p in prompts]
    rows = list(range(len(prompts)))  # prompt index of each row of the running batch
    yield [(i, res[i].extend([t], limits[i], stop_ids), res[i]) for i, t in enumerate(bonus.tolist())]
    while True:
        keep = [k for k, i in enumerate(rows) if not res[i].finish_reason and not cancelled(i)]
        if not keep:
            break
        if len(keep) < len(rows):
            idx = torch.tensor(keep, device=dev)
            engine.keep_rows(idx)
            bonus, rows = bonus[idx], [rows[k] for k in keep]
        if method == "dflash":
            tokens = torch.cat([bonus[:, None], engine.draft(bonus).argmax(-1)], 1)  # [b, B]
        else:
            tokens = bonus[:, None]  # [b, 1]
        picked = row_tokens(engine.verify(tokens), [samplings[i] for i in rows], [gens[i] for i in rows])  # [b, q]
        q = tokens.shape[1]
        host = torch.cat([tokens[:, 1:], picked], 1).tolist()  # the tokens reach the host once per round
        walks = [walk(Tree.chain(h[:q - 1]), h[q - 1:]) for h in host]  # (accepted path, target's token after it)
        counts = torch.tensor([len(path) for path, _ in walks], device=dev)
        engine.commit(counts)
        bonus = picked.gather(1, counts[:, None] - 1)[:, 0]
        step = []
        for i, h, (path, last) in zip(rows, host, walks):
            new = res[i].extend(h[:len(path) - 1] + [last], limits[i], stop_ids)
            res[i].accept_lengths.append(len(new))
            res[i].decode_seconds = time.perf_counter() - t1
            step.append((i, new, res[i]))
        yield step
    if dev.type == "cuda":
        torch.cuda.synchronize()


def generate_batch(target: Target, drafter: DFlashDrafter | None, prompts: Sequence[Tensor], **kw: Any) -> list[Generation]:
    """`generate_batch_stream` to the end: one finished `Generation` per prompt, in order."""
    out: dict[int, Generation] = {}
    for step in generate_batch_stream(target, drafter, prompts, **kw):
        out.update((i, g) for i, _, g in step)
    return [out[i] for i in range(len(prompts))]


class BatchGenerator:
    """The `serve.Generator` of `dflashkit serve --max-batch N` (N > 1): the worker hands it up to N
    queued requests at once (`generate_batch`); each request keeps its own sampling parameters,
    seed and token limit, and gets one chunk per round as its row advances."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None) -> None:
        self.target, self.drafter = target, drafter
        self.method = "dflash" if drafter is not None else "ar"

    def generate_batch(self, requests: Sequence[tuple[list[int], dict[str, Any]]],
                       cancelled: Callable[[int], bool] = lambda i: False) -> Iterator[list[tuple[int, Any]]]:
        """requests: (input ids, `serve.Generator.generate` keyword arguments); the stop ids are the
        server's, the same for every request. Yields (request index, `GenerationChunk`) per round."""
        from dflashkit.serve import GenerationChunk

        params = [kw for _, kw in requests]
        label = "dflash" if self.method == "dflash" else None
        steps = generate_batch_stream(
            self.target, self.drafter, [torch.tensor(ids) for ids, _ in requests], method=self.method,
            max_new_tokens=[kw["max_new_tokens"] for kw in params],
            sampling=[Sampling(kw["temperature"], kw["top_p"], kw["seed"]) for kw in params],
            stop_ids=params[0]["stop_ids"], cancelled=cancelled)
        for step in steps:
            yield [(i, GenerationChunk(new, g.finish_reason, {**usage_stats(g, label), "batch_size": len(requests)})
                    if g.finish_reason else GenerationChunk(new)) for i, new, g in step]

    def generate(self, input_ids: list[int], **kw: Any) -> Iterator[Any]:
        for step in self.generate_batch([(input_ids, kw)]):
            yield step[0][1]
