"""The static runner: the target's layers as plain functions over our cache, CUDA graphs on GPU.

Batch decoding on a GPU is launch-bound when every op is launched from Python: a round of an 8B
target and its drafter is a few thousand small kernels. Here the target's layers run as plain
functions over their own weights (read from the Transformers modules, never copied) and the
engine's `KVCache`, whose buffers are allocated once, so that every step has fixed shapes and
fixed addresses and is captured once per shape into a CUDA graph (gpt-fast style). The step
attends over the first n slots of the cache, n rounded up to a multiple of `SLOT_BUCKET`: a round
costs what the sequences hold, not the cache's capacity, with few distinct graphs.

The mask is `tree.visibility`, the drafter is the `drafter.py` module (its step captured too):
only the target's layers are run differently from `engine.HFRunner`, and tests check both equal
the target's own generation. Optional torch.compile fuses each layer's elementwise work, on
CUDA the query/key/value heads come from one Triton kernel (`kernels/heads.py`), and q/k/v and
gate/up weights can be fused row-wise. Supported targets: Llama / Qwen2 / Qwen3-style
decoders (full attention, or sliding windows named per layer), Gemma 3 (its norms of (1 + w), the
norms after attention and MLP, GELU, one RoPE per layer type, query scaling by
`query_pre_attn_scalar`) and the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids (Gated DeltaNet layers
through `decode/delta.py`; attention with an output gate, partial rotary, norms of (1 + w)).
Qwen3-Next's fused linear-layer projections are mapped once onto Qwen3.5's layout (`_split_qkvz`).
"""

from __future__ import annotations

import copy
import gc
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit import few_attention
from dflashkit.decode import delta
from dflashkit.decode.accept import Steps
from dflashkit.decode.cache import KVCache, LayerKV
from dflashkit.decode.engine import Engine, Parts, attention_backends, small
from dflashkit.decode.tree import visibility
from dflashkit.drafter import FEW_QUERIES, DFlashDrafter, additive, apply_rope, attend_few
from dflashkit.kernels import heads
from dflashkit.kernels.packed import drafter_copy, linear, lm_head, pack_weight, packable, packs
from dflashkit.target import Target

MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
GEMMA = ("gemma3_text",)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # linear-attention layers beside full attention
MROPE = ("qwen3_5_text", "qwen3_5_moe_text")  # rotary takes positions per multimodal axis (Qwen3-Next: plain partial)
ZERO_CENTRED = ("Qwen3_5", "Qwen3Next")  # norm classes of (1 + w) in fp32, gated attention (class name prefixes)
SLOT_BUCKET = 256  # attention spans are rounded up to this many slots (one graph per bucket)
GRAPH_MAX_TOKENS = 256  # round steps of more tokens per row run eagerly
# A prefill, or a prompt's first draft, of at most this many rows x tokens runs from a CUDA graph,
# its length padded to a multiple of `engine.LENGTH_BUCKET` (few shapes); larger ones run eagerly,
# so that no graph keeps the memory of a long pass. Eagerly, a 150-200-token SmolLM2 prefill is
# ~1,200 launches (34 ms on an H200's host), from its graph 2.6 ms.
SMALL_PASS_TOKENS = 512
# A join's prefill (`Engine.join`: a few requests joining a running batch) of at most this many
# rows x tokens runs on a staging engine from CUDA graphs: eagerly it is ~1,200 launches for a
# SmolLM2-sized target, which every running row waits for. Larger than the first prefill's, as joins
# come in groups (a quarter of the rows, by default); a join is prefilled in groups of a power of
# two rows, their lengths padded to powers of two, so that `Engine.warm_joins` captures every shape
# before serving.
JOIN_PASS_TOKENS = 4096


def sparse_mlp(layer: Any) -> bool:
    """A mixture-of-experts MLP (Qwen3.5-MoE, Qwen3-Next: routed experts + a gated shared expert;
    Qwen3-Next's `mlp_only_layers` / `decoder_sparse_step` may leave some layers dense). It runs as
    Transformers' own module: its routing has data-dependent shapes, so no CUDA graph captures it."""
    return not hasattr(layer.mlp, "gate_proj")


