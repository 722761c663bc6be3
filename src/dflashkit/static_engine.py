"""The fast path of `decode.py`: static KV caches and CUDA graphs (gpt-fast style).

Batch-1 decoding on a GPU is launch-bound when every op is launched from Python: a round of an
8B target and its drafter is a few thousand small kernels. Here the target's and the drafter's
layers run as plain functions over their own weights (read from the Transformers / dflashkit
modules, never copied), with KV buffers allocated once for `capacity` positions, so that every
step has fixed shapes and fixed addresses and is captured once per shape into a CUDA graph:

* target step: t tokens (1 for AR, B for DFlash, budget+1 for DDTree) written at slots
  [length, length+t), RoPE positions length + depth; the mask [t, capacity] shows the committed
  prefix and each node's ancestors. Committing a tree path moves the kept slots together, one
  gather over all layers at once.
* drafter step: the features of the tokens verified last round (padded to B rows) are written
  as context at [ctx_len, ctx_len+B); the block's own keys at [start, start+B) then overwrite the
  padding; the block sees context [0, start) (sliding layers: its window) and itself.

Optional torch.compile fuses the elementwise work of each layer. On CPU the same code runs
eagerly; tests check it against `HFEngine` (the target's own forward) and `draft_block`.
Supported targets: Llama / Qwen2 / Qwen3-style decoders with full attention only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.drafter import DFlashDrafter, apply_rope, rope_cos_sin
from dflashkit.target import Target

MODEL_TYPES = ("llama", "qwen2", "qwen3")


def supported(target: Target) -> str | None:
    """None when the static engine can run `target`, else the reason why not."""
    cfg = target.config
    if cfg.model_type not in MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {MODEL_TYPES}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or getattr(cfg, "use_sliding_window", False):
        return "sliding-window layers are not supported by the static engine"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    return None


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
    qkv: Tensor | None = None  # fused [q; k; v] rows (StaticEngine(fuse=True)): one GEMM instead of three
    gate_up: Tensor | None = None  # fused [gate; up] rows: one GEMM instead of two


def _weights(layer: Any, fuse: bool = False) -> LayerWeights:
    """Detached views of the module's parameters (same storage; no autograd state to guard on).
    fuse: also q/k/v and gate/up as one row-concatenated weight each (see `_fuse_rows`)."""
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    mods = [layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, qn, kn, a.o_proj, layer.post_attention_layernorm,
            m.gate_proj, m.up_proj, m.down_proj]
    b = [None if mod is None or getattr(mod, "bias", None) is None else mod.bias.detach() for mod in mods]
    fuse = fuse and all(x is None for x in b[1:4] + b[8:10])  # biased projections stay separate
    qkv_w = _fuse_rows([a.q_proj, a.k_proj, a.v_proj]) if fuse else None
    gate_up = _fuse_rows([m.gate_proj, m.up_proj]) if fuse else None
    w = [None if mod is None else mod.weight.detach() for mod in mods]
    return LayerWeights(w[0], w[1], b[1], w[2], b[2], w[3], b[3], w[4], w[5], w[6], b[6], w[7], w[8], b[8], w[9], b[9],
                        w[10], b[10], qkv=qkv_w, gate_up=gate_up)


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


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    # The exact op order of Transformers' Llama/Qwen3 RMSNorm and of the drafter's.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def qkv(x: Tensor, w: LayerWeights, eps: float, cos: Tensor, sin: Tensor, heads: int, kv_heads: int,
        head_dim: int, norm_input: bool = True, with_q: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """x [b, t, H] -> q [b, heads, t, d] (or None), k, v [b, kv_heads, t, d], RoPE applied."""
    b, t, _ = x.shape
    h = rms_norm(x, w.ln1, eps) if norm_input else x
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
        return (y if norm is None else rms_norm(y, norm, eps)).transpose(1, 2)

    q = apply_rope(heads_first(yq, heads, w.qn), cos, sin) if with_q else None
    return q, apply_rope(heads_first(yk, kv_heads, w.kn), cos, sin), heads_first(yv, kv_heads, None)


def out_mlp(x: Tensor, o: Tensor, w: LayerWeights, eps: float) -> Tensor:
    """Attention output projection + residual, then the SwiGLU MLP + residual."""
    x = x + F.linear(o, w.o, w.ob)
    h = rms_norm(x, w.ln2, eps)
    if w.gate_up is not None:
        gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, w.gate, w.gb), F.linear(h, w.up, w.ub)
    return x + F.linear(F.silu(gate) * up, w.down, w.db)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """q [b, h, t, d] over a whole static buffer k/v [b, kv, cap, d]; mask bool [g*t, cap] (the
    [t, cap] mask repeated once per query head of a KV group). The heads sharing a KV head are
    folded into the query axis, so no kernel needs GQA support and KV is never repeated."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, kv, (h // kv) * t, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


