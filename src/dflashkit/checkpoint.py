"""The reference checkpoint format (docs/conventions.md): a directory with `config.json` + `model.safetensors`.

This is what vLLM, SGLang and the reference Transformers code load, and what published drafters
ship; our training state (optimiser, scheduler, RNG, data position) lives beside it in
`training_state.pt`, which other tools ignore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load_file, save_file

from dflashkit.drafter import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

CONFIG, WEIGHTS, TRAINING_STATE = "config.json", "model.safetensors", "training_state.pt"


class CheckpointError(ValueError):
    """A drafter directory that cannot be used; the message says which file and what to fix."""


# Temporary files are `.NAME.PID.RANDOM.tmp` beside their target (unique across processes and the
# threads of one): a later run recognises them, and removes those whose writer is no longer alive
# (`remove_stale_temp_files`; also `.NAME.PID.tmp`, as earlier versions named them).
_TEMP = re.compile(r"^\..+?\.(\d+)(?:\.[0-9a-f]{8})?\.tmp$")
FAULT_ENV = "DFLASHKIT_KILL_AT"


def _file_mode() -> int:
    """0666 less the process umask: what a plain `open` gives (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def remove_stale_temp_files(directory: Path, name: str | None = None) -> list[Path]:
    """Remove temp files (and directories) in `directory` left by writers that were killed:
    those named by `temp_path` (for file `name` only, if given) whose process is gone, or is us
    (called at the start of a run, we have written nothing yet)."""
    removed = []
    for p in Path(directory).glob(f".{name}.*.tmp" if name else ".*.tmp"):
        m = _TEMP.match(p.name)
        if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def fault_point(name: str) -> None:
    """Testing aid: the process dies here (as by kill -9) when DFLASHKIT_KILL_AT equals `name`,
    so a test can place a kill exactly instead of racing a timer."""
    if os.environ.get(FAULT_ENV) == name:
        os._exit(137)


def atomic_save(save_fn, path: Path) -> None:
    """`save_fn(tmp)` writes the file under a temporary name, then it is renamed into place."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        save_fn(str(tmp))
        os.chmod(tmp, _file_mode())
        fault_point(f"replace {path.name}")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_save(lambda tmp: Path(tmp).write_bytes(data), path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def complete_lines(f: BinaryIO, name: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of each complete line of an append-only log open in `f` (binary,
    readable and writable). A torn last line (a kill during its write) is cut off the file, in
    one `truncate`, and said in one log line: the record it began is written again."""
    f.seek(0)
    good = 0  # bytes of complete lines
    for lineno, line in enumerate(f, 1):
        if not line.endswith(b"\n"):
            log.warning("%s: dropping an incomplete last line (an interrupted write)", name)
            f.truncate(good)
            return
        good += len(line)
        yield lineno, line


def save_drafter(drafter: DFlashDrafter, path: str | Path, *, dtype: torch.dtype | None = None,
                 training_state: dict[str, Any] | None = None) -> Path:
    """Write the drafter in the reference format (each file atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg = drafter.config.to_json_dict()
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    atomic_save(lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}), path / WEIGHTS)
    atomic_write_json(path / CONFIG, cfg)
    if training_state is not None:
        atomic_save(lambda tmp: torch.save(training_state, tmp), path / TRAINING_STATE)
    return path


def load_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG}; a drafter directory holds {CONFIG} and {WEIGHTS}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file}: top level is a {type(raw).__name__}, expected a JSON object (a drafter config)")
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
    state = read_safetensors(wfile)
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


# Parts for moving a drafter through a channel that caps file sizes (a remote GPU job may return
# files of at most 16 MB each): 15 MiB is under that cap in any unit.
PART_BYTES = 15 * 2**20
SUMS = "SHA256SUMS"


def split_drafter(src: str | Path, out: str | Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """A drafter directory -> `out`: config.json, model.safetensors cut into parts of at most
    `part_bytes` (model.safetensors.part000, part001, ...) and SHA256SUMS of the two whole files,
    in `sha256sum` format. `join_drafter` puts the directory back; so does a shell in `out`:
    `cat model.safetensors.part* > model.safetensors && sha256sum -c SHA256SUMS`."""
    src, out = Path(src), Path(out)
    load_config(src)  # a broken drafter fails here, not after the transfer
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{WEIGHTS}.part*"):  # left by a larger drafter, they would be joined too
        stale.unlink()
    config, weights = (src / CONFIG).read_bytes(), (src / WEIGHTS).read_bytes()
    files = [out / CONFIG]
    atomic_write_bytes(files[0], config)
    for i, start in enumerate(range(0, len(weights), part_bytes)):
        files.append(out / f"{WEIGHTS}.part{i:03d}")
        atomic_write_bytes(files[-1], weights[start:start + part_bytes])
    files.append(out / SUMS)
    atomic_write_bytes(files[-1], "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                                          for name, data in ((CONFIG, config), (WEIGHTS, weights))).encode())
    return files


def join_drafter(parts: str | Path, out: str | Path) -> Path:
    """`split_drafter`'s parts -> the drafter directory `out` (config.json + model.safetensors),
    each file checked against SHA256SUMS before it is written."""
    parts, out = Path(parts), Path(out)
    sums = {name: digest for digest, name in (line.split(maxsplit=1) for line in (parts / SUMS).read_text().splitlines())}
    pieces = sorted(parts.glob(f"{WEIGHTS}.part*"))
    files = {CONFIG: (parts / CONFIG).read_bytes(), WEIGHTS: b"".join(p.read_bytes() for p in pieces)}
    for name, data in files.items():
        if hashlib.sha256(data).hexdigest() != sums.get(name):
            raise CheckpointError(f"{parts}: {name} does not match its SHA-256 in {SUMS} "
                                  f"({len(pieces)} weight parts found: one missing or damaged?)")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
    return out


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


# Sizes a Transformers config must hold as positive integers (Transformers divides by them).
_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "vocab_size", "head_dim")


def check_model_config(path: Path) -> None:
    """A model directory's config.json, checked before Transformers reads it: a JSON object whose
    sizes are positive integers (else Transformers fails with a TypeError or ZeroDivisionError)."""
    f = Path(path) / CONFIG
    if not f.is_file():
        return
    try:
        raw = json.loads(f.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f}: top level is a {type(raw).__name__}, expected a JSON object (a model config)")
    sections = [raw] + [v for k, v in raw.items() if k.endswith("_config") and isinstance(v, dict)]
    bad = [f"{k}={c[k]!r}" for c in sections for k in _SIZES
           if k in c and c[k] is not None and (isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] < 1)]
    if bad:
        raise CheckpointError(f"{f}: {', '.join(bad)}: expected positive integers")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a truncated or foreign file gives an error naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or "
                              "from an interrupted copy") from None


# What a training state must hold (see train.py); checked before use so that a damaged file is
# reported as such instead of failing deep inside the trainer.
TRAINING_STATE_KEYS = ("version", "step", "total_steps", "batch_size", "num_train", "best", "rng", "params",
                       "optimizer", "scheduler")


def load_training_state(path: str | Path) -> dict[str, Any] | None:
    """`training_state.pt` of a checkpoint directory, or None when there is none.

    Loaded with `weights_only=True`: tensors and plain data only, so a crafted file cannot run code."""
    f = Path(path) / TRAINING_STATE
    if not f.is_file():
        return None
    import pickle

    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{f}: not a training state this tool can load safely (tensors and plain data only): "
                              f"{first}") from None
    missing = [k for k in TRAINING_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{f}: malformed training state, missing {', '.join(missing)}; "
                              "it was not written by `dflashkit train` or is damaged")
    return state