def supported(target: Target) -> str | None:
    """None when the static engine can run `target`, else the reason why not."""
    cfg = target.config
    if cfg.model_type not in MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {MODEL_TYPES}"
    kinds = set(target.layer_kinds)
    allowed = {"full_attention", "sliding_attention"} | ({"linear_attention"} if cfg.model_type in HYBRID else set())
    if kinds - allowed:
        return f"layer types {sorted(kinds)} (only {sorted(allowed)})"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} (only {sorted(ACTIVATIONS)})"
    return None


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LinearMix(NamedTuple):
    """A Gated DeltaNet token mixer's tensors (Qwen3.5): input projections (fused row-wise into
    `proj` = [qkv; z; b; a] when fusing), the depthwise causal conv [C, K], decay and gate norm."""

    qkv: Tensor
    z: Tensor
    b: Tensor
    a: Tensor
    proj: Tensor | None
    conv: Tensor
    conv_b: Tensor | None
    dt_bias: Tensor
    A_log: Tensor
    norm: Tensor


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (biases may be None). A plain tuple of tensors, so that one
    compiled function serves every layer. A linear-attention layer has `mix` and no q/k/v; `o` is
    its output projection."""

    ln1: Tensor
    q: Tensor | None
    qb: Tensor | None
    k: Tensor | None
    kb: Tensor | None
    v: Tensor | None
    vb: Tensor | None
    qn: Tensor | None
    kn: Tensor | None
    o: Tensor
    ob: Tensor | None
    ln2: Tensor
    gate: Tensor | None  # None: a mixture-of-experts MLP (`sparse_mlp`), run by its module
    gb: Tensor | None
    up: Tensor | None
    ub: Tensor | None
    down: Tensor | None
    db: Tensor | None
    qkv: Tensor | None = None  # fused [q; k; v] rows (static_engine(fuse=True)): one GEMM instead of three
    gate_up: Tensor | None = None  # fused [gate; up] rows: one GEMM instead of two
    post_attn: Tensor | None = None  # Gemma: a norm on the attention output, one on the MLP output
    post_mlp: Tensor | None = None
    offset: bool = False  # norms of (1 + w) computed in fp32 (Gemma, Qwen3.5)
    gelu: bool = False  # GELU (tanh) in the MLP instead of SiLU (Gemma)
    gated: bool = False  # q_proj rows hold [query; gate] per head; the attention output is gated (Qwen3.5)
    mix: LinearMix | None = None


def _weights(layer: Any, fuse: bool = False, columns: bool = False) -> LayerWeights:
    """Detached views of the module's parameters (same storage; no autograd state to guard on).
    fuse: also q/k/v and gate/up as one row-concatenated weight each (see `_fuse`); columns: o, gate/up and down stored [in, out]."""
    if hasattr(layer, "linear_attn"):
        return _linear_weights(layer, fuse, columns)
    a, (gp, up, dp) = layer.self_attn, _mlp_projections(layer)
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # Gemma's post_attention_layernorm is not the pre-MLP norm
    ln2 = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    mods = [layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, qn, kn, a.o_proj, ln2, gp, up, dp]
    b = [None if mod is None or getattr(mod, "bias", None) is None else mod.bias.detach() for mod in mods]
    fuse = fuse and all(x is None for x in b[1:4] + b[8:10])  # biased projections stay separate
    qkv_w = _fuse([a.q_proj, a.k_proj, a.v_proj]) if fuse else None
    gate_up = _out_mlp_layout(a.o_proj, gp, up, dp, fuse, columns)
    w = [None if mod is None else mod.weight.detach() for mod in mods]
    extra: dict[str, Any] = dict(post_attn=layer.post_attention_layernorm.weight.detach(),
                                 post_mlp=layer.post_feedforward_layernorm.weight.detach(), offset=True,
                                 gelu=True) if gemma else {}
    if type(layer.input_layernorm).__name__.startswith(ZERO_CENTRED):
        extra = dict(offset=True, gated=True)
    return LayerWeights(w[0], w[1], b[1], w[2], b[2], w[3], b[3], w[4], w[5], w[6], b[6], w[7], w[8], b[8], w[9], b[9],
                        w[10], b[10], qkv=qkv_w, gate_up=gate_up, **extra)


def _pack_layer(w: LayerWeights, layer: nn.Module) -> LayerWeights:
    """The projections a layer's step multiplies by, packed (`pack_weight`, kept on `layer`); a
    linear-attention mixer's stay."""
    def pack(t: Tensor | None) -> Tensor | None:
        return pack_weight(t, layer)

    q, k, v = (w.q, w.k, w.v) if w.qkv is not None else (pack(w.q), pack(w.k), pack(w.v))
    gate, up = (w.gate, w.up) if w.gate_up is not None else (pack(w.gate), pack(w.up))
    return w._replace(q=q, k=k, v=v, qkv=pack(w.qkv), o=pack(w.o), gate=gate, up=up, gate_up=pack(w.gate_up),
                      down=pack(w.down))


def _linear_weights(layer: Any, fuse: bool, columns: bool) -> LayerWeights:
    la, (gp, up, dp) = layer.linear_attn, _mlp_projections(layer)
    if hasattr(la, "in_proj_qkvz"):  # Qwen3-Next
        proj = _split_qkvz(la)
        rows = [la.key_dim * 2 + la.value_dim, la.value_dim, la.num_v_heads, la.num_v_heads]
        qkv_w, z, b, a = proj.split(rows)
        proj = proj if fuse else None
    else:
        mods = [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a]
        qkv_w, z, b, a = (mod.weight.detach() for mod in mods)
        proj = _fuse(mods) if fuse else None
    mix = LinearMix(qkv_w, z, b, a, proj, la.conv1d.weight.detach()[:, 0],
                    None if la.conv1d.bias is None else la.conv1d.bias.detach(),
                    la.dt_bias.detach(), la.A_log.detach(), la.norm.weight.detach())
    gate_up = _out_mlp_layout(la.out_proj, gp, up, dp, fuse, columns)
    gate, up_w, down = (None if mod is None else mod.weight.detach() for mod in (gp, up, dp))
    return LayerWeights(layer.input_layernorm.weight.detach(), None, None, None, None, None, None, None, None,
                        la.out_proj.weight.detach(), None, layer.post_attention_layernorm.weight.detach(),
                        gate, None, up_w, None, down, None, gate_up=gate_up, offset=True, mix=mix)


