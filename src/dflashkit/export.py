"""`dflashkit export`: write a drafter in the formats serving engines load.

* ``reference``: the reference checkpoint format (docs/conventions.md) that SGLang, vLLM (``method: dflash``)
  and the reference Transformers code load: ``config.json`` + ``model.safetensors``, plus
  ``dflash.py`` (the model for ``trust_remote_code`` loaders) and ``auto_map`` pointing at it.
* ``speculators``: vLLM speculators' format (``speculators_model_type``: ``"dflash"``, ``"dflash2"`` or
  ``"dspark"``, the drafter's kind): a nested Qwen3 ``transformer_layer_config``, the family's fields
  at the top level, a ``speculators_config`` (proposal method, verifier) and the same tensors;
  layer ids shifted as that format expects (see `to_speculators_layer_ids`).

`load_speculators` reads the second format back, so both round trips are tested.
"""

from __future__ import annotations

import argparse
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflashkit.checkpoint import (CONFIG, SUMS, WEIGHTS, CheckpointError, atomic_save, atomic_write_bytes,
                                  atomic_write_json, check_tensors, load_drafter, save_drafter)
from dflashkit.drafter import SLIDING, WRITTEN, DFlashDrafter, DrafterConfig
from dflashkit.rundir import output_path

log = logging.getLogger(__name__)

FORMATS = ("reference", "speculators")
REMOTE_CODE = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
# Keys of the reference config.json that are not part of the draft transformer's own (Qwen3)
# config; speculators' DFlash converter strips the same ones when it nests the rest.
_NOT_LAYER_CONFIG = ("architectures", "auto_map", "block_size", "dflash_config")
# Tensors a speculators checkpoint may carry that belong to the verifier (embedding, LM head,
# final norm); the drafter uses the target's own, so they are dropped on import.
_VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
DTYPES = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- reference format ---------------------------------------------------------------------------


def remote_code_source() -> bytes:
    return (resources.files("dflashkit") / "assets" / "dflash_model.py").read_bytes()


