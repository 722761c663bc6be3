"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one pass.

Queries come from the block tokens only; keys/values are projections of the fused target
context followed by the block tokens. One `forward` serves both paths:

* inference: new context features are written into a KV cache (`decode.cache.KVCache`), one block of queries;
* training: a whole sequence's context plus many blocks at once, under the mask of `masks.py`.

The drafter owns no embedding and no LM head: the target's, frozen, are used (see `target.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit import family, few_attention
from dflashkit import masks as masks_mod
from dflashkit.kernels import heads
from dflashkit.kernels.packed import fused_linear

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}
KIND_NAMES = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}
# The family's config fields, written into `dflash_config` where they differ from these defaults
# (a DFlash drafter's config.json holds none of them).
FAMILY_FIELDS = {"conv_kernel_size": None, "conv_group_size": 16, "selector_rank": None, "selector_top_k": 16,
                 "markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": False,
                 "confidence_head_with_markov": False, "sample_from_anchor": False}
WRITTEN = {"dflash": (), "dflash2": ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
           "dspark": ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                      "sample_from_anchor")}  # always, for the kind: its fields say what it is


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """docs/conventions.md: n == 1 -> [L // 2]; else evenly from layer 1 to layer L - 3: round(1 + i (L-4)/(n-1)).

    On shallow targets that formula repeats layers (L=4, n=2: [1, 1]); then the taps are spread
    evenly over layers 1..L-2 (0..L-2 when that is too few), distinct and never the last layer."""
    L, n = num_target_layers, num_taps
    if n < 1:
        raise ValueError(f"num_taps must be >= 1, got {n}")
    if n == 1:
        return [L // 2]
    if n > L - 1:
        raise ValueError(f"a target with {L} layers is too shallow for {n} distinct taps (at most {L - 1})")
    ids = [round(1 + i * (L - 4) / (n - 1)) for i in range(n)] if L >= 4 else []
    if len(set(ids)) == n:
        return ids
    lo, hi = (1 if n <= L - 2 else 0), L - 2
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def default_gamma(block_size: int) -> float:
    """Slot-decay constant of the loss: 7 for B=16, 5 for B=10, 4 for B=8 (docs/conventions.md)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@dataclass
class DrafterConfig:
    """Architecture of a drafter; serialises to the reference `config.json` (a Qwen3 config)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False
    # The family's optional modules (family.py), under the reference names; None / 0 / False: absent.
    conv_kernel_size: int | None = None  # DFlash 2: taps of the block convolutions
    conv_group_size: int = 16  # DFlash 2: channels sharing one dynamic kernel
    selector_rank: int | None = None  # DFlash 2: rank of the candidate selector
    selector_top_k: int = 16  # DFlash 2: unary candidates per slot
    markov_rank: int = 0  # DSpark: rank of the Markov head
    markov_head_type: str = "vanilla"  # DSpark: vanilla | gated | rnn
    enable_confidence_head: bool = False  # DSpark
    confidence_head_with_markov: bool = False  # DSpark: the head also reads the Markov embedding
    sample_from_anchor: bool = False  # anchor-first layout: slot k predicts the token at anchor + k + 1
    # Keys of a foreign config.json we do not interpret (bos/eos ids, dtype...), kept on round trip.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"drafter config field '{name}': expected {expected}, got {getattr(self, name)!r}")

        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"a list of {self.num_hidden_layers} entries (one per layer)")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise bad("layer_types", f"entries among {LAYER_TYPES}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise bad("sliding_window", "a positive int when a layer is 'sliding_attention'")
        if self.block_size < 2:
            raise bad("block_size", "an int >= 2")
        if not self.target_layer_ids:
            raise bad("target_layer_ids", "a non-empty list of target layer indices")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise bad("target_layer_ids", f"indices in [0, {self.num_target_layers - 1}] (num_target_layers={self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", f"a token id in [0, {self.vocab_size - 1}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}")
        self._validate_family(bad)

    def _validate_family(self, bad) -> None:
        if self.conv_kernel_size is not None and not 1 <= self.conv_kernel_size <= self.block_size:
            raise bad("conv_kernel_size", f"an int in [1, block_size={self.block_size}]")
        if self.conv_kernel_size is not None and (self.conv_group_size < 1 or self.hidden_size % self.conv_group_size):
            raise bad("conv_group_size", f"a divisor of hidden_size={self.hidden_size}")
        if self.selector_rank is not None and self.selector_rank < 1:
            raise bad("selector_rank", "a positive int (or null: no selector)")
        if self.selector_rank is not None and not 1 <= self.selector_top_k <= self.vocab_size:
            raise bad("selector_top_k", f"an int in [1, vocab_size={self.vocab_size}]")
        if self.markov_rank < 0:
            raise bad("markov_rank", "an int >= 0 (0: no Markov head)")
        if self.markov_head_type not in family.MARKOV_KINDS:
            raise bad("markov_head_type", f"one of {family.MARKOV_KINDS}")
        if self.confidence_head_with_markov and self.enable_confidence_head and not self.markov_rank:
            raise bad("confidence_head_with_markov", "false when markov_rank is 0 (there is no Markov embedding to read)")
        if self._declares_dflash2() and self._declares_dspark():
            raise bad("markov_rank", "0 when DFlash 2's modules are declared (a drafter is DFlash 2 or DSpark, not both)")

    def _declares_dflash2(self) -> bool:
        return self.conv_kernel_size is not None or self.selector_rank is not None

    def _declares_dspark(self) -> bool:
        return bool(self.markov_rank) or self.enable_confidence_head

    @property
    def kind(self) -> str:
        """'dflash', 'dflash2' or 'dspark': which of the family the declared modules make."""
        return "dflash2" if self._declares_dflash2() else "dspark" if self._declares_dspark() else "dflash"

    @property
    def draft_slots(self) -> range:
        """The block slots that predict a token: 1..B-1 (bonus-first), 0..B-1 (anchor-first)."""
        return range(0 if self.sample_from_anchor else 1, self.block_size)

    def summary(self) -> str:
        """The kind, the modules its config declares and the block's layout, in one line."""
        parts = []
        if self.conv_kernel_size is not None:
            parts.append(f"block convolutions (conv_kernel_size {self.conv_kernel_size}, conv_group_size {self.conv_group_size})")
        if self.selector_rank is not None:
            parts.append(f"candidate selector (selector_rank {self.selector_rank}, selector_top_k {self.selector_top_k})")
        if self.markov_rank:
            parts.append(f"Markov head (markov_rank {self.markov_rank}, {self.markov_head_type})")
        if self.enable_confidence_head:
            parts.append("confidence head" + (" (reads the Markov embedding)" if self.confidence_head_with_markov else ""))
        layout = "anchor-first: slot k drafts the token after anchor + k" if self.sample_from_anchor else \
            "bonus-first: slot k >= 1 drafts the token at anchor + k"
        return f"{KIND_NAMES[self.kind]}: {', '.join(parts) or 'no optional modules'}; {layout}"

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    # ---- reference format -------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        ids, mask_id = d.pop("target_layer_ids"), d.pop("mask_token_id")
        declared = {k: d.pop(k) for k in FAMILY_FIELDS}
        declared = {k: v for k, v in declared.items() if k in WRITTEN[self.kind] or v != FAMILY_FIELDS[k]}
        ref = {
            **extra,
            **d,
            "architectures": [ARCHITECTURES[self.kind]],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "use_sliding_window": SLIDING in self.layer_types,
            "max_window_layers": self.num_hidden_layers,
            "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": ids, **declared},
        }
        return dict(sorted(ref.items()))

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        if "mask_token_id" not in dflash:
            raise ValueError(f"{source}: 'dflash_config.mask_token_id' is missing; a drafter needs the id of its mask token")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"{source}: rope_scaling {scaling} is not supported (only plain RoPE)")
        if "target_layer_ids" not in dflash:
            raise ValueError(f"{source}: 'dflash_config.target_layer_ids' is missing; the layer ids must be stored, never re-derived")
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_target_layers"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        bad = [f"{k}={d[k]!r}" for k in [*required, "num_key_value_heads", "head_dim"]
               if k in d and (isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1)]
        if bad:
            raise ValueError(f"{source}: {', '.join(bad)}: expected positive integers")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "target_layer_ids", "mask_token_id", *FAMILY_FIELDS)}
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        kwargs.update(family_fields(dflash, source))
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if kwargs.get("layer_types") is None:
            kwargs.pop("layer_types", None)
        for k in ("architectures", "model_type", "hidden_act", "attention_dropout", "rope_scaling", "rope_parameters",
                  "tie_word_embeddings", "use_sliding_window", "max_window_layers", "auto_map", "dtype", "torch_dtype"):
            d.pop(k, None)
        try:
            return cls(**kwargs, target_layer_ids=list(dflash["target_layer_ids"]),
                       mask_token_id=int(dflash["mask_token_id"]), extra=d)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def family_fields(dflash: dict[str, Any], source: str) -> dict[str, Any]:
    """The family's fields of a `dflash_config`, each checked for its type (values by `validate`)."""
    out = {}
    for k, default in FAMILY_FIELDS.items():
        if k not in dflash or dflash[k] is None and default is not None:
            continue
        v, kind = dflash[k], type(default) if default is not None else int
        if not (v is None or isinstance(v, kind) and (kind is not int or not isinstance(v, bool))):
            raise ValueError(f"{source}: 'dflash_config.{k}' is {v!r}: expected {'true or false' if kind is bool else kind.__name__}")
        out[k] = v
    return out


