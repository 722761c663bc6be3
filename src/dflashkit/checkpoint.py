"""The reference checkpoint format (SPEC §2): a directory with `config.json` + `model.safetensors`.

This is what vLLM, SGLang and the reference Transformers code load, and what published drafters
ship; our training state (optimiser, scheduler, RNG, data position) lives beside it in
`training_state.pt`, which other tools ignore.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflashkit.drafter import DFlashDrafter, DrafterConfig

CONFIG, WEIGHTS, TRAINING_STATE = "config.json", "model.safetensors", "training_state.pt"


class CheckpointError(ValueError):
    """A drafter directory that cannot be used; the message says which file and what to fix."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _atomic_save(save_fn, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_drafter(drafter: DFlashDrafter, path: str | Path, *, dtype: torch.dtype | None = None,
                 training_state: dict[str, Any] | None = None) -> Path:
    """Write the drafter in the reference format (each file atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg = drafter.config.to_json_dict()
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    _atomic_save(lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}), path / WEIGHTS)
    atomic_write_json(path / CONFIG, cfg)
    if training_state is not None:
        _atomic_save(lambda tmp: torch.save(training_state, tmp), path / TRAINING_STATE)
    return path


def load_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG}; a drafter directory holds {CONFIG} and {WEIGHTS}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    try:
        return DrafterConfig.from_json_dict(raw, source=str(cfg_file))
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from None


def load_drafter(path: str | Path, target: Any = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load and validate a reference-format drafter directory, written by us or by any other tool.

    With a `target` (a `dflashkit.target.Target`), also checks that the drafter fits it."""
    path = Path(path)
    config = load_config(path)
    wfile = path / WEIGHTS
    if not wfile.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS}")
    state = load_file(str(wfile))
    with torch.device("meta"):
        expected = {k: v.shape for k, v in DFlashDrafter(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{wfile}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"({len(missing)} in all) for a {config.num_hidden_layers}-layer drafter")
    if unexpected:
        raise CheckpointError(f"{wfile}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                              f"({len(unexpected)} in all); tensor names must follow the reference format")
    wrong = [f"{k}: expected {tuple(expected[k])}, got {tuple(state[k].shape)}" for k in expected if state[k].shape != expected[k]]
    if wrong:
        raise CheckpointError(f"{wfile}: tensors of the wrong shape for {CONFIG}: " + "; ".join(wrong[:6]))
    if target is not None:
        problems = target_problems(config, target)
        if problems:
            raise CheckpointError(f"{path}: does not fit target {target.name}: " + "; ".join(problems))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype or next(iter(state.values())).dtype)


def target_problems(config: DrafterConfig, target: Any) -> list[str]:
    """Mismatches between a drafter config and a target, each a readable sentence."""
    from dflashkit.vocab import mask_token_problems

    p = []
    if config.hidden_size != target.hidden_size:
        p.append(f"hidden_size {config.hidden_size} != target hidden size {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        p.append(f"vocab_size {config.vocab_size} != target vocabulary {target.vocab_size}")
    if config.num_target_layers != target.num_layers:
        p.append(f"num_target_layers {config.num_target_layers} != target's {target.num_layers} decoder layers")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        p.append(f"target_layer_ids {bad} out of range for a target with {target.num_layers} layers")
    if target.tokenizer is not None:
        gen = getattr(target.model, "generation_config", None)
        p += mask_token_problems(config.mask_token_id, target.tokenizer, target.vocab_size, gen)
    return p


def load_training_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / TRAINING_STATE
    return torch.load(f, map_location="cpu", weights_only=False) if f.is_file() else None
