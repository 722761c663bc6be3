"""oneDNN's packed weights: how the CPU engine multiplies. MKL's GEMM with 2-16 rows (a
verification pass, a drafter's block) costs up to 2-3x its one-row time; oneDNN's linear over a
weight reordered once into its blocked layout costs 1.1-1.3x (SmolLM2 on 2 cores). Used for the target's layers and LM head and the drafter's projections."""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACK_ROWS = 16  # the row count oneDNN's packed layout is chosen for (it serves any count)
_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {weight: (version, packed copy)}
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LM head -> {(dtype, packed, version): (w, b)}


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """F.linear, or oneDNN's linear for a weight packed by `pack` (CPU)."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def packable(target: Any) -> bool:
    """Whether packed weights serve this target: fp32 on a CPU with oneDNN."""
    return (target.device.type == "cpu" and target.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU: fp32 always, bf16 only with AVX-512
    (or AVX-NE-CONVERT); an AVX2-only CPU refuses it."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: Tensor) -> Tensor:
    """A copy of the weight [out, in] in oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)


def pack_weight(w: Tensor | None, owner: nn.Module) -> Tensor | None:
    """`pack(w)`, made once per `owner`, the module that holds the weight, so that every engine
    over a target shares it (an evaluation builds several) and it lives no longer than the
    module (kept beside it, not in it: a module holding packed tensors could not be deep-copied).
    Made again if the weight was replaced or changed in place (its version counter)."""
    if w is None:
        return None
    packs = _PACKS.setdefault(owner, {})
    ident = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    version = tuple(p._version for p in owner.parameters())  # a fused buffer has a counter of its own
    if packs.get(ident, (None,))[0] != version:
        for stale in [k for k, (v, _) in packs.items() if v != version]:
            del packs[stale]
        packs[ident] = (version, pack(w))
    return packs[ident][1]


class PackedLinear(nn.Linear):
    """An `nn.Linear` that computes through its packed weight (`pack_weight`): a drafter's
    projections on a CPU, where a block's 16 rows read the weights 1.3-2x faster than through
    `F.linear` (bf16 and fp32, 2 cores). Same parameters, same state dict."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, pack_weight(self.weight, self), self.bias)


def fused_linear(x: Tensor, w: Tensor, like: nn.Module) -> Tensor:
    """`linear` through w, a weight that fuses several modules' (`static.fuse_drafter`), one of
    them `like`: through w's packed copy where `like` computes through packed weights."""
    return linear(x, pack_weight(w, like) if isinstance(like, PackedLinear) else w)


def drafter_copy(drafter: nn.Module, dtype: torch.dtype | None, packed: bool) -> nn.Module:
    """A copy of `drafter` for an engine, in `dtype` (None: its own), its projections
    `PackedLinear`s if `packed` (the caller's drafter stays as it is: packed weights have no
    backward)."""
    out = copy.deepcopy(drafter).to(dtype) if dtype is not None else copy.deepcopy(drafter)
    for m in out.modules():
        if packed and type(m) is nn.Linear:
            m.__class__ = PackedLinear
    return out


def lm_head(target: Any, dtype: torch.dtype, packed: bool = False) -> Callable[[Tensor], Tensor]:
    """The target's LM head computed in `dtype` (its weight copied there if the target's differs;
    packed: through a packed weight), logits returned in the target's dtype."""
    head = target.model.get_output_embeddings()
    if dtype == target.dtype:
        w, b = (pack_weight(head.weight, head) if packed else head.weight), head.bias
    else:  # one copy per head, dtype and layout, whatever the number of engines (an evaluation builds several)
        copies = _COPIES.setdefault(head, {})
        key = (dtype, packed, tuple(p._version for p in head.parameters()))
        if key not in copies:
            for stale in [k for k in copies if k[2] != key[2]]:  # the head changed: its old copies go
                del copies[stale]
            w = head.weight.detach().to(dtype)
            copies[key] = ((pack(w) if packed else w), None if head.bias is None else head.bias.detach().to(dtype))
        w, b = copies[key]
    return lambda hidden: target.lm_head(hidden, lambda x: linear(x.to(dtype), w, b).to(target.dtype))
