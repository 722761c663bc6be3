"""The target model, seen through the only doors a drafter needs.

* `embed` / `lm_head`: the target's frozen embedding and LM head (the drafter has none).
* `forward`: logits plus *only* the tapped layers' features. Tap `k` is the output of decoder
  layer `k`, i.e. `output_hidden_states[k + 1]` (index 0 is the embedding output). Taps are
  captured by forward hooks, so the other layers' hidden states are never kept alive.
* `layer_kinds`: which layers attend fully and which through a sliding window (the decoding
  cache, `decode/cache.py`, is ours: Transformers' own cache semantics change between releases).
"""

from __future__ import annotations

import inspect
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


@dataclass
class TargetOutput:
    logits: Tensor | None  # [b, t, V]
    features: Tensor  # [b, t, n_taps * H], taps concatenated in the order asked for
    cache: Any  # transformers Cache (or None)
    hidden: Tensor | None = None  # [b, t, H] after the final norm (when logits=False)


class _TapsTaken(Exception):
    """Raised by the deepest tap's hook when nothing above it is wanted: the forward ends there."""


class Target:
    """A frozen Hugging Face causal LM with tap access."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str = "target") -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layers = _decoder_layers(model)
        self.final_norm = _final_norm(model)
        self.sharded = False  # its decoder layers are FSDP2 units over a job's ranks (`parallel.shard_layers`)
        # transformers renamed `past_key_values` to `cache` (5.24 warns); use what this version takes.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # ---- shape facts -----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def compile_layers(self, upto: int) -> None:
        """torch.compile decoder layers 0..upto in place (their parameter names stay): one graph
        per layer class, the norms, rotary and activations fused around the GEMMs."""
        for layer in list(self.layers)[: upto + 1]:
            layer.compile()

    # ---- frozen pieces shared with the drafter ------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: Tensor, project: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """hidden [..., H] -> logits [..., V]; project: the head's GEMM done another way (the same
        weights, e.g. packed for the CPU), instead of the module."""
        head = self.model.get_output_embeddings()
        # One 2-D GEMM: a strided [b, t, H] view (e.g. a block's slots 1..) would otherwise go
        # through a batched matmul with the [V, H] weight broadcast per row (measured 10x slower).
        flat = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)
        logits = (project or head)(flat).view(*hidden.shape[:-1], -1)
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma-style models
        return logits if not cap else torch.tanh(logits / cap) * cap

    @property
    def layer_kinds(self) -> list[str]:
        return layer_kinds(self.config)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    # ---- forward with taps -------------------------------------------------------------
    def check_layer_ids(self, layer_ids: list[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range: {self.name} has {self.num_layers} decoder layers (valid ids 0..{self.num_layers - 1})")

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [b, t]
        layer_ids: list[int],
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        logits: bool = True,
        hidden: bool = True,
    ) -> TargetOutput:
        """hidden=False (with logits=False and no cache): only the taps are wanted, so the layers
        above the deepest tap do not run (on Qwen3-8B with the default taps, 2 of 36)."""
        self.check_layer_ids(layer_ids)
        captured: dict[int, Tensor] = {}
        last = self.num_layers - 1
        # A sharded target runs every layer: each layer's forward is a collective on every rank.
        stop_at = max(layer_ids) if not (hidden or logits or cache is not None or self.sharded) else None

        def hook(idx: int):
            def fn(_mod, _args, out):
                h = out[0] if isinstance(out, tuple) else out
                # Transformers reports the last layer's output after the final norm.
                captured[idx] = self.final_norm(h) if idx == last else h
                if idx == stop_at:
                    raise _TapsTaken
            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
        try:
            kwargs: dict[str, Any] = dict(input_ids=input_ids, position_ids=position_ids,
                                          attention_mask=attention_mask, use_cache=cache is not None)
            if cache is not None:
                kwargs[self._cache_kwarg] = cache
            if logits:
                out = self.model(**kwargs)
                lg, final = out.logits, None
            else:  # skip the LM head: the base model alone
                lg, final = None, None
                try:
                    final = self.model.get_decoder()(**kwargs).last_hidden_state
                except _TapsTaken:
                    pass
        finally:
            for h in handles:
                h.remove()
        feats = torch.cat([captured[i] for i in layer_ids], dim=-1)
        return TargetOutput(lg, feats, cache, final)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers (expected `model.model.layers`)")
    return layers


def _final_norm(model: nn.Module) -> nn.Module:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = getattr(dec, "norm", None) or getattr(dec, "final_layernorm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the final norm of its decoder")
    return norm


def fla_missing(target: Any) -> bool:
    """The target has Gated DeltaNet layers and fla-core is not installed: Transformers runs their
    PyTorch reference, which at the Qwen3.6-27B shape made the online training step 1.5x slower on
    an H100 (1.54 samples/s against 2.38 with fla-core; docs/benchmarks.md)."""
    import importlib.util

    return "linear_attention" in target.layer_kinds and importlib.util.find_spec("fla") is None


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's attention kind: 'full_attention' or 'sliding_attention' (or another
    type the config names). A config with a sliding window but no `layer_types` (Mistral-7B-v0.1,
    Phi-3-mini-4k style) slides in every layer."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    return ["sliding_attention" if sliding else "full_attention"] * n


# ---- loading -----------------------------------------------------------------------------


def load_target(
    name_or_path: str | Path | None = None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    local_files_only: bool | None = None,
    weights: bool = True,
) -> Target:
    """Load a target: a local directory, a hub id (only when online), a `.gguf` file, a testbed
    name ("smollm2", "gemma3", see `testbed.py`), or, with no name, the embedded default
    (SmolLM2-135M-Instruct).

    `weights=False`: config, tokenizer and generation config only, the model built on the meta
    device (shape and token facts for `doctor`, without reading the weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflashkit.testbed import resolve

    name_or_path = resolve(name_or_path)
    path = Path(str(name_or_path)).expanduser()
    if path.suffix == ".gguf" and gguf_file is None:
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file {path} does not exist")
        path, gguf_file = path.parent, path.name
    src = str(path) if path.exists() else str(name_or_path)
    if not path.exists() and ("/" not in src or src.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"target '{name_or_path}': no such directory, and it does not look like a hub id (org/name)")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if dtype == "auto":
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    kw: dict[str, Any] = {}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    if local_files_only is not None:
        kw["local_files_only"] = local_files_only
    from safetensors import SafetensorError

    from dflashkit.checkpoint import check_model_config, quiet_unpickler, refusal_reason

    if path.is_dir():
        check_model_config(path)
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        if not weights:
            return Target(_meta_model(src, dtype, kw), tok, name=str(name_or_path))
        with quiet_unpickler():  # a pytorch_model.bin is read with weights_only
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
    except SafetensorError as e:
        raise ValueError(f"target '{name_or_path}': a weights file (*.safetensors) is not readable ({e}); it may be "
                         "truncated or from an interrupted download") from None
    except (pickle.UnpicklingError, EOFError) as e:  # a pickled weights file (pytorch_model.bin) read with weights_only
        raise ValueError(f"target '{name_or_path}': a pickled weights file (*.bin) is not one that loads safely "
                         f"(tensors and plain data only): {refusal_reason(e)}; convert the target to safetensors "
                         "where it came from") from None
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"could not load target '{name_or_path}': {first} (a hub id needs network access; offline, "
                      "pass a local directory or a .gguf file)") from None
    return Target(model.to(device), tok, name=str(name_or_path))


def _meta_model(src: str, dtype: torch.dtype, kw: dict[str, Any]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(src, **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(src, **kw)
    except OSError:
        pass  # no generation_config.json: the defaults derived from the config stay
    return model
