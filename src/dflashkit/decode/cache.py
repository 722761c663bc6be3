"""The one KV cache of decoding, owned by dflashkit (Transformers' cache semantics change between
releases, and none of them can roll a draft tree back).

One buffer per kind, [layers, b, kv_heads, capacity, head_dim], for keys and for values. Row i
keeps position p in slot p: its `lengths[i]` committed positions are slots [0, lengths[i]); what
lies beyond (a verified draft, prompt padding) is garbage that the attention masks hide. Sliding
layers keep full-length rows too, the window being a rule of the mask, so that rollback by
position works for every layer kind.

Rollback is one operation, `commit`: row i keeps the verified nodes `keep[i]` (a path, root
first) and moves them to slots lengths[i].., a chain being the path 0, 1, 2, ... that moves
nothing. Linear-attention layers (hybrid targets) keep a conv window and a recurrent state per
row instead (`LinearState`, attached as `KVCache.linear`); the same `commit` sets them to their
value after each row's last kept node (`decode/delta.py`).

The buffers keep their addresses while rows come and go (`k` is a view of the first b rows of a
storage allocated for the most rows seen): CUDA graphs captured over them stay valid, and a
graph captured for b rows serves every later batch of b rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dflashkit.decode import delta
from dflashkit.kernels import heads


class KVCache:
    def __init__(self, num_layers: int, linear: LinearState | None = None) -> None:
        self.num_layers = num_layers  # attention layers (a hybrid's linear layers live in `linear`)
        self.linear = linear
        self.k: Tensor | None = None  # [L, b, kv_heads, capacity, head_dim]: a view of the first b rows of _k
        self.v: Tensor | None = None
        self._k: Tensor | None = None  # storage [L, rows, kv_heads, capacity, head_dim]
        self._v: Tensor | None = None
        self.lengths: list[int] = []  # committed positions per row (host copy: no device sync to read it)
        self.lengths_t: Tensor | None = None  # the same on the device, [b]
        # Slots committed on the device whose counts the host has not read yet (`commit_plan`,
        # `settle`): the host's lengths are exact but late, and `bound` is an upper bound for now.
        self.slack = 0
        self.reserved = 0  # slots the next write may touch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Slots per row: allocated, or to be allocated at the first write."""
        return _aligned(self.reserved) if self.k is None else self.k.shape[3]

    @property
    def bound(self) -> int:
        """At least the longest row's length, without waiting for the device."""
        return max(self.lengths) + self.slack

    def start(self, batch: int, device: torch.device) -> None:
        """Forget everything: `batch` empty rows (buffers are kept when their shape allows)."""
        self.lengths, self.slack = [0] * batch, 0
        self.lengths_t = torch.zeros(batch, dtype=torch.long, device=device)
        self._view(batch)
        if self.linear is not None:
            self.linear.start(batch, device)

    def reserve(self, slots: int) -> None:
        """Make room for writes up to slot `slots` - 1; grows the buffers (doubling) if needed."""
        self.reserved = max(self.reserved, slots)
        if self.k is not None and slots > self.capacity:
            self._resize(max(slots, 2 * self.capacity))

    def _resize(self, capacity: int) -> None:
        capacity = _aligned(capacity)
        L, b, h, old, d = self.k.shape
        self._k = self.k.new_zeros(L, b, h, capacity, d)
        self._v = torch.zeros_like(self._k)
        self._k[:, :, :, :old], self._v[:, :, :, :old] = self.k, self.v
        self._view(b)

    def _view(self, batch: int) -> None:
        """k/v = the first `batch` rows of the storage (dropped when too small: the next write allocates)."""
        if self._k is not None and self._k.shape[1] < batch:
            self._k = self._v = None
        self.k = None if self._k is None else self._k[:, :batch]
        self.v = None if self._v is None else self._v[:, :batch]

    def allocate(self, like: Tensor) -> None:
        """The buffers, if not there yet, for keys/values shaped as like [b, kv_heads, t, head_dim]."""
        if self.k is None:
            b, h, _, d = like.shape
            self._k = like.new_zeros(self.num_layers, b, h, self.capacity, d)
            self._v = torch.zeros_like(self._k)
            self._view(b)

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.k[i], self.v[i])

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """k/v [b, kv_heads, t, head_dim] of one layer into slots [b, t] (per row)."""
        self.allocate(k)
        self.layer(layer).write(k, v, slots)

    def store(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """`write` through an op that torch.compile cannot see into (`store_kv`), for a compiled
        function over several layers of this cache (the drafter's step): there an `index_put_`
        into one layer's view of the shared buffer makes Inductor build the whole updated buffer
        and copy it back, keys and values, every call (on an H200, 135 us of a 2.6 ms DFlash round
        at 32 rows, and growing with the cache's capacity), where this op writes the slots in place.
        The op takes the whole buffers and the layer's index, not the layer's views: Inductor
        (torch 2.11-2.13) sent an opaque op's in-place writes into two views of one buffer to the
        same place, every layer's keys into the first layer's slots."""
        store_kv(self.k, self.v, layer, k, v, slots)

    def store_heads(self, layer: int, y: Tensor, kn: Tensor, eps: float, cos: Tensor, sin: Tensor, slots: Tensor) -> None:
        """`store` of keys and values still to be made from a fused [k; v] projection's output y
        [b, t, 2 kv_heads head_dim]: keys normalised by `kn` (eps) and rotated by cos/sin [b, 1, t,
        head_dim], in one Triton kernel (`heads.heads` without queries; CUDA), through an opaque op
        as `store`."""
        store_kv_heads(self.k, self.v, layer, y, kn, eps, cos, sin, slots)

    def span(self, n: int, bucket: int = 1) -> int:
        """Slots a pass attends over to see the first n: n rounded up to a multiple of `bucket`
        (fewer distinct shapes for CUDA graphs), within the capacity."""
        return min(-(-n // bucket) * bucket, self.capacity)

    def view(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        """Keys and values of slots [0, n) of one layer: [b, kv_heads, n, head_dim] views."""
        return self.layer(layer).view(n)

    def commit(self, keep: Sequence[Sequence[int]], width: int | None = None,
               apply: Callable[[Tensor, Tensor, bool, bool], None] | None = None) -> Tensor:
        """Row i keeps its verified nodes `keep[i]` (indices into what was written at slots
        lengths[i]..., root first; empty: the row commits nothing) and commits them. width: the
        verified block's nodes per row (default: the longest path); apply: `apply`, or the CUDA
        graph of it (`static_engine`). -> the plan on the device [b, width + 1]: each row's kept
        nodes, then at position j >= len(keep[i]) node j itself (moved onto itself), then its count;
        None when there is no device work (every path a chain, no linear layers)."""
        counts = [len(p) for p in keep]
        moves, fold = not all(map(is_chain, keep)), self.linear is not None and any(counts)
        if not (moves or fold):  # chains over attention layers: the kept nodes are where they belong
            if self.linear is not None:
                self.linear.pending = None
            self.advance(counts)
            return None
        q = max([width or 0, *counts])
        plan = to_device([[*p, *range(len(p), q), len(p)] for p in keep], self.lengths_t.device)  # one transfer
        self.commit_plan(plan, moves, apply)
        self.settle(counts, q)
        return plan

    def commit_plan(self, plan: Tensor, moves: bool, apply: Callable[[Tensor, Tensor, bool, bool], None] | None = None
                    ) -> None:
        """`commit` from a plan already on the device (as `commit` makes it; `Engine.commit_walk`
        makes it from the acceptance walk, no host read): the device side only. The host's
        lengths learn the counts when `settle` gives them; until then `bound` allows for the
        plan's width. moves: some path may not be a chain."""
        fold = self.linear is not None
        if fold and self.linear.pending is None:
            raise RuntimeError("KVCache.commit: no verification pass to commit (verify, then commit once)")
        if moves or fold:
            (apply or self.apply)(plan, self.lengths_t, moves, fold)
        if fold:
            self.linear.pending = None
        self.advance_late(plan[:, -1], plan.shape[1] - 1)

    def advance_late(self, counts: Tensor, width: int) -> None:
        """`advance` by counts [b] on the device, each at most `width`; `settle` tells the host."""
        self.lengths_t = self.lengths_t + counts
        self.slack += width

    def settle(self, counts: Sequence[int], width: int) -> None:
        """The host learns the counts of an `advance_late` (or `commit_plan`) of `width`."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.slack -= width

    def apply(self, plan: Tensor, lengths: Tensor, moves: bool, fold: bool) -> None:
        """The device side of `commit`: shapes fixed per (rows, width), every input a tensor or a
        flag and no read back to the host, so that a CUDA graph can capture it. moves: some path
        is not a chain, the kept nodes move to slots lengths.. (all `width` of them, the padding
        onto itself: one shape per block); fold: the linear layers take their pending block."""
        if moves:
            q, dev = plan.shape[1] - 1, plan.device
            base = lengths[:, None]
            src, dst = base + plan[:, :q], base + torch.arange(q, device=dev)
            L, b, h, _, d = self.k.shape
            for buf in (self.k, self.v):
                moved = buf.gather(3, src[None, :, None, :, None].expand(L, b, h, q, d))  # a copy: then scattered
                buf.scatter_(3, dst[None, :, None, :, None].expand(L, b, h, q, d), moved)
        if fold:
            self.linear.fold(plan)

    def advance(self, counts: Sequence[int]) -> None:
        """Commit the first counts[i] slots written past each row's length (no move needed; linear
        layers are advanced by the pass itself or by `commit`)."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.lengths_t = self.lengths_t + to_device(list(counts), self.lengths_t.device)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in `rows` (indices into the current batch)."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.lengths_t.device)  # long: rows may be []
        self.lengths = [self.lengths[r] for r in rows]
        self.lengths_t = self.lengths_t[idx]
        if self.k is not None:
            n = max(self.lengths, default=0)  # only committed slots need to move
            k, v = self.k[:, idx, :, :n], self.v[:, idx, :, :n]  # gathered copies: sources and destinations overlap
            self._view(len(rows))
            self.k[:, :, :, :n], self.v[:, :, :, :n] = k, v
        if self.linear is not None:
            self.linear.keep_rows(idx)

    def put_rows(self, src: KVCache, rows: Sequence[int]) -> None:
        """Copy row j of `src` (its length and committed slots) into row rows[j] of this cache,
        for j < len(rows) (rows of `src` beyond are not copied); rows from `batch` on are
        appended. Rows of the storage keep their addresses unless it must grow (more rows or
        slots than allocated)."""
        b = max(self.batch, max(rows) + 1)
        lengths = self.lengths + [0] * (b - self.batch)
        for j, r in enumerate(rows):
            lengths[r] = src.lengths[j]
        self.lengths = lengths
        # Only the rows taken get new lengths on the device: the others' may include rounds that
        # the host's lengths do not know yet (`advance_late`).
        lengths_t = src.lengths_t.new_zeros(b)
        if self.lengths_t is not None:
            lengths_t[:len(self.lengths_t)] = self.lengths_t
        lengths_t[to_device(list(rows), lengths_t.device)] = src.lengths_t[:len(rows)]
        self.lengths_t = lengths_t
        if self.linear is not None:
            self.linear.put_rows(src.linear, rows, b)
        like = self.k if self.k is not None else src.k
        if like is None:  # nothing written to either yet: the first write allocates b rows
            return
        if self._k is None or self._k.shape[1] < b:  # new storage for b rows, the old rows copied over
            L, _, h, _, d = like.shape
            old = (self.k, self.v)
            self._k = like.new_zeros(L, b, h, max(self.capacity, 0 if src.k is None else src.capacity), d)
            self._v = torch.zeros_like(self._k)
            if old[0] is not None:
                n, cap = old[0].shape[1], old[0].shape[3]
                self._k[:, :n, :, :cap], self._v[:, :n, :, :cap] = old
        self._view(b)
        if src.k is None:
            return
        m = len(rows)
        n = max(src.lengths[:m])
        self.reserve(n)
        idx = torch.tensor(list(rows), device=self.k.device)
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):  # rows on dim 1; only committed slots move
            mine[:, idx, :, :n] = theirs[:, :m, :, :n]


def drafter_cache(drafter: Any) -> KVCache:
    """An empty context cache for a drafter (`drafter.draft_block`): keys and values of each of
    its layers, no linear-attention state."""
    return KVCache(drafter.config.num_hidden_layers)


class LayerKV(NamedTuple):
    """One attention layer's keys and values [b, kv_heads, capacity, head_dim], views of a
    `KVCache`'s buffers: tensors only, so that a compiled function handed one layer's cache is
    not specialised on a layer index (one compiled graph serves every layer)."""

    k: Tensor
    v: Tensor

    def write(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """k/v [b, kv_heads, t, head_dim] into slots [b, t] (per row). An `index_put_`, not a
        `scatter_`: inside a compiled layer function Inductor fuses it into the kernel that makes
        k and v and writes the buffer in place, where a `scatter_` becomes a copy of the whole
        buffer and back."""
        b, h = k.shape[:2]
        idx = (torch.arange(b, device=k.device)[:, None, None], torch.arange(h, device=k.device)[None, :, None],
               slots[:, None, :])  # broadcast to [b, h, t]
        self.k.index_put_(idx, k.to(self.k.dtype))
        self.v.index_put_(idx, v.to(self.v.dtype))

    def view(self, n: int) -> tuple[Tensor, Tensor]:
        """Keys and values of slots [0, n): [b, kv_heads, n, head_dim] views."""
        return self.k[:, :, :n], self.v[:, :, :n]


@torch.library.custom_op("dflashkit::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k_cache: Tensor, v_cache: Tensor, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """`KVCache.store` as an opaque op: one layer's k/v [b, kv_heads, t, head_dim] into the
    buffers [layers, b, kv_heads, capacity, head_dim] at slots [b, t]. Eager, so a `scatter_`: one
    kernel per tensor that reads k/v with their strides (an eager `index_put_` first copies them
    contiguous and broadcasts its indices: four launches)."""
    b, h, t, d = k.shape
    idx = slots[:, None, :, None].expand(b, h, t, d)
    k_cache[layer].scatter_(2, idx, k.to(k_cache.dtype))
    v_cache[layer].scatter_(2, idx, v.to(v_cache.dtype))


@store_kv.register_fake
def _(k_cache: Tensor, v_cache: Tensor, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
    return None


@torch.library.custom_op("dflashkit::store_kv_heads", mutates_args=("k_cache", "v_cache"))
def store_kv_heads(k_cache: Tensor, v_cache: Tensor, layer: int, y: Tensor, kn: Tensor, eps: float, cos: Tensor,
                   sin: Tensor, slots: Tensor) -> None:
    """`KVCache.store_heads` as an opaque op (whole buffers and the layer's index, as `store_kv`)."""
    heads.heads(y, None, kn, False, eps, cos, sin, k_cache[layer], v_cache[layer], slots, 0, k_cache.shape[2])


@store_kv_heads.register_fake
def _(k_cache: Tensor, v_cache: Tensor, layer: int, y: Tensor, kn: Tensor, eps: float, cos: Tensor, sin: Tensor,
      slots: Tensor) -> None:
    return None


class LinearState:
    """Each linear-attention layer's state per row: the conv window [K-1, C] (the last K-1 inputs,
    in the model's dtype) and the recurrent state [heads, dk, dv] (fp32). Views of the first b rows
    of storages allocated for the most rows seen, like `KVCache`. A verification pass leaves a
    `delta.Block` in `pending`; `fold` turns it into each row's state after its last kept node.
    A prefill's chain, whose tokens are all kept, is folded by the pass itself."""

    def __init__(self, layers: int, kernel: int, channels: int, heads: int, dk: int, dv: int, dtype: torch.dtype) -> None:
        self.shape = (layers, kernel, channels, heads, dk, dv)
        self.dtype = dtype
        self._conv: Tensor | None = None  # [L, rows, K-1, C]
        self._rec: Tensor | None = None  # [L, rows, h, dk, dv]
        self.conv: Tensor | None = None
        self.rec: Tensor | None = None
        self.pending: delta.Block | None = None

    def start(self, batch: int, device: torch.device) -> None:
        L, K, C, h, dk, dv = self.shape
        if self._conv is None or self._conv.shape[1] < batch or self._conv.device != device:
            self._conv = torch.zeros(L, batch, K - 1, C, dtype=self.dtype, device=device)
            self._rec = torch.zeros(L, batch, h, dk, dv, dtype=torch.float32, device=device)
        self.conv, self.rec = self._conv[:, :batch], self._rec[:, :batch]
        self.conv.zero_()
        self.rec.zero_()
        self.pending = None

    def fold(self, plan: Tensor) -> None:
        """Row i's state becomes its state after its last kept node of the pending block (a
        `KVCache.commit` plan [b, q + 1]: kept nodes, padding, count; rows keeping nothing are
        unchanged). Device work only (`KVCache.apply`)."""
        p, dev = self.pending, self.rec.device
        # Every row at once (no row gathers or scatters of the state); a row keeping nothing is
        # inert: its window stays the committed one (seq's first K-1 inputs), no decay, no update.
        L, b, K1, C = self.conv.shape
        count = plan[:, -1]
        live, rows = count > 0, torch.arange(b, device=dev)
        leaf = plan.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]  # the path's last node (0 if none)
        window = torch.where(live[:, None], p.src[rows, leaf, 1:], torch.arange(K1, device=dev))  # [b, K-1]
        self.conv.copy_(p.seq.gather(2, window[None, :, :, None].expand(L, b, K1, C)))
        incl = (p.incl[rows, leaf] & live[:, None])[None, :, None, :]  # [1, b, 1, q]
        delta.fold(self.rec, p.k, p.d, p.G * live[:, None, None], incl, leaf[None, :, None, None].expand(L, b, 1, 1),
                   inplace=True)

    def put_rows(self, src: LinearState, rows: Sequence[int], batch: int) -> None:
        """Row j of `src` becomes row rows[j] of a batch of `batch` rows (`KVCache.put_rows`)."""
        if self._conv is None or self._conv.shape[1] < batch:
            old = (self.conv, self.rec)
            self._conv = src.conv.new_zeros(self.shape[0], batch, *src.conv.shape[2:])
            self._rec = src.rec.new_zeros(self.shape[0], batch, *src.rec.shape[2:])
            if old[0] is not None:
                self._conv[:, :old[0].shape[1]], self._rec[:, :old[1].shape[1]] = old
        self.conv, self.rec = self._conv[:, :batch], self._rec[:, :batch]
        idx = torch.tensor(list(rows), device=self.rec.device)
        self.conv[:, idx], self.rec[:, idx] = src.conv[:, :len(rows)], src.rec[:, :len(rows)]
        self.pending = None

    def keep_rows(self, idx: Tensor) -> None:
        conv, rec = self.conv[:, idx], self.rec[:, idx]  # gathered copies: sources and destinations overlap
        self.conv, self.rec = self._conv[:, :len(idx)], self._rec[:, :len(idx)]
        self.conv.copy_(conv)
        self.rec.copy_(rec)
        self.pending = None


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """Host numbers as a tensor on `device` without waiting for it: on CUDA through pinned
    memory and an asynchronous copy (a copy from pageable memory synchronises the stream)."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


class HostCopy:
    """A copy of t to the host, started now. `ready()` says whether it has arrived, without
    waiting; calling it waits for that copy alone (not for device work queued after it) and gives
    t's values as lists. On CUDA through pinned memory and an event; elsewhere the values are read
    at once."""

    def __init__(self, t: Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if t.device.type != "cuda":
            self.values = t.tolist()
            return
        self.buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.buf.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def __call__(self) -> list:
        if self.done is None:
            return self.values
        self.done.synchronize()
        return self.buf.tolist()


def is_chain(path: Sequence[int]) -> bool:
    """A path 0, 1, 2, ...: the verified nodes are already where they are committed. The round
    loop passes chains as `range`s, known without a look at their nodes."""
    if isinstance(path, range):
        return path.start == 0 and path.step == 1
    return list(path) == list(range(len(path)))


def _aligned(slots: int) -> int:
    return max(64, -(-slots // 64) * 64)  # aligned rows for attention kernels and masks