def export_reference(drafter: DFlashDrafter, out: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """config.json (+ auto_map) + model.safetensors + dflash.py, each written atomically."""
    out = Path(out)
    save_drafter(drafter, out, dtype=dtype, config_extra={"auto_map": AUTO_MAP})
    atomic_write_bytes(out / REMOTE_CODE, remote_code_source())
    return out


# ---- vLLM speculators format --------------------------------------------------------------------
#
# Layer ids. Ours (= the reference format's `dflash_config.target_layer_ids`) are 0-based decoder
# layers, id k = the OUTPUT of layer k = Transformers' `output_hidden_states[k + 1]`.
# speculators' `aux_hidden_state_layer_ids` index that tuple directly, so they are ours + 1.
# Evidence (read 2026):
# * speculators `src/speculators/convert/dflash/converter.py` (DFlashConverter._build_config), which
#   converts z-lab reference checkpoints: `aux_hidden_state_layer_ids = [i + 1 for i in
#   target_layer_ids if i + 1 != num_verifier_layers]`, commented "z-lab reads
#   hidden_states[layer_id + 1] (index 0 is the embedding output) while speculators uses the layer
#   id directly"; the verifier's last layer is excluded because speculators' data generation
#   captures it separately (`verifier_last_hidden_states`; also `models/utils.py`,
#   resolve_target_layer_ids, strips id == num_layers).
# * vLLM PR #40727 "[Perf][Bugfix] Update dflash aux layer indexing": the speculators "dflash"
#   config updater (vllm/transformers_utils/configs/speculators/algos.py, update_dflash) maps
#   `dflash_config.target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids]` back to the
#   z-lab convention; before that fix acceptance was measurably lower.
# So exporting a tap of the target's LAST layer is refused: that format cannot express it.


def to_speculators_layer_ids(target_layer_ids: list[int], num_target_layers: int) -> list[int]:
    aux = [int(i) + 1 for i in target_layer_ids]
    if num_target_layers in aux:
        raise ValueError(f"target_layer_ids {target_layer_ids} tap the target's last layer ({num_target_layers - 1}); "
                         "the speculators format reserves that layer for the verifier's final hidden state and "
                         "cannot express it as an auxiliary layer: export --format reference instead")
    return aux


def from_speculators_layer_ids(aux_hidden_state_layer_ids: list[int]) -> list[int]:
    return [int(i) - 1 for i in aux_hidden_state_layer_ids]


# speculators' model types and the architectures their configs name (speculators 0.9.0:
# `DFlash2SpeculatorConfig`, `DSparkSpeculatorConfig`; DFlash keeps the reference name vLLM reads).
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}
# speculators' defaults for the fields a config may leave out, per model type (its pydantic
# configs): what a foreign checkpoint without them means.
SPECULATORS_DEFAULTS: dict[str, dict[str, Any]] = {
    "dflash": {"sample_from_anchor": False, "sliding_window_non_causal": False},
    "dflash2": {"sample_from_anchor": False, "sliding_window_non_causal": True, "conv_kernel_size": 2,
                "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    "dspark": {"sample_from_anchor": True, "sliding_window_non_causal": False, "markov_rank": 256,
               "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True},
}


def speculators_config(config: DrafterConfig, verifier: str | None = None, *,
                       verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    kind = config.kind
    if kind == "dflash2" and (config.conv_kernel_size is None or config.selector_rank is None):
        field = "conv_kernel_size" if config.conv_kernel_size is None else "selector_rank"
        raise ValueError(f"dflash_config.{field} is not set: speculators' DFlash2DraftModel always has block "
                         "convolutions and a candidate selector; export --format reference instead")
    ref = config.to_json_dict()
    layer = {k: v for k, v in ref.items() if k not in _NOT_LAYER_CONFIG}
    sliding = {k: layer[k] for k in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")}
    drafted = config.block_size - 1 + int(config.sample_from_anchor)
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        **{k: getattr(config, k) for k in WRITTEN[kind]},
        "sample_from_anchor": config.sample_from_anchor,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.vocab_size,  # the full vocabulary: no d2t/t2d mapping
        "target_hidden_size": None,  # None = the drafter's hidden size (they are equal)
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": to_speculators_layer_ids(config.target_layer_ids, config.num_target_layers),
        "mask_token_id": config.mask_token_id,
        # Our sliding layers are bidirectional inside the block, like the full ones.
        "sliding_window_non_causal": True,
        # vLLM's updater reads the attention layout from the top level as well.
        **sliding,
        "speculators_config": {
            "algorithm": kind,
            # Bonus-first, a block proposes block_size - 1 tokens; anchor-first, block_size.
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafted}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
    }


def export_speculators(drafter: DFlashDrafter, out: str | Path, *, verifier: str | None = None,
                       verifier_architectures: list[str] | None = None, dtype: torch.dtype | None = None) -> Path:
    """config.json (speculators) + model.safetensors (the reference tensor names, which speculators'
    DFlash model shares), each written atomically."""
    out = Path(out)
    cfg = speculators_config(drafter.config, verifier, verifier_architectures=verifier_architectures)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg["transformer_layer_config"]["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    atomic_save(lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}), out / WEIGHTS)
    atomic_write_json(out / CONFIG, cfg)
    return out


def load_speculators(path: str | Path, *, num_target_layers: int | None = None) -> DFlashDrafter:
    """Read a speculators-format checkpoint (ours or speculators'; model type dflash, dflash2 or
    dspark) into a drafter, checked as `checkpoint.load_drafter` checks the reference format.

    speculators' own checkpoints do not store the target's layer count; pass `num_target_layers`."""
    path = Path(path)
    cfg_file, wfile = path / CONFIG, path / WEIGHTS
    if not cfg_file.is_file() or not wfile.is_file():
        raise CheckpointError(f"{path}: a speculators checkpoint holds {CONFIG} and {WEIGHTS}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    config = _speculators_drafter_config(raw, cfg_file, num_target_layers)
    state = {k: v for k, v in load_file(str(wfile)).items() if k not in _VERIFIER_TENSORS}
    check_tensors(config, state, wfile)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state)
    return drafter.to(next(iter(state.values())).dtype)


def _speculators_drafter_config(raw: dict[str, Any], cfg_file: Path, num_target_layers: int | None) -> DrafterConfig:
    """A speculators config.json -> the drafter config it describes (the reference format's layout)."""
    kind = raw.get("speculators_model_type")
    if kind not in SPECULATORS_DEFAULTS:
        raise CheckpointError(f"{cfg_file}: speculators_model_type is {kind!r}, expected one of "
                              f"{list(SPECULATORS_DEFAULTS)} (a reference-format drafter loads with checkpoint.load_drafter)")
    fields = {**SPECULATORS_DEFAULTS[kind], **{k: raw[k] for k in SPECULATORS_DEFAULTS[kind] if k in raw}}
    layer = dict(raw.get("transformer_layer_config") or {})
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if raw.get(key) is None:
            raise CheckpointError(f"{cfg_file}: '{key}' is missing")
    if raw.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise CheckpointError(f"{cfg_file}: draft_vocab_size {raw['draft_vocab_size']} != vocab_size "
                              f"{layer.get('vocab_size')}: reduced draft vocabularies (d2t/t2d) are not supported")
    if SLIDING in (layer.get("layer_types") or []) and not fields.pop("sliding_window_non_causal"):
        raise CheckpointError(f"{cfg_file}: sliding layers are causal inside the block (sliding_window_non_causal "
                              "is false); dflashkit drafters attend bidirectionally within a block")
    fields.pop("sliding_window_non_causal", None)
    layer.setdefault("num_target_layers", num_target_layers)
    if layer["num_target_layers"] is None:
        raise CheckpointError(f"{cfg_file}: the target's number of layers is not stored; pass num_target_layers")
    layer.update(block_size=raw["block_size"], dflash_config={
        "mask_token_id": raw["mask_token_id"], **fields,
        "target_layer_ids": from_speculators_layer_ids(raw["aux_hidden_state_layer_ids"])})
    try:
        return DrafterConfig.from_json_dict(layer, source=str(cfg_file))
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from None


def export(drafter: DFlashDrafter, out: str | Path, fmt: str, **kw: Any) -> Path:
    if fmt == "reference":
        return export_reference(drafter, out, dtype=kw.get("dtype"))
    if fmt == "speculators":
        return export_speculators(drafter, out, **kw)
    raise ValueError(f"--format: expected one of {FORMATS}, got {fmt!r}")


# ---- CLI ----------------------------------------------------------------------------------------


def is_export_dir(path: Path) -> bool:
    """Whether export may write into `path`: a directory holding nothing but the files it writes,
    a config.json among them only if a drafter's (reference or speculators), never a model's."""
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir() if not p.name.startswith(".")}
    if not names <= {CONFIG, WEIGHTS, REMOTE_CODE, SUMS}:
        return False
    if CONFIG not in names:
        return True
    try:
        raw = json.loads((path / CONFIG).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and ("dflash_config" in raw or "speculators_model_type" in raw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", metavar="DRAFTER", help="reference-format drafter directory (e.g. a training output)")
    p.add_argument("--format", choices=FORMATS, default="reference",
                   help="reference: config.json + model.safetensors + dflash.py (SGLang, vLLM method 'dflash', "
                        "Transformers trust_remote_code); speculators: vLLM speculators' format")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (files are replaced atomically)")
    p.add_argument("--dtype", choices=list(DTYPES), default="keep", help="cast the weights (default: keep)")
    p.add_argument("--verifier", metavar="NAME_OR_PATH",
                   help="speculators format: the target model, so that `vllm serve DIR` finds it")


def run(args: argparse.Namespace) -> int:
    drafter = load_drafter(args.drafter)
    out, fmt = Path(args.out), args.format
    if out.resolve() == Path(args.drafter).resolve() and fmt != "reference":
        raise ValueError(f"--out {out}: the same directory as the drafter; choose another one")
    kw: dict[str, Any] = {"dtype": DTYPES[args.dtype]}
    if fmt == "speculators":
        kw["verifier"] = args.verifier
        if args.verifier is None:
            log.warning("no --verifier: config.json names no target; serve with the long form "
                        "`vllm serve TARGET --speculative-config '{\"method\": \"dflash\", \"model\": \"%s\", ...}'`", out)
    elif args.verifier is not None:
        raise ValueError("--verifier applies to --format speculators only")
    with output_path(out, "export", is_export_dir,  # nothing of ours inside what is handed on
                     "an empty directory or a drafter's (a drafter's config.json, model.safetensors, dflash.py, "
                     "SHA256SUMS and nothing else)"):
        export(drafter, out, fmt, **kw)
    c = drafter.config
    print(f"exported {args.drafter} -> {out} ({fmt}): {c.num_hidden_layers} layers, taps {c.target_layer_ids}, "
          f"block {c.block_size}, mask token {c.mask_token_id}")
    print(f"kind: {c.summary()}")
    print(f"serving command lines: docs/serving.md (num_speculative_tokens = {len(c.draft_slots)})")
    return 0