@torch.no_grad()
def _split_qkvz(la: nn.Module) -> Tensor:
    """Qwen3-Next's fused projections in Qwen3.5's layout, one [qkv; z; b; a] tensor. in_proj_qkvz's
    rows are grouped per key head, [q (dk); k (dk); v (r dv); z (r dv)], and in_proj_ba's as
    [b (r); a (r)], r = value heads per key head (Transformers' `fix_query_key_value_ordering`);
    value head j of key head g is head g r + j, as in Qwen3.5. A row permutation is no view: this is
    a copy, made once per module and kept on it (the conv's channels are already [q; k; v])."""
    wz, wba = la.in_proj_qkvz.weight, la.in_proj_ba.weight
    key = (wz.data_ptr(), wz._version, wba.data_ptr(), wba._version)
    cached = la.__dict__.get("_dflashkit_split")
    if cached is not None and cached[0] == key:
        return cached[1]
    nk, dk, dv, r = la.num_k_heads, la.head_k_dim, la.head_v_dim, la.num_v_heads // la.num_k_heads
    H = wz.shape[1]
    q, k, v, z = wz.detach().view(nk, -1, H).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = wba.detach().view(nk, 2 * r, H).split([r, r], dim=1)
    proj = torch.cat([x.reshape(-1, H) for x in (q, k, v, z, b, a)])
    la.__dict__["_dflashkit_split"] = (key, proj)  # not a parameter or buffer: no state_dict entry
    return proj


def _out_mlp_layout(out: nn.Module, gate: nn.Module | None, up: nn.Module | None, down: nn.Module | None,
                    fuse: bool, columns: bool) -> Tensor | None:
    """Lays out a layer's output projection and gated MLP (`_fuse`); returns the fused [gate; up]
    weight if `fuse` (None for a mixture of experts: its module runs it)."""
    if columns:
        _fuse([out], columns=True)
    if gate is None:
        return None
    if columns:
        _fuse([down], columns=True)
    if fuse:
        return _fuse([gate, up], columns)
    if columns:
        _fuse([gate], columns=True)
        _fuse([up], columns=True)
    return None


def _mlp_projections(layer: Any) -> list[nn.Module | None]:
    """gate, up and down of a gated MLP; None for a mixture of experts (run by its module)."""
    return [None] * 3 if sparse_mlp(layer) else [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]


@torch.no_grad()
def _fuse(mods: list[nn.Module], columns: bool = False) -> Tensor:
    """The modules' weights as one [sum of outs, in] tensor: fewer, larger GEMMs, which read the
    weights closer to full bandwidth at the few rows of a decoding step. The modules' weights
    become views of it, so no second copy stays in memory (for an 8B target that copy would be
    9 GB); a second engine over the same modules finds them already in place and reuses the buffer.
    columns: stored transposed, [in, sum of outs], and returned as its transposed view (one module
    alone is re-laid out so): on an H200, cuBLAS reads the output, gate/up, down and LM-head
    weights of a Qwen3-8B pass so stored up to 7 % faster (the pass's GEMMs 3-4 % at 1-16 rows),
    and as fast or faster at 256, while q/k/v lose 12 % at 256 rows."""
    ws = [mod.weight for mod in mods]
    rows, cols = sum(w.shape[0] for w in ws), ws[0].shape[1]
    step = 1 if columns else cols  # storage elements from one output row to the next
    stride = (1, rows) if columns else (cols, 1)
    offsets = [ws[0].storage_offset() + step * sum(w.shape[0] for w in ws[:i]) for i in range(len(ws))]
    storage = ws[0].untyped_storage()
    if all(w.stride() == stride and w.untyped_storage().data_ptr() == storage.data_ptr() and w.storage_offset() == off
           for w, off in zip(ws, offsets)):
        return ws[0].detach().new_empty(0).set_(storage, offsets[0], (rows, cols), stride)
    buf = torch.cat([w.detach() for w in ws])  # [rows, cols]
    if columns:
        buf = buf.t().contiguous().t()
    start = 0
    for mod in mods:
        n = mod.weight.shape[0]
        mod.weight.data = buf[start:start + n]
        start += n
    return buf