class _Graphs:
    """Replays `fn` from CUDA graphs captured once per input shape (eager off CUDA).
    Outputs live in the graph's memory and are valid until the next call of the same shape."""

    def __init__(self, fn: Any, enabled: bool) -> None:
        self.fn, self.enabled = fn, enabled
        self.graphs: dict[tuple, tuple[Any, list[Tensor], Any]] = {}

    def __call__(self, *inputs: Tensor) -> Any:
        if not self.enabled:
            return self.fn(*inputs)
        key = tuple(tuple(x.shape) for x in inputs)
        if key not in self.graphs:
            static = [x.clone() for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (allocator, cuBLAS handles, compilation)
                for _ in range(2):
                    self.fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.fn(*static)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for s, x in zip(static, inputs):
            s.copy_(x)
        graph.replay()
        return out

    def clear(self) -> None:
        self.graphs.clear()


class StaticEngine:
    """`decode.Engine` over static KV buffers; CUDA graphs on CUDA (batch size 1)."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, *, capacity: int = 0,
                 cuda_graphs: bool | None = None, compile: bool = False, fuse: bool | None = None) -> None:
        why = supported(target)
        if why:
            raise ValueError(f"static engine cannot run {target.name}: {why}; use engine 'hf'")
        self.target, self.drafter = target, drafter
        tc = target.config
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else [target.num_layers - 1]
        self.eps = tc.rms_norm_eps
        self.heads, self.kv_heads = tc.num_attention_heads, tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // self.heads
        self.scale = target.layers[0].self_attn.scaling
        fuse = target.device.type == "cuda" if fuse is None else fuse  # measured faster on an H200
        self.tw = [_weights(layer, fuse) for layer in target.layers]
        self.dw = [_weights(layer, fuse) for layer in drafter.layers] if drafter is not None else []
        self.norm_w = target.final_norm.weight
        self.rotary = target.model.get_decoder().rotary_emb
        dev = target.device
        self.graphs_on = dev.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.graphs_on and dev.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA target")
        self._qkv, self._out_mlp = qkv, out_mlp
        if compile:
            self._qkv, self._out_mlp = torch.compile(qkv, dynamic=True), torch.compile(out_mlp, dynamic=True)
        self.target_step = _Graphs(self._target_step, self.graphs_on)
        self.draft_step = _Graphs(self._draft_step, self.graphs_on)
        self.capacity = 0
        self.length = 0
        if capacity:
            self._allocate(capacity)

    # ---- buffers ---------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // 64) * 64  # aligned rows for the attention kernels' masks
        dev, dt, d = self.target.device, self.target.dtype, self.head_dim
        L, Ld = len(self.tw), len(self.dw)
        self.k = torch.zeros(L, 1, self.kv_heads, capacity, d, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        if self.drafter is not None:
            dc = self.drafter.config
            self.dk = torch.zeros(Ld, 1, dc.num_key_value_heads, capacity, dc.head_dim, device=dev, dtype=dt)
            self.dv = torch.zeros_like(self.dk)
        self.capacity = capacity
        self._start = torch.zeros((), dtype=torch.long, device=dev)  # scalars set with fill_: no host sync
        self._ctx_len = torch.zeros((), dtype=torch.long, device=dev)
        self._tril: dict[int, Tensor] = {}
        if self.drafter is not None:
            self._feats = torch.zeros(1, self.drafter.config.block_size, len(self.layer_ids) * self.target.hidden_size,
                                      device=dev, dtype=dt)
        self.target_step.clear()  # graphs hold the old buffers' addresses
        self.draft_step.clear()

    # ---- target ----------------------------------------------------------------------------
    def _target_step(self, tokens: Tensor, depths: Tensor, anc: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [1, t] at slots start.., positions start + depths; anc bool [t, t]."""
        t, dev = tokens.shape[1], tokens.device
        col = torch.arange(self.capacity, device=dev)
        rel = col - start
        tree = anc[:, rel.clamp(0, t - 1)] & (rel >= 0) & (rel < t)
        mask = ((col < start) | tree).repeat(self.heads // self.kv_heads, 1)
        slots = start + torch.arange(t, device=dev)
        x = self.target.embed(tokens)
        cos, sin = self.rotary(x, (start + depths)[None])
        cos, sin = cos[:, None], sin[:, None]
        taps: dict[int, Tensor] = {}
        for i, w in enumerate(self.tw):
            q, k, v = self._qkv(x, w, self.eps, cos, sin, self.heads, self.kv_heads, self.head_dim)
            self.k[i].index_copy_(2, slots, k)
            self.v[i].index_copy_(2, slots, v)
            x = self._out_mlp(x, attend(q, self.k[i], self.v[i], mask, self.scale), w, self.eps)
            taps[i] = x
        h = rms_norm(x, self.norm_w, self.eps)
        taps[len(self.tw) - 1] = h  # as in Target.forward: the last layer is reported after the final norm
        return self.target.lm_head(h), torch.cat([taps[i] for i in self.layer_ids], dim=-1)

    def prefill(self, ids: Tensor, capacity: int) -> Tensor:
        if capacity > self.capacity:
            self._allocate(capacity)
        T, dev = ids.shape[1], self.target.device
        start = torch.zeros((), dtype=torch.long, device=dev)
        tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        logits, feats = self._target_step(ids, torch.arange(T, device=dev), tril, start)  # eager: any length
        self.length, self.ctx_len = T, 0
        self.pending = feats
        return logits[:, -1]

    def verify(self, tokens: Tensor, depths: Tensor, ancestors: Tensor | None) -> Tensor:
        t, dev = tokens.shape[1], self.target.device
        if ancestors is None:
            if t not in self._tril:
                self._tril[t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
            anc = self._tril[t]
        else:
            anc = ancestors.to(dev)
        logits, self.verified = self.target_step(tokens, depths, anc, self._start.fill_(self.length))
        return logits

    def commit(self, path: list[int]) -> None:
        m, n = len(path), self.length
        if path == list(range(m)):
            # A view of the graph's output: `draft` copies it before the next verify overwrites it.
            self.pending = self.verified[:, :m]
        else:  # move the accepted tree nodes' keys/values together
            keep = torch.tensor(path, device=self.target.device)
            self.k[:, :, :, n:n + m] = self.k[:, :, :, n + keep]
            self.v[:, :, :, n:n + m] = self.v[:, :, :, n + keep]
            self.pending = self.verified[:, keep]
        self.length += m

    # ---- drafter ---------------------------------------------------------------------------
    def _ctx_kv(self, feats: Tensor, first: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Context keys/values of features [1, c, n_taps*H] at positions first.. per drafter layer."""
        d, dc = self.drafter, self.drafter.config
        ctx = d.hidden_norm(d.fc(feats))
        pos = first + torch.arange(feats.shape[1], device=feats.device)
        cos, sin = rope_cos_sin(pos[None], dc.head_dim, dc.rope_theta, ctx.dtype)
        return [self._qkv(ctx, w, dc.rms_norm_eps, cos, sin, dc.num_attention_heads, dc.num_key_value_heads,
                          dc.head_dim, norm_input=False, with_q=False)[1:] for w in self.dw]

    def _draft_step(self, feats: Tensor, bonus: Tensor, ctx_len: Tensor, start: Tensor) -> Tensor:
        """feats [1, B, F]: new context rows (valid up to start - ctx_len, the rest padding)."""
        d, dc = self.drafter, self.drafter.config
        B, dev = dc.block_size, feats.device
        ar = torch.arange(B, device=dev)
        ctx_slots, blk_slots = ctx_len + ar, start + ar
        col = torch.arange(self.capacity, device=dev)
        blk = (col >= start) & (col < start + B)
        vis = {"full_attention": (col < start) | blk}
        if dc.sliding_window:
            vis["sliding_attention"] = ((col < start) & (col >= start - dc.sliding_window)) | blk
        g = dc.num_attention_heads // dc.num_key_value_heads
        masks = {k: m.expand(g * B, -1) for k, m in vis.items()}
        ids = torch.cat([bonus[:, None], torch.full((1, B - 1), dc.mask_token_id, device=dev)], dim=1)
        x = self.target.embed(ids).to(feats.dtype)
        cos, sin = rope_cos_sin(blk_slots[None], dc.head_dim, dc.rope_theta, x.dtype)
        for i, (w, (kc, vc)) in enumerate(zip(self.dw, self._ctx_kv(feats, ctx_len))):
            q, kb, vb = self._qkv(x, w, dc.rms_norm_eps, cos, sin, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim)
            for buf, c, b_ in ((self.dk[i], kc, kb), (self.dv[i], vc, vb)):
                buf.index_copy_(2, ctx_slots, c)
                buf.index_copy_(2, blk_slots, b_)  # after the context: overwrites its padding rows
            o = attend(q, self.dk[i], self.dv[i], masks[dc.layer_types[i]], None)
            x = self._out_mlp(x, o, w, dc.rms_norm_eps)
        return self.target.lm_head(d.norm(x)[:, 1:])

    def draft(self, bonus: Tensor) -> Tensor:
        B, dev = self.drafter.config.block_size, self.target.device
        new = self.pending
        if new.shape[1] > B:  # the prompt: written eagerly, whatever its length
            first = torch.tensor(self.ctx_len, device=dev)
            for i, (kc, vc) in enumerate(self._ctx_kv(new, first)):
                self.dk[i][:, :, self.ctx_len:self.ctx_len + new.shape[1]] = kc
                self.dv[i][:, :, self.ctx_len:self.ctx_len + new.shape[1]] = vc
            self.ctx_len += new.shape[1]
            new = new[:, :0]
        if self.ctx_len + new.shape[1] != self.length:
            raise RuntimeError(f"drafter context {self.ctx_len}+{new.shape[1]} != target length {self.length}")
        self._feats[:, :new.shape[1]] = new  # rows past it: stale, overwritten by the block's own keys
        out = self.draft_step(self._feats, bonus.view(1), self._ctx_len.fill_(self.ctx_len), self._start.fill_(self.length))
        self.ctx_len = self.length
        return out