# ---- building blocks --------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [b, 1, t, head_dim] for integer positions [b, t] (Llama/Qwen half-rotation)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [b, t, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass
class CacheSlots:
    """Where one inference block's keys/values go: a `decode.cache.KVCache` of the drafter's
    layers, the slots [b, c + B] of the new context's rows then the block's (no slot twice: one
    store writes both), the RoPE tables at those slots' positions (made once per pass, in
    `DFlashDrafter.forward`), the `n` slots every query looks at, and, inside a layer, the
    layer's index in the cache."""

    kv: Any
    slots: Tensor
    n: int
    rope: tuple[Tensor, Tensor] | None = None
    layer: int = 0


FEW_QUERIES = 128  # queries of a one-row CUDA pass up to which `attend_few` replaces SDPA


def attend_few(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention written out (scores and softmax in fp32, then p v), for passes of few queries on
    CUDA: q [b, kv, g*t, d] (the g query heads of each KV group folded into the query axis), k/v
    [b, kv, K, d], mask additive [b, 1, g*t, K]. There a flash kernel has a thread block per KV
    head and walks all K keys in each: on an H200, 22 us a call for 16 queries of a Qwen3-8B layer
    over 768 slots, against 9 us for these two small GEMMs and one fused softmax (compiled). Only
    for one row: from 4 rows of 16 queries at SmolLM2's head shapes (9 / 3 / 64) the flash kernel
    wins (18 against 9 us), at Qwen3-8B's it still loses (12 against 9 us)
    (benchmarks/bench_attention.py, docs/benchmarks.md). Where `few_attention.use` takes a pass
    (long caches, several rows), its callers (`attend_heads`, the static runner) call
    `few_attention.attend` instead, which fuses the three into one pass over the keys and a
    combine: it never writes the scores out."""
    s = (q @ k.transpose(-1, -2)).float() * scale + mask
    return s.softmax(-1).to(v.dtype) @ v


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Any, gqa: bool, decoding: bool = False) -> Tensor:
    """q [b, h, q, d], k/v [b, kv, K, d]; mask: None, additive or bool [b|1, 1, q, K] or a
    FlexAttention BlockMask; gqa: kv < h, from the config (a comparison of shapes is symbolic under
    torch.compile(dynamic=True), and SDPA refuses it: the compiled step broke in two at every
    layer). Few queries on CUDA go through `attend_few`: one row always, several rows of a draft
    (`decoding`: no backward) where `few_attention.use` takes them, as the target's verification
    does (at batch 32 on an H100, SDPA's cuDNN kernel and its mask cost 48 us a drafter layer)."""
    if masks_mod.is_block_mask(mask):
        return masks_mod.flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    b, _, t, _ = q.shape
    if q.is_cuda and t <= FEW_QUERIES and torch.is_tensor(mask) and mask.dtype != torch.bool \
            and (b == 1 or decoding and few_attention.use(b, k.shape[-2], q.shape[-1], q.dtype, q.device)):
        return attend_heads(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attend_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """`attend_few` in `attend`'s layout: q [b, h, t, d] (query head i reads KV head i // g),
    k/v [b, kv, K, d], mask additive [b, 1, t, K] -> [b, h, t, d]. The fused kernel writes each
    token's heads together (`few_attention.attend`'s tokens), returned as a transposed view: the
    caller's transpose back to [b, t, h * d] for the output projection then copies nothing."""
    b, h, t, d = q.shape
    g = h // k.shape[1]
    q, mask = q.reshape(b, k.shape[1], g * t, d), mask.repeat(1, 1, g, 1)
    if few_attention.use(b, k.shape[-2], d, q.dtype, q.device):
        return few_attention.attend(q, k, v, mask, d ** -0.5, t).view(b, t, h, d).transpose(1, 2)
    return attend_few(q, k, v, mask, d ** -0.5).view(b, h, t, d)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d, kv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # A decoding engine's copy may hold k_proj's and v_proj's weights as one [k; v] tensor
        # (`decode.static.fuse_drafter`): decoding then projects them in one GEMM (training never does).
        self.kv_weight: Tensor | None = None

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor, fused: bool = False) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        if fused and self.kv_weight is not None:
            k, v = fused_linear(x, self.kv_weight, self.k_proj).split(self.kv * self.d, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        k = self.k_norm(k.view(b, t, self.kv, self.d)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(b, t, self.kv, self.d).transpose(1, 2)

    def store(self, kv: Any, layer: int, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor) -> None:
        """Decoding: the keys and values of x [b, t, hidden] at slots [b, t] into layer `layer` of
        the cache `kv` (`decode.cache.KVCache`). With [k; v] fused, on CUDA, the key norm, RoPE and
        both stores are one kernel after the GEMM (`kernels.heads`), where Inductor's norm-and-RoPE
        kernel and two scatters ran: the scatters alone took 41 us of a 32-row draft (4 layers) on an H100."""
        if self.kv_weight is not None and heads.available(x, self.d, cos.shape[-1], False, True):
            kv.store_heads(layer, fused_linear(x, self.kv_weight, self.k_proj), self.k_norm.weight, self.k_norm.eps,
                           cos, sin, slots)
        else:
            kv.store(layer, *self._kv(x, cos, sin, fused=True), slots)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_c: tuple[Tensor, Tensor] | None,
                mask: Any, cache: CacheSlots | None) -> Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.h, self.d)).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        if cache is None:  # training: the whole context, then every block
            k_blk, v_blk = self._kv(x, *rope_q)
            k_ctx, v_ctx = self._kv(ctx, *rope_c)
            k, v = torch.cat([k_ctx, k_blk], dim=-2), torch.cat([v_ctx, v_blk], dim=-2)
        else:  # decoding: the new context and the block as one stream: one projection, one store a layer
            self.store(cache.kv, cache.layer, torch.cat([ctx, x], dim=1), *cache.rope, cache.slots)
            k, v = cache.kv.view(cache.layer, cache.n)
        out = attend(q, k, v, mask, self.kv != self.h, decoding=cache is not None)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: Tensor | None = None  # [gate; up] as one tensor, for decoding (as `Attention.kv_weight`)

    def forward(self, x: Tensor, fused: bool = False) -> Tensor:
        if fused and self.gate_up is not None:
            gate, up = fused_linear(x, self.gate_up, self.gate_proj).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.conv_kernel_size is not None:  # DFlash 2
            self.attention_conv = family.BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = family.BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: Tensor, ctx: Tensor, rope_q, rope_c, mask, cache, block: int) -> Tensor:
        """block: the positions of one block in the stream x (its blocks follow one another)."""
        # The context is already normalised by `hidden_norm`; only the block stream is pre-normed.
        convs = getattr(self, "attention_conv", None), getattr(self, "mlp_conv", None)
        h = self.input_layernorm(x)
        if convs[0] is None:
            x = x + self.self_attn(h, ctx, rope_q, rope_c, mask, cache)
            return x + self.mlp(self.post_attention_layernorm(x), fused=cache is not None)
        h, out_kernel = convs[0].prepare(h, block)
        x = x + convs[0].finish(self.self_attn(h, ctx, rope_q, rope_c, mask, cache), out_kernel, block)
        h, out_kernel = convs[1].prepare(self.post_attention_layernorm(x), block)
        return x + convs[1].finish(self.mlp(h, fused=cache is not None), out_kernel, block)


