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
the target's own generation. Optional torch.compile fuses each layer's elementwise work, and
q/k/v and gate/up weights can be fused row-wise. Supported targets: Llama / Qwen2 / Qwen3-style
decoders (full attention, or sliding windows named per layer) and Gemma 3 (its norms of
(1 + w), the norms after attention and MLP, GELU, one RoPE per layer type, query scaling by
`query_pre_attn_scalar`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.decode.cache import KVCache
from dflashkit.decode.engine import Engine
from dflashkit.decode.tree import visibility
from dflashkit.drafter import DFlashDrafter, apply_rope
from dflashkit.target import Target

MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")
GEMMA = ("gemma3_text",)
SLOT_BUCKET = 256  # attention spans are rounded up to this many slots (one graph per bucket)
GRAPH_MAX_TOKENS = 256  # steps of more tokens (long prompts) run eagerly: no graph per prompt length


def supported(target: Target) -> str | None:
    """None when the static engine can run `target`, else the reason why not."""
    cfg = target.config
    if cfg.model_type not in MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {MODEL_TYPES}"
    kinds = set(target.layer_kinds)
    if kinds - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)} (only full and sliding attention)"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} (only {sorted(ACTIVATIONS)})"
    return None


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (biases may be None). A plain tuple of tensors, so that one
    compiled function serves every layer."""

    ln1: Tensor
    q: Tensor
    qb: Tensor | None
    k: Tensor
    kb: Tensor | None
    v: Tensor
    vb: Tensor | None
    qn: Tensor | None
    kn: Tensor | None
    o: Tensor
    ob: Tensor | None
    ln2: Tensor
    gate: Tensor
    gb: Tensor | None
    up: Tensor
    ub: Tensor | None
    down: Tensor
    db: Tensor | None
    qkv: Tensor | None = None  # fused [q; k; v] rows (static_engine(fuse=True)): one GEMM instead of three
    gate_up: Tensor | None = None  # fused [gate; up] rows: one GEMM instead of two
    post_attn: Tensor | None = None  # Gemma: a norm on the attention output, one on the MLP output
    post_mlp: Tensor | None = None
    gemma: bool = False  # norms of (1 + w) computed in fp32; GELU (tanh) in the MLP


def _weights(layer: Any, fuse: bool = False) -> LayerWeights:
    """Detached views of the module's parameters (same storage; no autograd state to guard on).
    fuse: also q/k/v and gate/up as one row-concatenated weight each (see `_fuse_rows`)."""
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # Gemma's post_attention_layernorm is not the pre-MLP norm
    ln2 = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    mods = [layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, qn, kn, a.o_proj, ln2,
            m.gate_proj, m.up_proj, m.down_proj]
    b = [None if mod is None or getattr(mod, "bias", None) is None else mod.bias.detach() for mod in mods]
    fuse = fuse and all(x is None for x in b[1:4] + b[8:10])  # biased projections stay separate
    qkv_w = _fuse_rows([a.q_proj, a.k_proj, a.v_proj]) if fuse else None
    gate_up = _fuse_rows([m.gate_proj, m.up_proj]) if fuse else None
    w = [None if mod is None else mod.weight.detach() for mod in mods]
    extra = dict(post_attn=layer.post_attention_layernorm.weight.detach(),
                 post_mlp=layer.post_feedforward_layernorm.weight.detach(), gemma=True) if gemma else {}
    return LayerWeights(w[0], w[1], b[1], w[2], b[2], w[3], b[3], w[4], w[5], w[6], b[6], w[7], w[8], b[8], w[9], b[9],
                        w[10], b[10], qkv=qkv_w, gate_up=gate_up, **extra)


@torch.no_grad()
def _fuse_rows(mods: list[nn.Module]) -> Tensor:
    """The modules' weights as one [sum of rows, in] tensor: fewer, larger GEMMs, which read the
    weights closer to full bandwidth at the few rows of a decoding step. The modules' weights
    become row views of it, so no second copy stays in memory (for an 8B target that copy would be
    9 GB); a second engine over the same modules finds them already adjacent and reuses the buffer."""
    ws = [mod.weight for mod in mods]
    rows, cols = sum(w.shape[0] for w in ws), ws[0].shape[1]
    offsets = [ws[0].storage_offset() + cols * sum(w.shape[0] for w in ws[:i]) for i in range(len(ws))]
    if all(w.is_contiguous() and w.untyped_storage().data_ptr() == ws[0].untyped_storage().data_ptr()
           and w.storage_offset() == off for w, off in zip(ws, offsets)):
        return ws[0].detach().new_empty(0).set_(ws[0].untyped_storage(), offsets[0], (rows, cols), (cols, 1))
    buf = torch.cat([w.detach() for w in ws])
    start = 0
    for mod in mods:
        n = mod.weight.shape[0]
        mod.weight.data = buf[start:start + n]
        start += n
    return buf


def rms_norm(x: Tensor, w: Tensor, eps: float, gemma: bool = False) -> Tensor:
    # The exact op order of Transformers' Llama/Qwen3 RMSNorm (and the drafter's), or Gemma's.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (x32 * (1.0 + w.float())).to(x.dtype)
    return w * x32.to(x.dtype)


def qkv(x: Tensor, w: LayerWeights, eps: float, cos: Tensor, sin: Tensor, heads: int, kv_heads: int,
        head_dim: int, norm_input: bool = True, with_q: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """x [b, t, H] -> q [b, heads, t, d] (or None), k, v [b, kv_heads, t, d], RoPE applied."""
    b, t, _ = x.shape
    h = rms_norm(x, w.ln1, eps, w.gemma) if norm_input else x
    if w.qkv is not None:
        y = F.linear(h, w.qkv[heads * head_dim:] if not with_q else w.qkv)
        parts = list(y.split([heads * head_dim] * with_q + [kv_heads * head_dim] * 2, dim=-1))
        yq = parts.pop(0) if with_q else None
        yk, yv = parts
    else:
        yq = F.linear(h, w.q, w.qb) if with_q else None
        yk, yv = F.linear(h, w.k, w.kb), F.linear(h, w.v, w.vb)

    def heads_first(y: Tensor, n: int, norm: Tensor | None) -> Tensor:
        y = y.view(b, t, n, head_dim)
        return (y if norm is None else rms_norm(y, norm, eps, w.gemma)).transpose(1, 2)

    q = apply_rope(heads_first(yq, heads, w.qn), cos, sin) if with_q else None
    return q, apply_rope(heads_first(yk, kv_heads, w.kn), cos, sin), heads_first(yv, kv_heads, None)


def out_mlp(x: Tensor, o: Tensor, w: LayerWeights, eps: float) -> Tensor:
    """Attention output projection + residual, then the gated MLP + residual (Gemma: each branch
    normalised before it joins the residual)."""
    a = F.linear(o, w.o, w.ob)
    x = x + (a if w.post_attn is None else rms_norm(a, w.post_attn, eps, w.gemma))
    h = rms_norm(x, w.ln2, eps, w.gemma)
    if w.gate_up is not None:
        gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, w.gate, w.gb), F.linear(h, w.up, w.ub)
    m = F.linear(ACTIVATIONS["gelu_pytorch_tanh" if w.gemma else "silu"](gate) * up, w.down, w.db)
    return x + (m if w.post_mlp is None else rms_norm(m, w.post_mlp, eps, w.gemma))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """q [b, h, t, d] over k/v [b, kv, n, d]; mask bool [b, 1, g*t, n] (the [t, n] mask repeated
    once per query head of a KV group). The heads sharing a KV head are folded into the query
    axis, so no kernel needs GQA support and KV is never repeated."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, kv, (h // kv) * t, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


