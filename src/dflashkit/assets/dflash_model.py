"""DFlash block-diffusion draft model for Transformers' `trust_remote_code` loaders.

Written next to an exported drafter as `dflash.py` by `dflashkit export --format reference`;
`config.json` maps `AutoModel` to `dflash.DFlashDraftModel`. Self-contained: torch and
transformers only.

    draft = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)
    features = extract_context_feature(target_out.hidden_states, draft.target_layer_ids)
    hidden = draft(noise_embedding, features, position_ids)   # logits = target.lm_head(hidden)

Semantics (the same as dflashkit's drafter):

* Context = RMSNorm(fc(concat of the tapped target layers)); tap `k` is the *output* of target
  decoder layer `k`, i.e. `output_hidden_states[k + 1]`.
* Block = `[anchor token, MASK x (block_size - 1)]`, embedded with the target's embedding; the
  anchor keeps its own position, slot `k` sits at `anchor + k` and predicts that position's token
  (anchor-first, `dflash_config.sample_from_anchor`: the token after it, slot 0 included).
* Queries come from the block only; keys/values are `[context ; block]`. A block query sees every
  context token given (all of them precede the anchor) and every slot of its block
  (bidirectional); a `sliding_attention` layer sees only context positions `>= anchor - window`.
* Qwen3-style layers: pre-norm RMSNorm, per-head q/k RMSNorm, RoPE, grouped-query attention,
  SwiGLU MLP; a final RMSNorm. No embedding and no LM head: the target's are used.
* DFlash 2 (`dflash_config.conv_kernel_size`): each layer's attention and MLP sit between two
  causal convolutions inside the block, their per-position kernels projected from the sublayer's
  input (`BlockConv`). The family's heads (DFlash 2's `candidate_selector`, DSpark's
  `markov_head` / `confidence_head`) read the hidden states this returns; the model holds their
  tensors under the same names, for the caller's own use (`family_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config


def extract_context_feature(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """Transformers' `output_hidden_states` tuple (index 0 = embeddings) -> [b, t, n_taps * H]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [b, 1, t, head_dim] for positions [b, t] (half-rotation layout of Llama/Qwen)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, ctx: Tensor, rope_block: tuple[Tensor, Tensor], rope_ctx: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *rope_block)
        k_ctx, v_ctx = self._keys_values(ctx, *rope_ctx)
        k_blk, v_blk = self._keys_values(x, *rope_block)
        k, v = torch.cat([k_ctx, k_blk], dim=-2), torch.cat([v_ctx, v_blk], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def block_conv(x: Tensor, delta: Tensor, base: Tensor, group: int) -> Tensor:
    """Causal depthwise convolution over one block per row: x [b, q, H], delta [b, q, k, G] (a
    kernel per position for each group of `group` channels), base [k, H]. Position t is
    sum_j x[t - j] * (base[j] + delta[t, j]); taps before the block's first position read zero."""
    b, q, H = x.shape
    xs = x.view(b, q, H // group, group)
    out = torch.zeros_like(xs)
    for j in range(min(base.shape[0], q)):
        shifted = torch.cat([xs.new_zeros(b, j, H // group, group), xs[:, :q - j]], dim=1)
        out = out + shifted * (base[j].to(x.dtype).view(H // group, group) + delta[:, :, j, :, None])
    return out.view(b, q, H)


class BlockConv(nn.Module):
    """DFlash 2's two convolutions around one sublayer, both kernels projected from its input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def around(self, sublayer, x: Tensor) -> Tensor:
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        y = sublayer(block_conv(x, kernels[:, :, 0], self.base_kernel[0], self.group_size))
        return block_conv(y, kernels[:, :, 1], self.base_kernel[1], self.group_size)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        k = config.dflash_config.get("conv_kernel_size")
        if k is not None:
            group = config.dflash_config.get("conv_group_size", 16)
            self.attention_conv = BlockConv(config.hidden_size, k, group)
            self.mlp_conv = BlockConv(config.hidden_size, k, group)

    def forward(self, x: Tensor, ctx: Tensor, rope_block, rope_ctx, mask: Tensor | None) -> Tensor:
        # The context is already normalised by `hidden_norm`; only the block stream is pre-normed.
        def attend(h: Tensor) -> Tensor:
            return self.self_attn(h, ctx, rope_block, rope_ctx, mask)

        if not hasattr(self, "attention_conv"):
            x = x + attend(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.attention_conv.around(attend, self.input_layernorm(x))
        return x + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(x))


def family_heads(config: Qwen3Config) -> dict[str, nn.Module]:
    """Holders of the family's head tensors, by the names and shapes of the reference models."""
    d, H, V, heads = config.dflash_config, config.hidden_size, config.vocab_size, {}
    if d.get("selector_rank"):
        r = d["selector_rank"]
        heads["candidate_selector"] = sel = nn.Module()
        sel.predecessor_codebook, sel.successor_codebook = nn.Parameter(torch.zeros(V, r)), nn.Parameter(torch.zeros(V, r))
        sel.hidden_projection = nn.Linear(H, r, bias=False)
    r = d.get("markov_rank", 0)
    if r:
        heads["markov_head"] = markov = nn.Module()
        markov.markov_w1, markov.markov_w2 = nn.Embedding(V, r), nn.Linear(r, V, bias=False)
        kind = d.get("markov_head_type", "vanilla")
        if kind != "vanilla":
            setattr(markov, "gate_proj" if kind == "gated" else "joint_proj",
                    nn.Linear(H + r, r) if kind == "gated" else nn.Linear(2 * r + H, 3 * r))
    if d.get("enable_confidence_head"):
        heads["confidence_head"] = conf = nn.Module()
        conf.proj = nn.Linear(H + (r if d.get("confidence_head_with_markov") else 0), 1)
    return heads


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids: list[int] = [int(i) for i in dflash["target_layer_ids"]]
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        self.layer_types = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
        self.sliding_window = config.sliding_window
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        for name, module in family_heads(config).items():
            self.add_module(name, module)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        noise_embedding: Tensor,  # [b, q, H] target embeddings of the block [anchor, MASK...]
        target_hidden: Tensor,  # [b, c, n_taps * H] tapped target features of the context tokens
        position_ids: Tensor,  # [b, c + q] positions of the context tokens, then of the block slots
        attention_mask: Tensor | None = None,  # optional bool [b, 1, q, c + q], True = may attend
    ) -> Tensor:  # [b, q, H] final hidden states; the target's LM head turns them into logits
        c = target_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        x = noise_embedding.to(ctx.dtype)
        rope_ctx = rotary(position_ids[:, :c], self.config.head_dim, self.rope_theta, x.dtype)
        rope_block = rotary(position_ids[:, c:], self.config.head_dim, self.rope_theta, x.dtype)
        masks = {t: self._mask(t, position_ids, c, attention_mask) for t in set(self.layer_types)}
        for layer, layer_type in zip(self.layers, self.layer_types):
            x = layer(x, ctx, rope_block, rope_ctx, masks[layer_type])
        return self.norm(x)

    def _mask(self, layer_type: str, position_ids: Tensor, c: int, attention_mask: Tensor | None) -> Tensor | None:
        if layer_type != "sliding_attention":
            return attention_mask
        # Context positions below `anchor - window` fall out of a sliding layer's view.
        anchor = position_ids[:, c:c + 1]  # [b, 1]
        keep_ctx = position_ids[:, :c] >= anchor - self.sliding_window  # [b, c]
        q = position_ids.shape[1] - c
        keep = torch.cat([keep_ctx, keep_ctx.new_ones(keep_ctx.shape[0], q)], dim=1)[:, None, None, :]
        keep = keep.expand(-1, 1, q, -1)
        return keep if attention_mask is None else keep & attention_mask