class DFlashDrafter(nn.Module):
    """Tensor names equal the reference format (`fc`, `hidden_norm`, `layers.{i}...`, `norm`)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        c = config
        if c.selector_rank is not None:  # DFlash 2
            self.candidate_selector = family.CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)
        if c.markov_rank:  # DSpark
            self.markov_head = family.MarkovHead(c.vocab_size, c.hidden_size, c.markov_rank, c.markov_head_type)
        if c.enable_confidence_head:
            self.confidence_head = family.ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        self.reset_family()

    def reset_family(self) -> None:
        """The family's modules as fresh: convolutions identity, Markov bias zero, selector random.
        On a trained DFlash backbone this is DFlash 2's or DSpark's starting point."""
        for m in self.modules():
            if isinstance(m, (family.BlockConv, family.CandidateSelector, family.MarkovHead)):
                m.reset_parameters()

    def selector(self) -> family.CandidateSelector | None:
        return getattr(self, "candidate_selector", None)

    def markov(self) -> family.MarkovHead | None:
        return getattr(self, "markov_head", None)

    def confidence(self) -> family.ConfidenceHead | None:
        return getattr(self, "confidence_head", None)

    def forward(
        self,
        block_emb: Tensor,  # [b, q, H] target embeddings of the block tokens (all blocks, concatenated)
        ctx_features: Tensor,  # [b, c, n_taps * H] raw tapped target features of new context tokens
        block_pos: Tensor,  # [b, q] positions of block slots (anchor + k)
        ctx_pos: Tensor,  # [b, c] positions of the new context tokens
        layer_masks: dict[str, Any],  # layer type -> mask over keys ([ctx, blocks], or the cache's slots)
        cache: CacheSlots | None = None,
    ) -> Tensor:  # [b, q, H] final hidden states; the target's LM head turns them into logits
        cfg = self.config
        ctx = self.context(ctx_features)
        x = block_emb.to(ctx.dtype)
        if cache is None:
            rope_c, rope_q = self.rope(ctx_pos, x.dtype), self.rope(block_pos, x.dtype)
            lengths_dynamic((x, ctx, *rope_q, *rope_c), layer_masks.values())
        else:  # one table for the context's and the block's slots, stored as one stream (`Attention.forward`)
            cos, sin = self.rope(torch.cat([ctx_pos, block_pos], dim=1), x.dtype)  # [b, 1, c + q, d]
            c = ctx.shape[1]
            rope_c, rope_q = None, (cos[:, :, c:], sin[:, :, c:])  # (the context's rows: `cache.rope`)
            cache = replace(cache, rope=(cos, sin))
            self.allocate(cache.kv, x)  # the buffers exist before any layer takes its own view of them
        block = cfg.block_size if cache is None else x.shape[1]  # (decoding: one block, maybe shorter)
        for i, layer in enumerate(self.layers):
            mine = None if cache is None else replace(cache, layer=i)
            x = layer(x, ctx, rope_q, rope_c, layer_masks[cfg.layer_types[i]], mine, block)
        return self.norm(x)

    def context(self, ctx_features: Tensor) -> Tensor:
        """Raw tapped features [b, c, n_taps * H] -> the context stream every layer's keys and
        values are made from [b, c, H]."""
        return self.hidden_norm(self.fc(ctx_features))

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def allocate(self, kv: Any, like: Tensor) -> None:
        """The inference cache's buffers, for rows like `like` [b, ...], before any layer views them."""
        kv.allocate(like.new_empty(like.shape[0], self.config.num_key_value_heads, 0, self.config.head_dim))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lengths_dynamic(tables: tuple[Tensor, ...], masks: Any) -> None:
    """Marks the rows and lengths of the layers' training inputs dynamic before their first
    compilation (`layer.compile()` in the trainer): every dimension of `tables` (hidden states,
    RoPE tables) but the last (hidden size, head dim), and every dimension of the `masks`, a
    FlexAttention BlockMask's tile tables and its rule's tensors included. Each batch is padded to
    its own length, and under automatic dynamic shapes the layers compiled static first, then again
    for every size that changed. With the marks, a training job's first steps compiled 6 graphs
    instead of 8 on an H200 (FlexAttention: a BlockMask's lengths are plain integers, which still
    compile once static), 4 instead of 6 on a CPU (dense masks); dynamic=True would make the
    model's sizes symbolic too, for 5 % slower steps (docs/benchmarks.md, Training)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in tables:
        for dim in range(t.dim() - 1):
            mark(t, dim)
    for m in masks:
        parts = [m] if torch.is_tensor(m) else [*m.as_tuple(), *(c.cell_contents for c in m.mask_mod.__closure__ or ())]
        for t in parts:
            if torch.is_tensor(t):
                for dim in range(t.dim()):
                    mark(t, dim)


def drafter_config_for_target(
    target_config: Any,
    mask_token_id: int,
    *,
    num_layers: int = 5,
    num_taps: int = 5,
    target_layer_ids: list[int] | None = None,
    block_size: int = 16,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
) -> DrafterConfig:
    """A drafter shaped like the target's layers (hidden size, heads, RoPE), defaults of docs/conventions.md."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    L = tc.num_hidden_layers
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(L, num_taps)
    if layer_types is None and "linear_attention" in (getattr(tc, "layer_types", None) or []) and num_layers > 1:
        # Hybrid targets (Qwen3.5 / 3.6, Qwen3-Next): the published drafters' shape, sliding windows of 2048 but one full layer.
        layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        sliding_window = sliding_window or 2048
    return DrafterConfig(
        hidden_size=tc.hidden_size,
        # A mixture-of-experts target has no dense MLP width: 3x hidden, the ratio of Qwen3's dense models
        # (Qwen3-Next's config names one, the width of its `mlp_only_layers`: that one is taken).
        intermediate_size=intermediate_size or getattr(tc, "intermediate_size", None) or 3 * tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        vocab_size=tc.vocab_size,
        num_target_layers=L,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
        layer_types=list(layer_types) if layer_types else [],
        sliding_window=sliding_window,
    )


