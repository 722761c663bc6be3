"""A layer's query, key and value heads made from its fused q/k/v projection in one Triton kernel.

After the q/k/v GEMM, a decoding pass of the static runner normalises the query and key heads
(Qwen3's q_norm / k_norm), rotates them (RoPE), lays the queries out for the attention and writes
keys and values into the cache. Compiled by Inductor that is four kernels per layer on an H200
(the query and key heads and the value store have different sizes, so they do not fuse), each
costing a launch and its latency for little work. Here one program per (`BLOCK_T` tokens, head)
does its head's part, so a layer launches one kernel: on a Qwen3-8B-shaped target that saves 113
launches and 0.17 ms of a 6.7 ms DFlash round on an H200 (`bench_decode.py --unfused-heads`).

`available` says where it runs: CUDA, Triton importable, q/k/v fused into one weight, heads of 64
or 128 dims with RoPE on all of them, no gated attention (Qwen3.5 keeps `static.qkv`). Numerics
follow `static.rms_norm` and `drafter.apply_rope` in fp32, rounded to the model's dtype after the
norm and at the end (Inductor's fusion rounds the same way)."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `static.qkv` does it in PyTorch
    triton = None

ENABLED = True  # False: `static.qkv` everywhere (the benchmarks' `--unfused-heads` baseline)
# Tokens per program: a program per (token, head) left 7,680 tiny programs in a SmolLM2-shaped
# pass of 32 rows x 16 tokens (9 us a layer). Fixed, so that a token's arithmetic is the same in
# an AR step as in a verification block.
BLOCK_T = 8


def available(y: Tensor, head_dim: int, rotary: int, gated: bool, fused: bool) -> bool:
    return (ENABLED and triton is not None and y.is_cuda and fused and not gated and rotary == head_dim
            and head_dim in (64, 128) and y.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:

    @triton.jit
    def _heads(y_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, N, T, eps,
               sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
               H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
               OFFSET: tl.constexpr, BT: tl.constexpr):
        # rows = b * T + t, BT of them; head j of [q heads; k heads; v heads] (H = 0: no q heads);
        # G = H // KV query heads per kv head (1 without queries)
        row = tl.program_id(0) * BT + tl.arange(0, BT)
        j = tl.program_id(1)
        live = row < N
        b, t = row // T, row % T
        half = tl.arange(0, D // 2)[None, :]
        at = live[:, None]
        src = y_ptr + row[:, None] * (H + 2 * KV) * D + j * D + half
        x1 = tl.load(src, mask=at, other=0.0).to(tl.float32)  # [BT, D/2]
        x2 = tl.load(src + D // 2, mask=at, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + row, mask=live, other=0)[:, None]
        if j >= H + KV:  # a value head: stored as it is
            dst = v_ptr + b[:, None] * sv_b + (j - H - KV) * sv_h + slot * sv_n + half
            tl.store(dst, x1.to(v_ptr.dtype.element_ty), mask=at)
            tl.store(dst + D // 2, x2.to(v_ptr.dtype.element_ty), mask=at)
        else:
            if NORM:
                if j < H:
                    w1 = tl.load(qn_ptr + half).to(tl.float32)
                    w2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
                else:
                    w1 = tl.load(kn_ptr + half).to(tl.float32)
                    w2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
                r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
                r = r[:, None]
                if OFFSET:  # (1 + w) in fp32, then rounded
                    x1 = x1 * r * (1.0 + w1)
                    x2 = x2 * r * (1.0 + w2)
                else:  # rounded to the dtype, then times w (Transformers' Llama/Qwen3 order)
                    x1 = (x1 * r).to(y_ptr.dtype.element_ty).to(tl.float32) * w1
                    x2 = (x2 * r).to(y_ptr.dtype.element_ty).to(tl.float32) * w2
                x1 = x1.to(y_ptr.dtype.element_ty).to(tl.float32)
                x2 = x2.to(y_ptr.dtype.element_ty).to(tl.float32)
            rope = row[:, None] * D + half
            c1 = tl.load(cos_ptr + rope, mask=at, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + rope + D // 2, mask=at, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + rope, mask=at, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + rope + D // 2, mask=at, other=0.0).to(tl.float32)
            o1 = x1 * c1 - x2 * s1  # x cos + rotate_half(x) sin
            o2 = x2 * c2 + x1 * s2
            if j < H:  # query head j = kv head j // G, folded at (j % G) * T + t (`static.qkv`'s layout)
                dst = q_ptr + ((b[:, None] * KV + j // G) * G * T + (j % G) * T + t[:, None]) * D + half
                tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=at)
                tl.store(dst + D // 2, o2.to(q_ptr.dtype.element_ty), mask=at)
            else:
                dst = k_ptr + b[:, None] * sk_b + (j - H) * sk_h + slot * sk_n + half
                tl.store(dst, o1.to(k_ptr.dtype.element_ty), mask=at)
                tl.store(dst + D // 2, o2.to(k_ptr.dtype.element_ty), mask=at)


def heads(y: Tensor, qn: Tensor | None, kn: Tensor | None, offset: bool, eps: float, cos: Tensor, sin: Tensor,
          k: Tensor, v: Tensor, slots: Tensor, num_heads: int, kv_heads: int) -> Tensor | None:
    """y [b, t, (H + 2 KV) d] (the fused projection's output), cos/sin [b, (1,) t, d], the layer's cache
    k/v [b, KV, capacity, d], slots [b, t] -> q [b, KV, g t, d] (`static.qkv`'s layout); keys
    (normalised, rotated) and values written into k/v at the slots. num_heads 0: y holds keys and
    values alone [b, t, 2 KV d] (a drafter's new context and block, `drafter.Attention.store`),
    and no queries are made (None)."""
    b, t, _ = y.shape
    d = k.shape[-1]
    y, cos, sin, slots = (x.contiguous() for x in (y, cos, sin, slots))
    g = num_heads // kv_heads
    q = y.new_empty(b, kv_heads, g * t, d) if num_heads else None
    norm = kn is not None
    _heads[(triton.cdiv(b * t, BLOCK_T), num_heads + 2 * kv_heads)](
        y, qn if qn is not None else y, kn if norm else y, cos, sin, y if q is None else q, k, v, slots, b * t, t, eps,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        H=num_heads, KV=kv_heads, G=max(g, 1), D=d, NORM=norm, OFFSET=offset, BT=BLOCK_T)
    return q
