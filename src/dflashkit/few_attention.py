"""Attention of a few queries over a KV cache, fused, for decoding passes on CUDA.

A decoding pass attends 1-65 queries per row (an AR step, a DFlash block, a DDTree-64 tree) over
a cache of a few hundred to tens of thousands of slots, under an additive mask (the tree's
visibility). `drafter.attend_few` writes it out as q kᵀ, a softmax and p v: three kernels, about
9 µs per layer of a Qwen3-8B target on an H200 at 768 slots, but 62 µs at 16,384, where the
scores it writes out ([kv, g*t, n] in fp32) cost more than the keys. Here (FlashDecoding's
scheme) one Triton kernel gives each (query tile, row, KV head, span of keys) a program that
computes its scores, an online softmax and its share of p v in fp32; a second kernel weighs the
spans' partial sums by their maxima and normalisers: 39 µs at 16,384 slots. Keys are split into
spans only until the GPU has `FILL` programs: from there on (a large batch of rows), and over
short caches (`DIRECT_KEYS`), the first kernel writes the output itself, one span each (no
partial sums, no second launch). Scores are taken in fp32 from the bf16 products (the
written-out path rounds q kᵀ to bf16 first).

Layout as `attend_few`'s: q [b, kv, G, d] (the G = g * t query heads of a KV group folded into
the query axis, head-major), k / v [b, kv, n, d] (last dimension contiguous), mask additive [b, 1,
G, n]. The output is either in q's layout or, given the pass's `tokens` t, [b, t, kv * g * d]: each
token's heads in order, what the output projection reads (no permute kernel after it).
`use` says whether a pass attends here (docs/benchmarks.md has the measurements)."""

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
FILL = 256  # programs wanted: spans are added until the (row, KV head) pairs times spans reach it
DIRECT_KEYS = 512  # up to this many slots one span per program (8 inner steps): no combine launch
BLOCK_N = 64  # keys per inner step
BLOCK_G = 64  # folded queries per program (an AR step's few too: see `attend`)
NUM_WARPS = 4  # the spans kernel's launch (`benchmarks/bench_attention.py --sweep` times others)
NUM_STAGES: int | None = None  # None: Triton's default software pipelining


# Keys from which the fused kernel replaces the written-out attention in a one-row pass (None:
# never, not even for several rows): on an H200, 23.8 against 26.5 us over 6,144 slots; at 4,096
# the written-out one is still 8 % faster.
FROM_KEYS: int | None = 6144
# Passes of several rows attend here at any length (False: through SDPA, cuDNN inside CUDA graphs).
ROWS = True


def use(rows: int, keys: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a pass of few queries per row attends through `attend`: on CUDA with Triton, head
    dim 64 or 128, bf16 or fp16; a pass of several rows at any length (cuDNN's kernel and its
    memset cost 12.6 against 11.3 us at SmolLM2's heads, 32 rows of 16 queries over 512 slots),
    one row from `FROM_KEYS` slots. The rule does not look at the queries: an AR step and a
    verification attend through the same kernel, whose arithmetic per query is the same for any
    query count (bf16 greedy outputs then part from AR's only where the GEMMs round apart)."""
    if FROM_KEYS is None or triton is None or device.type != "cuda" or head_dim not in (64, 128) \
            or dtype not in (torch.bfloat16, torch.float16):
        return False
    return (rows > 1 and ROWS) or keys >= FROM_KEYS


if triton is not None:

    @triton.jit
    def _out(o_ptr, b, h, rg, rd, T, so_b, so_h, so_j, so_t):
        # folded query r = j * T + token (j: the query head within the KV group) -> its output row
        return o_ptr + b * so_b + h * so_h + (rg // T)[:, None] * so_j + (rg % T)[:, None] * so_t + rd[None, :]

    @triton.jit
    def _spans(q_ptr, k_ptr, v_ptr, m_ptr, acc_ptr, stat_ptr, o_ptr, G, N, T, scale,
               sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_g, sm_n, so_b, so_h, so_j, so_t,
               H: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, SPAN: tl.constexpr,
               DIRECT: tl.constexpr):
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
        if DIRECT:  # one span: this program saw every key
            out = acc / l_i[:, None]
            tl.store(_out(o_ptr, b, h, rg, rd, T, so_b, so_h, so_j, so_t), out.to(o_ptr.dtype.element_ty),
                     mask=live[:, None])
        else:
            row = (s * tl.num_programs(1) + bh) * G + rg  # partials [spans, b * kv, G, ...]
            tl.store(acc_ptr + row[:, None] * D + rd[None, :], acc, mask=live[:, None])
            tl.store(stat_ptr + row * 2, m_i, mask=live)
            tl.store(stat_ptr + row * 2 + 1, l_i, mask=live)

    @triton.jit
    def _combine(acc_ptr, stat_ptr, o_ptr, G, S, T, so_b, so_h, so_j, so_t,
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
        tl.store(_out(o_ptr, b, h, rg, rd, T, so_b, so_h, so_j, so_t), out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


def _shape(q: Tensor, tokens: int) -> list[int]:
    b, heads, G, D = q.shape
    return [b, heads, G, D] if tokens == 0 else [b, tokens, heads * G * D // tokens]


@torch.library.custom_op("dflashkit::few_attention", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, tokens: int = 0) -> Tensor:
    """softmax(q kᵀ scale + mask) v for the layout above -> [b, kv, G, d], or [b, tokens, kv * G *
    d / tokens] given the tokens per row, in q's dtype. An opaque op to torch.compile (its shapes
    need no guard; the caller's compiled graph stays whole)."""
    q, k, v, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, mask))
    b, heads, G, D = q.shape
    N = k.shape[2]
    # Query tiles of BLOCK_G and spans that do not depend on the query count: a query's arithmetic
    # (its tl.dot shapes, its spans of keys) is the same in an AR step as in a verification.
    tiles = triton.cdiv(G, BLOCK_G)
    wanted = 1 if N <= DIRECT_KEYS else min(MAX_SPANS, triton.cdiv(N, SPLIT), triton.cdiv(FILL, b * heads))
    span = max(SPLIT, triton.next_power_of_2(triton.cdiv(N, wanted)))
    spans = triton.cdiv(N, span)
    out = q.new_empty(_shape(q, tokens))
    T = tokens or G  # folded rows j * T + t: with tokens 0, j is 0 and t the row of q's layout
    if tokens == 0:
        so = (out.stride(0), out.stride(1), 0, out.stride(2))
    else:  # [b, t, (KV head, its query heads), d]
        so = (out.stride(0), (G // tokens) * D, D, out.stride(1))
    acc = stats = out  # (unused by a single span)
    if spans > 1:
        acc = torch.empty(spans, b * heads, G, D, device=q.device, dtype=torch.float32)
        stats = torch.empty(spans, b * heads, G, 2, device=q.device, dtype=torch.float32)
    _spans[(tiles, b * heads, spans)](
        q, k, v, mask, acc, stats, out, G, N, T, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(2), mask.stride(3), *so,
        H=heads, D=D, BG=BLOCK_G, BN=BLOCK_N, SPAN=span, DIRECT=spans == 1, num_warps=NUM_WARPS,
        **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}))
    if spans > 1:
        _combine[(tiles, b * heads)](acc, stats, out, G, spans, T, *so,
                                     H=heads, D=D, BG=BLOCK_G, SP=triton.next_power_of_2(spans))
    return out


@attend.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, tokens: int = 0) -> Tensor:
    return q.new_empty(_shape(q, tokens))