# ---- the two paths ------------------------------------------------------------------------


def block_token_ids(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, n] anchor tokens -> [b, n * B] blocks `[anchor, MASK x (B-1)]`."""
    ids = torch.full((*anchor_tokens.shape, block_size), mask_token_id, dtype=torch.long, device=anchor_tokens.device)
    ids[..., 0] = anchor_tokens
    return ids.flatten(-2)


def draft_block(drafter: DFlashDrafter, embed, cache: Any, new_features: Tensor, bonus: Tensor,
                counts: list[int] | None = None) -> Tensor:
    """Inference path: row i appends the features of its newly verified tokens (the first
    counts[i] rows of new_features [b, c, n_taps * H]; all c by default) to the context cache
    (`decode.cache.drafter_cache`), then drafts one block `[bonus, MASK...]` at start_i, the bonus
    token's position (= the row's context length afterwards). Returns hidden states [b, B, H];
    slot k predicts the token at position start + k (slot 0 is the bonus itself)."""
    b, c = new_features.shape[:2]
    dev = new_features.device
    counts = [c] * b if counts is None else list(counts)
    if not cache.batch:  # a fresh cache
        cache.start(b, dev)
    elif cache.batch != b:
        raise ValueError(f"draft_block: the cache holds {cache.batch} rows, the features {b}")
    B = drafter.config.block_size
    n = max(length + k for length, k in zip(cache.lengths, counts)) + B
    cache.reserve(max(cache.lengths) + c + B)  # (padding rows go past the block: `draft_step`)
    start = cache.lengths_t + torch.tensor(counts, device=dev)
    h = draft_step(drafter, embed, cache, new_features, bonus, cache.lengths_t, start, n)
    cache.advance(counts)
    return h


def draft_step(drafter: DFlashDrafter, embed, cache: Any, new_features: Tensor, bonus: Tensor, ctx_start: Tensor,
               start: Tensor, n: int, block: int | None = None) -> Tensor:
    """The tensor part of `draft_block` (no host synchronisation, and every tensor it reads
    passed in, so CUDA graphs can capture it): context rows at ctx_start [b] + j, the block at
    start [b], attention over n slots of `cache` under the rule of `masks.visible`. Rows of a row's
    context past its own (padding: rows share the width c) are written past its block, where no
    query looks and a later context overwrites them: the cache needs room for ctx_start + c + B
    slots. (One store writes context and block, and a scatter that wrote a slot twice would keep
    either write.) block: positions drafted, the bonus included (default the drafter's
    `block_size`; fewer drafts fewer tokens at a lower cost, `decode.engine.Engine`)."""
    cfg = drafter.config
    B = block or cfg.block_size
    c, dev = new_features.shape[1], new_features.device
    ctx_slots = ctx_start[:, None] + torch.arange(c, device=dev)
    ctx_slots = torch.where(ctx_slots < start[:, None], ctx_slots, ctx_slots + B)
    blk_slots = start[:, None] + torch.arange(B, device=dev)
    emb = embed(block_token_ids(bonus[:, None], B, cfg.mask_token_id))
    lm = masks_mod.layer_masks(masks_mod.inference_layout(start, B, n), cfg.layer_types, cfg.sliding_window)
    lm = {t: additive(m, new_features.dtype) for t, m in lm.items()}
    return drafter(emb, new_features, blk_slots, ctx_slots, lm, CacheSlots(cache, torch.cat([ctx_slots, blk_slots], 1), n))


def write_context(drafter: DFlashDrafter, cache: Any, new_features: Tensor, slots: Tensor) -> None:
    """The context half of `draft_step` alone: new context rows' keys and values [b, c] into
    `cache` at `slots` [b, c] (their positions), with no block drafted after them. A prompt that
    joins a running batch needs only this; the batch's next draft makes its block."""
    ctx = drafter.context(new_features)
    rope_c = drafter.rope(slots, ctx.dtype)
    drafter.allocate(cache, ctx)
    for i, layer in enumerate(drafter.layers):
        layer.self_attn.store(cache, i, ctx, *rope_c, slots)