class Graphs:
    """Replays `fn` from CUDA graphs captured once per call signature (input shapes and plain
    arguments); eager off CUDA. Outputs live in the graph's memory and are valid until the next
    call of the same signature. `buffers()` names the tensors a graph writes in place: when they
    move (a cache grew), every graph is captured again."""

    def __init__(self, fn: Callable, buffers: Callable[[], Any] = lambda: None) -> None:
        self.fn, self.buffers = fn, buffers
        self.graphs: dict[tuple, tuple[Any, list[Tensor], Any]] = {}
        self.where: Any = None

    def __call__(self, *args: Any) -> Any:
        where = self.buffers()
        if where != self.where:
            self.graphs.clear()
            self.where = where
        tensors = [a for a in args if isinstance(a, Tensor)]
        key = tuple(tuple(a.shape) if isinstance(a, Tensor) else a for a in args)
        if key not in self.graphs:
            static = [t.clone() for t in tensors]

            def call() -> Any:
                it = iter(static)
                return self.fn(*(next(it) if isinstance(a, Tensor) else a for a in args))

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (allocator, cuBLAS handles, compilation)
                for _ in range(2):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for s, t in zip(static, tensors):
            s.copy_(t)
        graph.replay()
        return out


class StaticRunner:
    """`engine.Runner` over the target's own weights (see the module docstring)."""

    def __init__(self, target: Target, layer_ids: list[int], *, cuda_graphs: bool = False, compile: bool = False,
                 fuse: bool | None = None) -> None:
        why = supported(target)
        if why:
            raise ValueError(f"static engine cannot run {target.name}: {why}; use engine 'hf'")
        self.target, self.layer_ids = target, layer_ids
        tc = target.config
        self.eps = tc.rms_norm_eps
        self.heads, self.kv_heads = tc.num_attention_heads, tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // self.heads
        self.scale = target.layers[0].self_attn.scaling
        self.kinds = target.layer_kinds
        self.window = getattr(tc, "sliding_window", None)
        self.gemma = tc.model_type in GEMMA
        fuse = target.device.type == "cuda" if fuse is None else fuse  # measured faster on an H200
        self.tw = [_weights(layer, fuse) for layer in target.layers]
        self.norm_w = target.final_norm.weight
        self.rotary = target.model.get_decoder().rotary_emb
        self._qkv, self._out_mlp = qkv, out_mlp
        if compile:
            self._qkv, self._out_mlp = torch.compile(qkv, dynamic=True), torch.compile(out_mlp, dynamic=True)
        self.cache: KVCache | None = None
        self.graphed = Graphs(self._step, lambda: self.cache.k.data_ptr()) \
            if cuda_graphs else None

    def __call__(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int) -> tuple[Tensor, Tensor]:
        self.cache = cache
        n = cache.span(n, SLOT_BUCKET)
        # Buffers are allocated at the first write, which must not happen inside a graph capture.
        use_graph = self.graphed is not None and tokens.shape[1] <= GRAPH_MAX_TOKENS and cache.k is not None
        return (self.graphed if use_graph else self._step)(tokens, depths, ancestors, cache.lengths_t, n)

    def eager(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The same step without CUDA graphs, for a cache other than the engine's (a joining
        request's prefill, `Engine.join`): graphs are captured over one cache's buffers."""
        self.cache = cache
        return self._step(tokens, depths, ancestors, cache.lengths_t, cache.span(n, SLOT_BUCKET))

    def _step(self, tokens: Tensor, depths: Tensor, ancestors: Tensor, lengths: Tensor, n: int) -> tuple[Tensor, Tensor]:
        q, dev, cache = tokens.shape[1], tokens.device, self.cache
        g = self.heads // self.kv_heads
        masks = {kind: visibility(lengths, depths, ancestors, n, self.window if kind == "sliding_attention" else None)
                 .repeat(1, g, 1)[:, None] for kind in set(self.kinds)}
        slots = lengths[:, None] + torch.arange(q, device=dev)
        x = self.target.embed(tokens)
        pos = lengths[:, None] + depths
        rope = {kind: self.rotary(x, pos, kind) if self.gemma else self.rotary(x, pos) for kind in set(self.kinds)}
        taps: dict[int, Tensor] = {}
        for i, (w, kind) in enumerate(zip(self.tw, self.kinds)):
            cos, sin = rope[kind]
            qh, k, v = self._qkv(x, w, self.eps, cos[:, None], sin[:, None], self.heads, self.kv_heads, self.head_dim)
            cache.write(i, k, v, slots)
            x = self._out_mlp(x, attend(qh, *cache.view(i, n), masks[kind], self.scale), w, self.eps)
            taps[i] = x
        h = rms_norm(x, self.norm_w, self.eps, self.gemma)
        taps[len(self.tw) - 1] = h  # as in Target.forward: the last layer is reported after the final norm
        return h, torch.cat([taps[i] for i in self.layer_ids], dim=-1)


def static_engine(target: Target, drafter: DFlashDrafter | None = None, *, cuda_graphs: bool | None = None,
                  compile: bool = False, fuse: bool | None = None, compile_drafter: bool = False) -> Engine:
    """An `Engine` whose target runs on `StaticRunner`; CUDA graphs (default on CUDA) capture the
    target's step and the drafter's step. compile_drafter: torch.compile the drafter's whole step
    (its layers, masks and cache writes) before capture."""
    graphs = target.device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if graphs and target.device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA target")
    layer_ids = drafter.config.target_layer_ids if drafter is not None else [target.num_layers - 1]
    runner = StaticRunner(target, layer_ids, cuda_graphs=graphs, compile=compile, fuse=fuse)
    engine = Engine(target, drafter, runner)
    engine.slot_bucket, engine.fixed_rows = SLOT_BUCKET, graphs
    step = torch.compile(engine._draft_step, dynamic=True) if compile_drafter else engine._draft_step
    if graphs and drafter is not None:
        engine.draft_step = Graphs(step, lambda: engine.dcache.k.data_ptr())
    return engine
