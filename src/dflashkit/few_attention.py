"""Attention of a few queries over a long KV cache, fused, for one-row decoding passes on CUDA.

A decoding pass at batch 1 attends 1-65 queries per row (an AR step, a DFlash block, a DDTree-64
tree) over a cache of a few hundred to tens of thousands of slots, under an additive mask (the
tree's visibility). `drafter.attend_few` writes it out as q kᵀ, a softmax and p v: three kernels,
about 9 µs per layer of a Qwen3-8B target on an H200 at 768 slots, but 62 µs at 16,384, where
the scores it writes out ([kv, g*t, n] in fp32) cost more than the keys. Here (FlashDecoding's
scheme) one Triton kernel gives each (query tile, KV head, span of `SPLIT` keys or more) a
program that computes its scores, an online softmax and its share of p v in fp32; a second kernel
weighs the spans' partial sums by their maxima and normalisers: 39 µs at 16,384 slots, but 11.5 µs
at 768, where two launches cost more than the work (docs/benchmarks.md). Scores are taken in fp32
from the bf16 products (the written-out path rounds q kᵀ to bf16 first).

Layout as `attend_few`'s: q [b, kv, G, d] (the G = g * t query heads of a KV group folded into
the query axis), k / v [b, kv, n, d] (last dimension contiguous), mask additive [b, 1, G, n].
`available` says whether this path runs (enough keys: `FROM_KEYS`, CUDA tensors, Triton importable)."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `drafter.attend_few` writes the attention out instead
    triton = None

SPLIT = 128  # keys per program at least: at 768 slots, 6 programs per KV head and query tile
MAX_SPANS = 16  # past 16 x 128 slots, spans grow (powers of two) instead: partial sums stay small
BLOCK_N = 64  # keys per inner step
BLOCK_G = 64  # folded queries per program at most (at least 16 for tl.dot: an AR step's 4 take 16)


# Keys from which the fused kernel replaces the written-out attention (None: never): on an H200,
# 23.8 against 26.5 us over 6,144 slots; at 4,096 the written-out one is still 8 % faster.
FROM_KEYS: int | None = 6144


def available(q: Tensor, k: Tensor) -> bool:
    return (FROM_KEYS is not None and k.shape[-2] >= FROM_KEYS and triton is not None and q.is_cuda
            and q.shape[-1] in (64, 128) and q.dtype in (torch.bfloat16, torch.float16))


if triton is not None:

    @triton.jit
    def _spans(q_ptr, k_ptr, v_ptr, m_ptr, acc_ptr, stat_ptr, G, N, scale,
               sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_g, sm_n,
               H: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, SPAN: tl.constexpr):
        pg, bh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        rg = pg * BG + tl.arange(0, BG)
        rd = tl.arange(0, D)
        live = rg < G
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rg[:, None] * sq_g + rd[None, :], mask=live[:, None], other=0.0)
        m_i = tl.full([BG], float("-inf"), tl.float32)
        l_i = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, D], tl.float32)
        for j in range(0, SPAN, BN):
            rn = s * SPAN + j + tl.arange(0, BN)
            keys = rn < N
            k = tl.load(k_ptr + b * sk_b + h * sk_h + rn[:, None] * sk_n + rd[None, :], mask=keys[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * scale
            bias = tl.load(m_ptr + b * sm_b + rg[:, None] * sm_g + rn[None, :] * sm_n, mask=live[:, None] & keys[None, :],
                           other=float("-inf"))
            sc = sc + bias.to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
            p = tl.exp(sc - m_ref[:, None])
            alpha = tl.exp(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * sv_b + h * sv_h + rn[:, None] * sv_n + rd[None, :], mask=keys[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (s * tl.num_programs(1) + bh) * G + rg  # partials [spans, b * kv, G, ...]
        tl.store(acc_ptr + row[:, None] * D + rd[None, :], acc, mask=live[:, None])
        tl.store(stat_ptr + row * 2, m_i, mask=live)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=live)

    @triton.jit
    def _combine(acc_ptr, stat_ptr, o_ptr, G, S, so_b, so_h, so_g,
                 H: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, SP: tl.constexpr):
        pg, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rg = pg * BG + tl.arange(0, BG)
        rd = tl.arange(0, D)
        live = rg < G
        m = tl.full([BG], float("-inf"), tl.float32)
        for s in range(0, SP):  # SP: the spans rounded up to a power of two (few compilations)
            use = live & (tl.full([BG], s, tl.int32) < S)
            m = tl.maximum(m, tl.load(stat_ptr + ((s * tl.num_programs(1) + bh) * G + rg) * 2, mask=use,
                                      other=float("-inf")))
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        num = tl.zeros([BG, D], tl.float32)
        den = tl.zeros([BG], tl.float32)
        for s in range(0, SP):
            row = (s * tl.num_programs(1) + bh) * G + rg
            use = live & (tl.full([BG], s, tl.int32) < S)
            w = tl.exp(tl.load(stat_ptr + row * 2, mask=use, other=float("-inf")) - m_ref)
            den += w * tl.load(stat_ptr + row * 2 + 1, mask=use, other=0.0)
            num += w[:, None] * tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=use[:, None], other=0.0)
        out = num / den[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + rg[:, None] * so_g + rd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


@torch.library.custom_op("dflashkit::few_attention", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ scale + mask) v for the layout above -> [b, kv, G, d] in q's dtype. An opaque
    op to torch.compile (its shapes need no guard; the caller's compiled graph stays whole)."""
    q, k, v, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, mask))
    b, heads, G, D = q.shape
    N = k.shape[2]
    span = max(SPLIT, triton.next_power_of_2(triton.cdiv(N, MAX_SPANS)))
    spans = triton.cdiv(N, span)
    acc = torch.empty(spans, b * heads, G, D, device=q.device, dtype=torch.float32)
    stats = torch.empty(spans, b * heads, G, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(b, heads, G, D, device=q.device, dtype=q.dtype)
    bg = max(16, min(BLOCK_G, triton.next_power_of_2(G)))
    tiles = triton.cdiv(G, bg)
    _spans[(tiles, b * heads, spans)](
        q, k, v, mask, acc, stats, G, N, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        H=heads, D=D, BG=bg, BN=BLOCK_N, SPAN=span)
    _combine[(tiles, b * heads)](acc, stats, out, G, spans, out.stride(0), out.stride(1), out.stride(2),
                                 H=heads, D=D, BG=bg, SP=triton.next_power_of_2(spans))
    return out


@attend.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape)