def additive(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean attention mask as 0 / -inf in `dtype`; anything else as it is. SDPA converts a
    boolean mask on every call: converted once, one mask serves every layer."""
    if not (torch.is_tensor(mask) and mask.dtype == torch.bool):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def training_hidden(drafter: DFlashDrafter, embed, input_ids: Tensor, features: Tensor, anchors: Tensor,
                    ctx_valid: Tensor | None = None, backend: str = "sdpa") -> Tensor:
    """Training path: whole-sequence context, `n` blocks per sequence at once.

    input_ids [b, T]; features [b, T, n_taps * H] (token t's taps, fed to `fc`);
    anchors [b, n]. Returns hidden states [b, n * B, H] (block j's slot k at j * B + k)."""
    cfg = drafter.config
    b, T = input_ids.shape
    if ctx_valid is None:
        ctx_valid = torch.ones(b, T, dtype=torch.bool, device=input_ids.device)
    emb = embed(block_token_ids(input_ids.gather(1, anchors), cfg.block_size, cfg.mask_token_id))
    layout = masks_mod.training_layout(anchors, cfg.block_size, ctx_valid)
    lm = masks_mod.layer_masks(layout, cfg.layer_types, cfg.sliding_window, backend)
    # SDPA turns a boolean mask into an additive one on every call, and backward keeps each layer's
    # copy ([b, 1, q, K] each): convert once, in the compute dtype (the features'), for all layers.
    lm = {t: additive(m, features.dtype) for t, m in lm.items()}
    ctx_pos = torch.arange(T, device=input_ids.device).expand(b, -1)
    return drafter(emb, features, masks_mod.block_positions(anchors, cfg.block_size), ctx_pos, lm)


def grow(drafter: DFlashDrafter, extra: int) -> DFlashDrafter:
    """`drafter` with `extra` full-attention layers appended before its final norm. A new layer's
    output projections (attention's o_proj, the MLP's down_proj) start at zero, so it adds nothing
    to the residual stream: the grown drafter drafts exactly as the original did, and training
    starts from its acceptance with more capacity (the other new weights are random, so the zero
    projections get gradients from the first step)."""
    if extra < 1:
        raise ValueError(f"drafter.grow_layers: expected an int >= 1, got {extra!r}")
    cfg = drafter.config
    grown = DFlashDrafter(replace(cfg, num_hidden_layers=cfg.num_hidden_layers + extra,
                                  layer_types=cfg.layer_types + [FULL] * extra))
    ref = next(drafter.parameters())
    grown.to(device=ref.device, dtype=ref.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in grown.layers[cfg.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def family_config(cfg: DrafterConfig, settings: Any) -> DrafterConfig:
    """`cfg` declaring the modules of `settings.kind` (`config.DrafterSettings`) with its fields."""
    s = settings
    first = s.sample_from_anchor if s.sample_from_anchor is not None else s.kind == "dspark"
    if s.kind == "dflash2":
        return replace(cfg, conv_kernel_size=s.conv_kernel_size, conv_group_size=s.conv_group_size,
                       selector_rank=s.selector_rank, selector_top_k=s.selector_top_k, sample_from_anchor=first)
    if s.kind == "dspark":
        return replace(cfg, markov_rank=s.markov_rank, markov_head_type=s.markov_head_type,
                       enable_confidence_head=s.enable_confidence_head,
                       confidence_head_with_markov=s.confidence_head_with_markov, sample_from_anchor=first)
    return replace(cfg, sample_from_anchor=first)


def upgraded(drafter: DFlashDrafter, settings: Any) -> DFlashDrafter:
    """A DFlash drafter as the start of a DFlash 2 or DSpark one: the backbone's weights, the new
    modules fresh (`DFlashDrafter.reset_family`): it drafts exactly as before until trained."""
    cfg = drafter.config
    if cfg.kind != "dflash":
        raise ValueError(f"drafter.kind={settings.kind!r}: drafter.init_from is already a {cfg.kind} drafter; "
                         "leave drafter.kind unset to continue training it")
    if settings.sample_from_anchor and not cfg.sample_from_anchor:
        raise ValueError("drafter.sample_from_anchor: a bonus-first DFlash drafter cannot start an anchor-first one "
                         "(its slots predict other positions); set drafter.sample_from_anchor=false")
    settings = settings.model_copy(update={"sample_from_anchor": cfg.sample_from_anchor})
    ref = next(drafter.parameters())
    out = DFlashDrafter(family_config(cfg, settings)).to(device=ref.device, dtype=ref.dtype)
    missing, unexpected = out.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected:
        raise ValueError(f"upgrading the drafter: tensors {unexpected[:4]} have no place in a {out.config.kind} drafter")
    return out


def new_drafter(target: Any, settings: Any) -> DFlashDrafter:
    """A fresh drafter for `target` (a `dflashkit.target.Target`) from `config.DrafterSettings`."""
    from dflashkit.vocab import default_mask_token_id

    mask_id = settings.mask_token_id
    if mask_id is None:
        if target.tokenizer is None:
            raise ValueError("drafter.mask_token_id: the target has no tokenizer; set the mask token id explicitly")
        mask_id = default_mask_token_id(target.tokenizer, target.vocab_size, getattr(target.model, "generation_config", None))
    if settings.target_layer_ids is not None:
        target.check_layer_ids(settings.target_layer_ids)
    cfg = drafter_config_for_target(
        target.config, mask_id, num_layers=settings.num_layers, num_taps=settings.num_taps,
        target_layer_ids=settings.target_layer_ids, block_size=settings.block_size,
        layer_types=settings.layer_types, sliding_window=settings.sliding_window,
        intermediate_size=settings.intermediate_size)
    return DFlashDrafter(family_config(cfg, settings)).to(device=target.device, dtype=target.dtype)
