"""Gated DeltaNet (the linear attention of Qwen3.5 / Qwen3.6 / Qwen3-Next) over a draft tree.

Per row and head, the layer keeps a recurrent state S [dk, dv] and its causal conv keeps the last
K-1 inputs. Token t updates and reads the state as

    S_t = e^{g_t} S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t.

Unrolled from the state S0 before a block of tokens, with G_t = the sum of g over t and its
ancestors ("i <= t" below: i is t or one of its ancestors):

    S_t = e^{G_t} S0 + sum_{i <= t} e^{G_t - G_i} k_i d_i^T
    (I + diag(beta) (K K^T * Gamma_strict)) D = diag(beta) (V - e^G * K S0)
    O   = e^G * Q S0 + (Q K^T * Gamma) D,        Gamma[t, i] = e^{G_t - G_i} if i <= t else 0

A token depends on its ancestors only, so this holds for a tree exactly as for a chain (the chain
is the tree whose ancestors are the earlier tokens): a whole draft tree is one block of matmuls
and one unit-triangular solve (ancestors come first in node order), whatever its depth, and no
per-node state is ever stored. After verification the state of the accepted leaf l alone is
computed from the block's (k, d, G): `fold` — the first line with t = l. The conv window of a
node is its ancestors' inputs (`conv_sources`), so the same holds for the conv state.

Everything here is plain PyTorch (fp32 for the state), the path CPU tests check against
Transformers' own layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

SUBCHUNK = 64  # long chains (prompts) are folded in blocks of this many tokens: the solve is cubic in block size


class Block(NamedTuple):
    """What verification leaves for `fold`, for every linear layer ([L, ...] stacked)."""

    seq: Tensor  # conv inputs: each row's K-1 committed inputs, then the block's [L, b, K-1+q, C]
    k: Tensor  # normalised keys, repeated to the value heads [L, b, h, q, dk] (fp32)
    d: Tensor  # the delta-rule updates [L, b, h, q, dv] (fp32)
    G: Tensor  # cumulated log decays along each node's path [L, b, h, q] (fp32)
    incl: Tensor  # incl[b, t, i]: node i is t or an ancestor of t [b, q, q]
    src: Tensor  # conv sources of each node, indices into seq's time axis [b, q, K]


def conv_sources(depths: Tensor, incl: Tensor, kernel: int) -> Tensor:
    """depths [b, q] (block-relative, the root at 0), incl [b, q, q] -> [b, q, K]: for node j and
    tap k, where in [committed window (K-1); block inputs (q)] the input at depth d_j - (K-1) + k
    along j's path lies (an ancestor of j, j itself at k = K-1, or the committed window)."""
    want = depths[:, :, None] - (kernel - 1) + torch.arange(kernel, device=depths.device)  # [b, q, K]
    match = incl[:, :, None, :] & (depths[:, None, None, :] == want[..., None])  # [b, q, K, q]
    node = match.to(torch.uint8).argmax(-1)
    return torch.where(want >= 0, node, want) + (kernel - 1)


def causal_conv(seq: Tensor, src: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """seq [b, K-1+q, C], src [b, q, K], weight [C, K] -> silu(conv) [b, q, C] in seq's dtype."""
    b, q, K = src.shape
    win = seq.gather(1, src.reshape(b, q * K, 1).expand(-1, -1, seq.shape[2])).view(b, q, K, -1)
    y = torch.einsum("bqkc,ck->bqc", win.float(), weight.float())
    if bias is not None:
        y = y + bias.float()
    return F.silu(y).to(seq.dtype)


def block(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, incl: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One block of the gated delta rule over a tree (all fp32). q, k [b, h, t, dk] (normalised, q
    scaled), v [b, h, t, dv], g, beta [b, h, t], S0 [b, h, dk, dv], incl bool [b, t, t]
    -> outputs O [b, h, t, dv], updates D [b, h, t, dv], path decays G [b, h, t]."""
    t = q.shape[2]
    A = incl[:, None].to(g.dtype)  # [b, 1, t, t]
    G = (A @ g[..., None]).squeeze(-1)
    gamma = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~incl[:, None], float("-inf")))
    strict = gamma * (1 - torch.eye(t, dtype=g.dtype, device=g.device))
    eG = G.exp()[..., None]
    system = torch.eye(t, dtype=g.dtype, device=g.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    D = torch.linalg.solve_triangular(system, beta[..., None] * (v - eG * (k @ S0)), upper=False, unitriangular=True)
    O = eG * (q @ S0) + ((q @ k.transpose(-1, -2)) * gamma) @ D
    return O, D, G


def fold(S0: Tensor, k: Tensor, d: Tensor, G: Tensor, incl_leaf: Tensor, leaf: Tensor,
         inplace: bool = False) -> Tensor:
    """The state after node `leaf` of a block: S0 [..., h, dk, dv], k [..., h, q, dk], d
    [..., h, q, dv], G [..., h, q], incl_leaf bool [..., 1, q] (the leaf's path), leaf long
    [..., 1, 1] -> [..., h, dk, dv]. inplace: written into S0 (contiguous: decayed in place, the
    update added by one batched matmul, no temporary of the state's size)."""
    Gl = G.gather(-1, leaf.expand(*G.shape[:-1], 1))  # [..., h, 1]
    w = torch.exp((Gl - G).masked_fill(~incl_leaf, float("-inf")))  # [..., h, q]
    decay, kT, wd = Gl.exp()[..., None], k.transpose(-1, -2), w[..., None] * d
    if inplace and S0.is_contiguous():
        dk, dv = S0.shape[-2:]
        S0.mul_(decay).view(-1, dk, dv).baddbmm_(kT.reshape(-1, dk, kT.shape[-1]), wd.reshape(-1, wd.shape[-2], dv))
        return S0
    out = decay * S0 + kT @ wd
    return S0.copy_(out) if inplace else out


def prepare(mixed: Tensor, a: Tensor, b_: Tensor, A_log: Tensor, dt_bias: Tensor, key_heads: int,
            value_heads: int, dk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The conv's output [b, t, 2 Hk dk + Hv dv] and the a/b projections [b, t, Hv] -> q, k
    [b, Hv, t, dk] (l2-normalised in fp32, q scaled by dk^-0.5, key heads repeated to the value
    heads), v [b, Hv, t, dv], g, beta [b, Hv, t] (fp32), as Transformers' Qwen3.5 layer computes them."""
    b, t, _ = mixed.shape
    kd = key_heads * dk
    q, k, v = mixed[..., :kd], mixed[..., kd:2 * kd], mixed[..., 2 * kd:]

    def heads(x: Tensor, n: int) -> Tensor:
        return x.reshape(b, t, n, -1).float().transpose(1, 2)

    q, k = _l2(heads(q, key_heads)) * dk ** -0.5, _l2(heads(k, key_heads))
    if value_heads > key_heads:  # each key head serves value_heads // key_heads consecutive value heads
        q, k = (x.repeat_interleave(value_heads // key_heads, dim=1) for x in (q, k))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, heads(v, value_heads), g.transpose(1, 2), b_.sigmoid().float().transpose(1, 2)


def _l2(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