def rms_norm(x: Tensor, w: Tensor, eps: float, offset: bool = False) -> Tensor:
    # The exact op order of Transformers' Llama/Qwen3 RMSNorm (and the drafter's), or, with
    # offset, Gemma's and Qwen3.5's (1 + w) in fp32.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (1.0 + w.float())).to(x.dtype)
    return w * x32.to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first cos.shape[-1] dims of each head (all of them unless partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def qkv(h: Tensor, w: LayerWeights, eps: float, cos: Tensor, sin: Tensor, num_heads: int, kv_heads: int,
        head_dim: int, kv: LayerKV, slots: Tensor) -> tuple[Tensor, Tensor | None]:
    """h [b, t, H] (the layer's input, normalised by the previous layer's `out_mlp`) -> q [b,
    kv_heads, g * t, d] (the g = num_heads / kv_heads query heads of each KV group folded into the
    query axis, for `attend`) and the output gate [b, t, num_heads * d] of a gated attention (else
    None); k and v (RoPE applied) are written into the layer's cache at slots [b, t] here, so that
    a compiled layer function makes and stores them in one kernel."""
    b, t, _ = h.shape
    q_rows = num_heads * head_dim * (2 if w.gated else 1)
    if w.qkv is not None:
        yq, yk, yv = linear(h, w.qkv).split([q_rows, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    else:
        yq, yk, yv = linear(h, w.q, w.qb), linear(h, w.k, w.kb), linear(h, w.v, w.vb)
    gate = None
    if w.gated:
        yq, gate = yq.reshape(b, t, num_heads, 2 * head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, num_heads * head_dim)

    def heads_first(y: Tensor, n: int, norm: Tensor | None) -> Tensor:
        y = y.reshape(b, t, n, head_dim)
        return (y if norm is None else rms_norm(y, norm, eps, w.offset)).transpose(1, 2)

    q = rope(heads_first(yq, num_heads, w.qn), cos, sin).reshape(b, kv_heads, (num_heads // kv_heads) * t, head_dim)
    kv.write(rope(heads_first(yk, kv_heads, w.kn), cos, sin), heads_first(yv, kv_heads, None), slots)
    return q, gate


def qkv_fused(h: Tensor, w: LayerWeights, eps: float, cos: Tensor, sin: Tensor, num_heads: int, kv_heads: int,
              head_dim: int, kv: LayerKV, slots: Tensor) -> tuple[Tensor, None]:
    """`qkv` with the heads' norms, RoPE, layout and cache stores in one kernel (`kernels/heads.py`)."""
    y = linear(h, w.qkv)
    return heads.heads(y, w.qn, w.kn, w.offset, eps, cos, sin, kv.k, kv.v, slots, num_heads, kv_heads), None


def out_proj(x: Tensor, o: Tensor, w: LayerWeights, eps: float, gate: Tensor | None = None) -> Tensor:
    """The token mixer's output projection + residual (Gemma: normalised before it joins). o: the
    mixer's output [b, t, h * d], or `attend`'s [b, kv_heads, g * t, d], whose heads are put back
    in order here (inside the compiled function: no copy kernel of its own); gate: a gated
    attention's output gate [b, t, h * d]."""
    if o.ndim == 4:
        b, kv, gt, d = o.shape
        t = x.shape[1]
        o = o.reshape(b, kv, gt // t, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, kv * (gt // t) * d)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    a = linear(o, w.o, w.ob)
    return x + (a if w.post_attn is None else rms_norm(a, w.post_attn, eps, w.offset))


def out_mlp(x: Tensor, o: Tensor, w: LayerWeights, eps: float, gate: Tensor | None, norm: Tensor) -> tuple[Tensor, Tensor]:
    """`out_proj`, then the gated MLP + residual (Gemma: normalised before it joins) -> the residual
    stream x and its normalisation by `norm`, the next layer's input norm (or the final norm): the
    residual add and that norm are one kernel, not two in two compiled functions (one launch less
    a layer, ~2.5 us on an H200)."""
    x = out_proj(x, o, w, eps, gate)
    h = rms_norm(x, w.ln2, eps, w.offset)
    if w.gate_up is not None:
        gate, up = linear(h, w.gate_up).chunk(2, dim=-1)
    else:
        gate, up = linear(h, w.gate, w.gb), linear(h, w.up, w.ub)
    m = linear(ACTIVATIONS["gelu_pytorch_tanh" if w.gelu else "silu"](gate) * up, w.down, w.db)
    x = x + (m if w.post_mlp is None else rms_norm(m, w.post_mlp, eps, w.offset))
    return x, rms_norm(x, norm, eps, w.offset)


def folded_mask(vis: Tensor, g: int, dtype: torch.dtype) -> Tensor:
    """`tree.visibility` [b, t, n] -> the additive mask of `attend`'s layout [b, 1, g*t, n] (the
    rule repeated once per query head of a KV group)."""
    return additive(vis.repeat(1, g, 1)[:, None], dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """q [b, kv, g*t, d] (`qkv`'s layout) over k/v [b, kv, n, d]; mask additive [b, 1, g*t, n] (the
    [t, n] mask repeated once per query head of a KV group) -> [b, kv, g*t, d]. The heads sharing a
    KV head are folded into the query axis, so no kernel needs GQA support and KV is never repeated."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def compiled(fn: Callable) -> Callable:
    """torch.compile of a layer function: automatic dynamic shapes, so that a first shape compiles
    static and a change makes only the sizes that changed (rows, tokens, slots) symbolic. Model
    sizes (hidden, head dim) stay constants: Inductor keeps a norm's reduction in registers (a
    persistent reduction) only over a size it knows. With every size symbolic (`dynamic=True`),
    a Qwen3-8B verification pass took 5.83 instead of 5.53 ms at batch 1, 10.97 instead of 9.55
    ms at batch 16 on an H200. `ALL_DYNAMIC` restores that (the benchmarks'
    `--all-dynamic` baseline)."""
    return torch.compile(fn, dynamic=True if ALL_DYNAMIC else None, options=inductor_options())


def inductor_options() -> dict[str, Any]:
    # COMBO_KERNELS: Inductor's combo kernels, independent kernels of a graph launched as one. A
    # candidate (`--combo-kernels`): on an H200 fewer launches, but no faster round.
    return {"combo_kernels": True} if COMBO_KERNELS else {}


ALL_DYNAMIC = False
COMBO_KERNELS = False
# Weights of the output, MLP and LM-head GEMMs stored [in, out] (`_fuse`)? None: on CUDA. False:
# as loaded, [out, in] (the benchmarks' `--row-major` baseline); True: on any device (tests).
COLUMN_WEIGHTS: bool | None = None


def column_weights(device: torch.device) -> bool:
    return device.type == "cuda" if COLUMN_WEIGHTS is None else COLUMN_WEIGHTS


@contextmanager
def no_collection():
    """Python's cyclic garbage collector paused: an engine dropped earlier (its graphs held in
    reference cycles through bound methods) must not be collected inside a capture, where
    destroying a CUDA graph is not permitted and invalidates the capture (seen on an H200: an
    evaluation that builds engines per suite failed at random). PyTorch no longer collects
    before a capture by default."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Graphs:
    """Replays `fn` from CUDA graphs captured once per call signature (input shapes and plain
    arguments); eager off CUDA. Outputs live in the graph's memory and are valid until the next
    call of the same signature. `buffers()` names the tensors a graph writes in place: when they
    move (a cache grew), every graph is captured again. `preserve()` lists the tensors `fn`
    updates in place from their own values (a hybrid's recurrent state): the warm-up runs before
    a capture must not advance them, so they are restored before the first replay. shared: every
    graph of this instance takes its memory from one pool (graphs of passes that vary in length
    would otherwise each keep their own); then an output is valid only until the next call of any
    signature, so the caller must copy out what it keeps; shared=another `Graphs`: this one takes
    its memory from that one's pool (and the same rule holds across both)."""

    captured = 0  # graphs captured by every instance so far (benchmarks check that timed work captures none)

    def __init__(self, fn: Callable, buffers: Callable[[], Any] = lambda: None,
                 preserve: Callable[[], list[Tensor]] = list, shared: bool | Graphs = False) -> None:
        self.fn, self.buffers, self.preserve = fn, buffers, preserve
        self.graphs: dict[tuple, tuple[Any, list[Tensor], Any]] = {}
        self.where: Any = None
        self.shared = shared
        self.pool: Any = None  # the shared pool's handle, made at the first capture (CUDA only)

    def __call__(self, *args: Any) -> Any:
        where = self.buffers()
        if where != self.where:
            self.graphs.clear()
            self.where = where
        tensors = [a for a in args if isinstance(a, Tensor)]
        key = tuple(tuple(a.shape) if isinstance(a, Tensor) else a for a in args)
        if key not in self.graphs:
            static = [t.clone() for t in tensors]
            kept = [t.clone() for t in self.preserve()]

            def call() -> Any:
                it = iter(static)
                return self.fn(*(next(it) if isinstance(a, Tensor) else a for a in args))

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with attention_backends(graph=True):  # fixed shapes: cuDNN's attention plans are built once
                with torch.cuda.stream(side):  # warm-up (allocator, cuBLAS handles, compilation)
                    for _ in range(2):
                        call()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                owner = self.shared if isinstance(self.shared, Graphs) else self
                if self.shared and owner.pool is None:
                    owner.pool = torch.cuda.graph_pool_handle()
                with no_collection(), torch.cuda.graph(graph, pool=owner.pool):
                    out = call()
            for t, v in zip(self.preserve(), kept):
                t.copy_(v)
            self.graphs[key] = (graph, static, out)
            Graphs.captured += 1
        graph, static, out = self.graphs[key]
        for s, t in zip(static, tensors):
            s.copy_(t)
        graph.replay()
        return out


class StaticRunner:
    """`engine.Runner` over the target's own weights (see the module docstring)."""

    def __init__(self, target: Target, layer_ids: list[int], *, cuda_graphs: bool = False, compile: bool = False,
                 fuse: bool | None = None, pack: bool | None = None) -> None:
        why = supported(target)
        if why:
            raise ValueError(f"static engine cannot run {target.name}: {why}; use engine 'hf'")
        self.target, self.layer_ids = target, layer_ids
        tc = target.config
        self.eps = tc.rms_norm_eps
        self.heads, self.kv_heads = tc.num_attention_heads, tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // self.heads
        self.scale = next(layer.self_attn.scaling for layer in target.layers if hasattr(layer, "self_attn"))
        self.kinds = target.layer_kinds
        self.linear_dims = (getattr(tc, "linear_num_key_heads", 0), getattr(tc, "linear_num_value_heads", 0),
                            getattr(tc, "linear_key_head_dim", 0))
        self.window = getattr(tc, "sliding_window", None)
        self.gemma = tc.model_type in GEMMA
        self.mrope = tc.model_type in MROPE
        # pack: oneDNN's packed weights (default where `packable`, unless compiling): copies, so
        # the target's modules keep theirs (for an fp32 135M model, 0.5 GB more).
        self.packed = (packable(target) and not compile) if pack is None else pack
        cuda = target.device.type == "cuda"
        self.fuse = (cuda or self.packed) if fuse is None else fuse  # faster on an H200 / packed
        columns = column_weights(target.device)
        self.tw = [_weights(layer, self.fuse, columns) for layer in target.layers]
        head = target.model.get_output_embeddings()
        if columns and head.weight.data_ptr() != target.model.get_input_embeddings().weight.data_ptr():
            _fuse([head], columns=True)  # (a tied head stays: the embedding's rows are read by token)
        if self.packed:
            self.tw = [_pack_layer(w, layer) for w, layer in zip(self.tw, target.layers)]
        # What each layer's output is normalised by in `out_mlp`: the next layer's input norm, the
        # final norm last (detached like the others: a Parameter would compile `out_mlp` again).
        self.next_norms = [w.ln1 for w in self.tw[1:]] + [target.final_norm.weight.detach()]
        self.rotary = target.model.get_decoder().rotary_emb
        self.moe = [layer.mlp if sparse_mlp(layer) else None for layer in target.layers]
        # The layer functions of passes in CUDA graphs, or of every pass without graphs (`_run`).
        self.compiled = tuple(compiled(f) for f in LAYER_FUNCTIONS) if compile else LAYER_FUNCTIONS
        self.cache: KVCache | None = None
        self.cuda_graphs = cuda_graphs
        self.graphed = Graphs(self._step, self._where) if cuda_graphs else None
        # Prefills of at most `small_pass` rows x tokens (padded to a length bucket by
        # `Engine.prefill`): their outputs are copied out at once, so their graphs share one pool.
        self.small_pass = SMALL_PASS_TOKENS
        self.prefills = Graphs(self._step, self._where, shared=True) if cuda_graphs else None

    def _where(self) -> Any:
        return self.cache.k.data_ptr(), self.cache.linear and self.cache.linear.rec.data_ptr()

    def twin(self, small_pass: int) -> StaticRunner:
        """The same layers (weights, compiled functions) for another cache (a staging engine's,
        `Engine.join`): its prefills of at most `small_pass` rows x tokens replay CUDA graphs of
        its own, from this runner's prefills' memory pool (their outputs are copied out at once
        too); it runs no other pass from a graph."""
        other = copy.copy(self)
        other.cache, other.small_pass, other.graphed = None, small_pass, None
        if self.prefills is not None:
            other.prefills = Graphs(other._step, other._where, shared=self.prefills)
        return other

    def __call__(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int,
                 commit: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # Buffers are allocated at the first write, which must not happen inside a graph capture.
        # A prefill (commit given) runs from a graph only when `small` (a bucket's length, as
        # `engine.padded` makes it: shapes come again) and over attention layers alone (a hybrid's prefill
        # folds its recurrent state in blocks, eagerly).
        b, q = tokens.shape
        step: Callable = self._step
        if self.cuda_graphs and cache.k is not None:
            if commit is None and q <= GRAPH_MAX_TOKENS and self.graphed is not None:
                step = self.graphed
            elif commit is not None and cache.linear is None and small(b, q, self.small_pass):
                step = self.prefills
        return self._run(step, cache, tokens, depths, ancestors, n, commit, graph=step is not self._step)

    def eager(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int,
              commit: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The same step without CUDA graphs, for a cache other than the engine's (a joining
        request's prefill, `Engine.join`): graphs are captured over one cache's buffers."""
        return self._run(self._step, cache, tokens, depths, ancestors, n, commit)

    def _run(self, step: Callable, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int,
             commit: Tensor | None, graph: bool = False) -> tuple[Tensor, Tensor]:
        # With CUDA graphs, compiled layer functions run only inside them (compiled in a capture's
        # warm-up, then replayed without Python). The eager passes beside them have new shapes all
        # the time (prefills, joins): there the guards cost launch time (30 against 43 ms per join
        # on an H200), and any new specialisation would compile in the middle of serving.
        compiled = graph or not self.cuda_graphs
        self.cache = cache
        h, feats, block = step(tokens, depths, ancestors, cache.lengths_t, cache.span(n, SLOT_BUCKET), commit, compiled)
        if cache.linear is not None:
            cache.linear.pending = block
        return h, feats

    def _step(self, tokens: Tensor, depths: Tensor, ancestors: Tensor, lengths: Tensor, n: int,
              commit: Tensor | None, compiled: bool) -> tuple[Tensor, Tensor, delta.Block | None]:
        q, dev, cache = tokens.shape[1], tokens.device, self.cache
        qkv_f, out_mlp_f, out_proj_f, mix_f, few_f = self.compiled if compiled else LAYER_FUNCTIONS
        attend_f = attend  # SDPA; passes of few queries on CUDA: the fused kernel, else one row written out
        if q <= FEW_QUERIES and few_attention.use(tokens.shape[0], n, self.head_dim, self.target.dtype, dev):
            attend_f = partial(few_attention.attend, tokens=q)  # [b, q, heads * d]: no permute after it
        elif q <= FEW_QUERIES and dev.type == "cuda" and tokens.shape[0] == 1:
            attend_f = few_f
        g = self.heads // self.kv_heads
        kinds = set(self.kinds) - {"linear_attention"}
        masks = {kind: folded_mask(visibility(lengths, depths, ancestors, n, self.window if kind == "sliding_attention"
                                              else None), g, self.target.dtype) for kind in kinds}
        slots = lengths[:, None] + torch.arange(q, device=dev)
        x = self.target.embed(tokens)
        if kinds:  # the buffers exist before a layer function writes its own view of them
            cache.allocate(x.new_empty(x.shape[0], self.kv_heads, 0, self.head_dim))
        pos = lengths[:, None] + depths
        if self.mrope:  # text positions on all three multimodal axes (some releases want them spelled out)
            pos = pos[None].expand(3, -1, -1)
        rot = {kind: self.rotary(x, pos, kind) if self.gemma else self.rotary(x, pos) for kind in kinds}
        lin = cache.linear
        if lin is not None:
            src = delta.conv_sources(depths, ancestors, lin.shape[1])
            parts: list[tuple[Tensor, ...]] = []
        taps: dict[int, Tensor] = {}
        h = rms_norm(x, self.tw[0].ln1, self.eps, self.tw[0].offset)  # each later layer's comes from `out_mlp`
        for i, (w, kind) in enumerate(zip(self.tw, self.kinds)):
            if w.mix is not None:
                li = len(parts)
                mix = linear_mix if commit is not None else mix_f
                o, part = mix(h, w, self.eps, lin.conv[li], lin.rec[li], src, ancestors, commit, self.linear_dims)
                parts.append(part)
                gate = None
            else:
                ai = i - (len(parts) if lin is not None else 0)
                cos, sin = rot[kind]
                make = qkv_fused if heads.available(h, self.head_dim, cos.shape[-1], w.gated, w.qkv is not None) else qkv_f
                qh, gate = make(h, w, self.eps, cos[:, None], sin[:, None], self.heads, self.kv_heads, self.head_dim,
                                cache.layer(ai), slots)
                o = attend_f(qh, *cache.view(ai, n), masks[kind], self.scale)
            if self.moe[i] is None:
                x, h = out_mlp_f(x, o, w, self.eps, gate, self.next_norms[i])
            else:
                x = out_proj_f(x, o, w, self.eps, gate)
                x = x + self.moe[i](rms_norm(x, w.ln2, self.eps, w.offset))
                h = rms_norm(x, self.next_norms[i], self.eps, w.offset)
            taps[i] = x
        taps[len(self.tw) - 1] = h  # as in Target.forward: the last layer is reported after the final norm
        block = None
        if lin is not None and commit is None:
            block = delta.Block(*(torch.stack(t) for t in zip(*parts)), ancestors, src)
        return h, torch.cat([taps[i] for i in self.layer_ids], dim=-1), block


def linear_mix(h: Tensor, w: LayerWeights, eps: float, conv: Tensor, rec: Tensor, src: Tensor, incl: Tensor,
               commit: Tensor | None, dims: tuple[int, int, int]) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A Gated DeltaNet token mixer over a verification block (see `decode/delta.py`), before its
    output projection: h [b, t, H] (the layer's normalised input, as for `qkv`), the layer's conv
    window [b, K-1, C] and state [b, h, dk, dv] -> ([b, t, h * dv], (conv inputs, k, d, G) for
    `LinearState.fold`).
    commit [b] (a prefill, or an AR step's ones): the block is a chain whose first commit[i] tokens
    of row i are committed now; the state is updated here, in blocks of `delta.SUBCHUNK`, the rest
    of each row made inert (no decay, no update)."""
    m = w.mix
    b, t, _ = h.shape
    key_heads, value_heads, dk = dims
    C, Z = m.qkv.shape[0], m.z.shape[0]
    if m.proj is not None:
        mixed, z, bb, a = linear(h, m.proj).split([C, Z, value_heads, value_heads], dim=-1)
    else:
        mixed, z, bb, a = (linear(h, p) for p in (m.qkv, m.z, m.b, m.a))
    seq = torch.cat([conv, mixed.to(conv.dtype)], dim=1)  # [b, K-1+t, C]
    q, k, v, g, beta = delta.prepare(delta.causal_conv(seq, src, m.conv, m.conv_b), a, bb, m.A_log, m.dt_bias,
                                     key_heads, value_heads, dk)
    if commit is None:
        o, d, G = delta.block(q, k, v, g, beta, rec, incl)
        part: tuple[Tensor, ...] = (seq, k, d, G)
    else:
        live = (torch.arange(t, device=h.device) < commit[:, None])[:, None]  # [b, 1, t]
        g, beta = g * live, beta * live
        S, outs = rec, []
        for s in range(0, t, delta.SUBCHUNK):
            e = min(t, s + delta.SUBCHUNK)
            sub = incl[:, s:e, s:e]
            o, d, G = delta.block(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], S, sub)
            S = delta.fold(S, k[:, :, s:e], d, G, sub[:, -1:], torch.full_like(G[..., :1], e - s - 1, dtype=torch.long))
            outs.append(o)
        o = torch.cat(outs, dim=2)
        rec.copy_(S)
        K1 = conv.shape[1]  # the last K-1 committed inputs: slots commit .. commit + K-2 of seq
        conv.copy_(seq.gather(1, (commit[:, None] + torch.arange(K1, device=h.device))[..., None].expand(-1, -1, C)))
        part = ()
    o = rms_norm(o.transpose(1, 2).to(h.dtype), m.norm, eps)  # [b, t, h, dv]; then the gate of Qwen3.5's norm
    o = (o * F.silu(z.reshape(b, t, value_heads, -1).float())).to(h.dtype)
    return o.reshape(b, t, -1), part


LAYER_FUNCTIONS = (qkv, out_mlp, out_proj, linear_mix, attend_few)  # what `StaticRunner(compile=True)` compiles


def static_engine(target: Target, drafter: DFlashDrafter | None = None, *, cuda_graphs: bool | None = None,
                  compile: bool = False, fuse: bool | None = None, compile_drafter: bool = False,
                  layer_ids: list[int] | None = None, pack: bool | None = None,
                  draft_dtype: torch.dtype | None = None, draft_tokens: int | None = None,
                  confidence: bool = True) -> Engine:
    """An `Engine` whose target runs on `StaticRunner`; CUDA graphs (default on CUDA) capture the
    target's step and the commit (`graphed_commit`; neither with a mixture-of-experts MLP) and the
    drafter's step with its tree building. compile_drafter: torch.compile the drafter's pass (its
    layers, masks, cache writes and LM head) before capture. layer_ids: the taps whose features the
    engine keeps (default: the drafter's). pack: oneDNN's packed weights for the target's layers
    and LM head, and for a copy of the drafter's projections (default: fp32 on a CPU, `packable`).
    draft_dtype: the drafter runs as a copy in this dtype (default: its own). draft_tokens: tokens
    drafted a round (default: the drafter's block less the bonus; `Engine`). confidence: whether a
    drafter's confidence head scores its drafts (`Engine`)."""
    graphs = target.device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if graphs and target.device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA target")
    # Expert routing has data-dependent shapes: such a target's layers run eagerly (the drafter's
    # step is still captured).
    runner_graphs = graphs and not any(sparse_mlp(layer) for layer in target.layers)
    if layer_ids is None:
        layer_ids = drafter.config.target_layer_ids if drafter is not None else [target.num_layers - 1]
    if pack is None and compile_drafter:  # Dynamo cannot trace oneDNN's packed weights (the drafter's step reads the LM head)
        pack = False
    runner = StaticRunner(target, list(layer_ids), cuda_graphs=runner_graphs, compile=compile, fuse=fuse, pack=pack)
    draft_packed = drafter is not None and runner.packed and packs(draft_dtype or next(drafter.parameters()).dtype)
    if drafter is not None:  # the engine's own copy, laid out for decoding (the caller's stays as it was)
        drafter = drafter_copy(drafter, draft_dtype, draft_packed)
        fuse_drafter(drafter, runner.fuse, column_weights(target.device))
    own_dtype = None if drafter is None else next(drafter.parameters()).dtype  # (a head of its own where it differs)
    small_passes = runner_graphs and "linear_attention" not in target.layer_kinds  # (a hybrid's prefill runs eagerly)
    parts = Parts(
        # the LM heads packed too: the largest GEMMs of a small model's pass and draft
        lm_head=lm_head(target, target.dtype, packed=True) if runner.packed else None,
        draft_head=lm_head(target, own_dtype, packed=draft_packed)
        if runner.packed and own_dtype not in (None, target.dtype) else None,
        compile_draft=_compiled_draft if compile_drafter else None,
        graph_draft=_draft_graphs if graphs else None,
        graph_commit=graphed_commit if runner_graphs else None,
        graph_accept=_accept_graphs if graphs else None,
        slot_bucket=SLOT_BUCKET, fixed_rows=graphs, small_pass=SMALL_PASS_TOKENS if small_passes else 0,
        join_pass=JOIN_PASS_TOKENS if small_passes else 0)
    return Engine(target, drafter, runner, draft_tokens, parts, confidence)


def _compiled_draft(draft_logits: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The drafter's pass compiled; its tree building (a beam search) would take minutes to
    compile. Every size symbolic here: one compilation serves every context width and span.
    (Under automatic dynamic shapes, bench_decode's staged run compiled it again after its warm-up
    on an H200, 14.6 s; where a round's draft goes, its norms gained nothing measurable.)"""
    return torch.compile(draft_logits, dynamic=True, options=inductor_options())


def _draft_graphs(step: Callable[..., Any], key: Callable[[], Any]) -> tuple[Graphs, Graphs]:
    """The draft step from CUDA graphs: one per round shape, and one per (rows, context bucket,
    span) of a small context longer than a block, whose outputs are read in their round, so that
    they share one memory pool (the largest pass's)."""
    return Graphs(step, key), Graphs(step, key, shared=True)


def _accept_graphs(steps: Steps) -> Steps:
    """The rejection rule's draws and checks from CUDA graphs: about 140 small kernels a round,
    launch-bound when launched one by one (Inductor fails to compile them on CUDA, torch 2.11). One
    graph per shape of its inputs (batch, tree width) and per whether a row cuts by top-p."""
    return Steps(*(Graphs(step) for step in steps))


def fuse_drafter(drafter: DFlashDrafter, fuse: bool, columns: bool) -> None:
    """Lays out an engine's copy of the drafter as the target's layers: fuse: each layer's [k; v]
    and [gate; up] weights as one tensor each (`Attention.kv_weight`, `MLP.gate_up`; packed like
    the modules they fuse), so that a draft runs 5 GEMMs a layer instead of 9 (k and v of the new
    context and of the block are one stream; its queries stay apart: the context has none);
    columns: the output and MLP weights stored [in, out], as the target's."""
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        if fuse and a.k_proj.bias is None:
            a.kv_weight = _fuse([a.k_proj, a.v_proj])
        m.gate_up = _out_mlp_layout(a.o_proj, m.gate_proj, m.up_proj, m.down_proj, fuse, columns)


def graphed_commit(cache: KVCache) -> Callable[[Tensor, Tensor, bool, bool], None]:
    """`KVCache.apply` from CUDA graphs: a commit is a few dozen small kernels (the linear layers'
    fold, a tree's key/value move), launch-bound when launched one by one. A graph reads the
    pending block where the verification graph left it, so the block's address is part of the
    key (one commit graph per verification graph); a block wider than GRAPH_MAX_TOKENS came from an
    eager pass, at a new address each time: committed eagerly. Capture warm-ups run the commit,
    so the state it changes is restored (`Graphs(preserve=...)`)."""
    lin = cache.linear

    def graphs(moving: bool) -> Graphs:  # warm-ups restore only what the commit changes (keys/values can be GBs)
        return Graphs(lambda plan, lengths, moves, fold, where: cache.apply(plan, lengths, moves, fold),
                      lambda: (cache.k.data_ptr(), lin and lin.rec.data_ptr()),
                      lambda: ([cache.k, cache.v] if moving else []) + ([lin.conv, lin.rec] if lin is not None else []))

    graphed = {False: graphs(False), True: graphs(True)}

    def commit_step(plan: Tensor, lengths: Tensor, moves: bool, fold: bool) -> None:
        if plan.shape[1] - 1 > GRAPH_MAX_TOKENS:
            return cache.apply(plan, lengths, moves, fold)
        where = tuple(t.data_ptr() for t in lin.pending) if fold else None
        graphed[moves](plan, lengths, moves, fold, where)

    return commit_step


@torch.no_grad()
def runner_features(target: Target, ids: Tensor, layer_ids: list[int]) -> Tensor:
    """ids [T] -> the tapped features [T, n_taps * H] as the static runner computes them (what
    serving's drafter sees), to compare with Transformers' forward (what extraction saw)."""
    engine = static_engine(target, None, cuda_graphs=False, layer_ids=layer_ids)
    engine.prefill([ids], capacity=len(ids) + 1)
    return engine.pending[0]
