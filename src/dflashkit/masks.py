"""Who may attend to whom in the drafter (docs/conventions.md, "Training attention").

A query is a block slot; it belongs to the block of anchor `a`. It sees

* context positions `< a` (strictly: the anchor's own features do not exist yet at inference),
  bounded below by `a - sliding_window` in sliding layers;
* every slot of its own block (bidirectional);
* nothing of any other block, and never padding.

One predicate, `visible`, states this rule. The dense boolean mask (SDPA, CPU) and the
block-sparse FlexAttention mask (GPU) are both evaluations of it, and the inference path builds
its mask from the same layout, so training and inference cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

CTX = -1  # key id of a context token
PAD = -2  # key id of padding: visible to nobody

TILE = 128  # FlexAttention's block: tiles of 128 queries x 128 keys are skipped, masked or run whole

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention as _flex
except ImportError:  # pragma: no cover - old torch
    BlockMask, _flex = None, None


@dataclass
class Layout:
    """Queries are block slots; keys are [context tokens..., block slots...] of one attention call."""

    q_anchor: Tensor  # [b, q] anchor position of each query's block
    q_block: Tensor  # [b, q] block index of each query
    k_pos: Tensor  # [b, K] position of each key
    k_block: Tensor  # [b, K] CTX for context keys, block index for block keys, PAD for padding


def visible(q_anchor: Tensor, q_block: Tensor, k_pos: Tensor, k_block: Tensor, window: int | None) -> Tensor:
    """The attention rule, elementwise on broadcastable tensors."""
    ctx = (k_block == CTX) & (k_pos < q_anchor)
    if window is not None:
        ctx = ctx & (k_pos >= q_anchor - window)
    return ctx | ((k_block == q_block) & (k_block >= 0))


def dense_mask(layout: Layout, window: int | None) -> Tensor:
    """bool [b, 1, q, K], True where attention is allowed."""
    m = visible(layout.q_anchor[:, :, None], layout.q_block[:, :, None],
                layout.k_pos[:, None, :], layout.k_block[:, None, :], window)
    return m[:, None]


def flex_block_mask(layout: Layout, window: int | None) -> Any:
    """The same rule as a block-sparse FlexAttention mask: `dense_mask` counted over 128x128 tiles,
    one row at a time (the transient is one row's [q, K] of booleans), empty tiles skipped and full
    ones run without the mask. This equals `create_block_mask` over `visible`, which evaluates the
    rule through vmapped gathers: that makes a training step at the Qwen3-8B shapes 7 % slower on
    an H200 (docs/benchmarks.md, Training)."""
    if BlockMask is None:
        raise RuntimeError("FlexAttention needs torch >= 2.5; use attention backend 'sdpa'")
    qa, qb, kp, kb = layout.q_anchor, layout.q_block, layout.k_pos, layout.k_block

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(qa[b, q_idx], qb[b, q_idx], kp[b, kv_idx], kb[b, kv_idx], window)

    (b, q), K = qa.shape, kp.shape[1]
    nq, nk = -(-q // TILE), -(-K // TILE)
    counts = torch.stack([  # [b, 1, nq, nk] visible pairs per tile
        F.pad(dense_mask(Layout(qa[i:i + 1], qb[i:i + 1], kp[i:i + 1], kb[i:i + 1]), window)[0, 0],
              (0, nk * TILE - K, 0, nq * TILE - q)).view(nq, TILE, nk, TILE).sum((1, 3), dtype=torch.int32)
        for i in range(b)])[:, None]
    full = counts == TILE * TILE
    partial = (counts > 0) & ~full

    def ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:  # per query tile: how many, then which key tiles first
        t = tiles.to(torch.int32)
        return t.sum(-1, dtype=torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(q, K))


def is_block_mask(mask: Any) -> bool:
    return BlockMask is not None and isinstance(mask, BlockMask)


@lru_cache(maxsize=None)
def _compiled_flex():
    return torch.compile(_flex, dynamic=False)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    # Compiled on GPU (fused kernel); eager elsewhere (a reference implementation, for tests).
    # Inside a compiled caller (the trainer compiles its layers) the op is traced as it is.
    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else _flex
    return fn(q, k, v, **kwargs)


def layer_masks(layout: Layout, layer_types: list[str], window: int | None, backend: str = "sdpa") -> dict[str, Any]:
    """One mask per distinct layer type ('full_attention' / 'sliding_attention')."""
    build = {"sdpa": dense_mask, "flex": flex_block_mask}.get(backend)
    if build is None:
        raise ValueError(f"attention backend: expected 'sdpa' or 'flex', got {backend!r}")
    return {t: build(layout, window if t == "sliding_attention" else None) for t in set(layer_types)}


# ---- the two paths' layouts ----------------------------------------------------------------


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """[b, n] anchors -> [b, n * B] slot positions anchor + k: the anchor keeps its own position."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).flatten(-2)


def training_layout(anchors: Tensor, block_size: int, ctx_valid: Tensor) -> Layout:
    """Whole-sequence context plus `n` blocks per sequence.

    anchors: [b, n] anchor positions (padding blocks may hold any position: their loss is masked);
    ctx_valid: bool [b, T], False on padded context positions.
    """
    b, n = anchors.shape
    T = ctx_valid.shape[1]
    dev = anchors.device
    blk = torch.arange(n, device=dev).repeat_interleave(block_size).expand(b, -1)
    ctx_pos = torch.arange(T, device=dev).expand(b, -1)
    ctx_id = torch.where(ctx_valid, CTX, PAD)
    return Layout(
        q_anchor=anchors.repeat_interleave(block_size, dim=1),
        q_block=blk,
        k_pos=torch.cat([ctx_pos, block_positions(anchors, block_size)], dim=1),
        k_block=torch.cat([ctx_id, blk], dim=1),
    )


def inference_layout(start: Tensor, block_size: int, n_slots: int) -> Layout:
    """One block per row at start [b] over a context cache whose slot p holds position p.

    Slots before `start` are context (the bonus token's own features are not known yet), the
    block's own keys sit at slots start..start+B-1, anything beyond is padding."""
    b, dev = start.shape[0], start.device
    slot = torch.arange(n_slots, device=dev).expand(b, -1)
    rel = slot - start[:, None]
    k_block = torch.where(rel < 0, CTX, torch.where(rel < block_size, 0, PAD))
    q_anchor = start[:, None].expand(-1, block_size)
    return Layout(q_anchor, torch.zeros_like(q_anchor), slot, k_block)
