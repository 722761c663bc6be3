"""The reference checkpoint format (docs/conventions.md): a directory with `config.json` + `model.safetensors`.

This is what vLLM, SGLang and the reference Transformers code load, and what published drafters
ship; our training state (optimiser, scheduler, RNG, data position) lives beside it in
`training_state.pt`, which other tools ignore.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load_file, save_file

from dflashkit import family
from dflashkit.drafter import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

CONFIG, WEIGHTS, TRAINING_STATE, SUMS = "config.json", "model.safetensors", "training_state.pt", "SHA256SUMS"
SHARDED_STATE = "state"  # a checkpoint's directory of weight and optimiser shards (shardstate.py)


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


# A write that fails for lack of room: the causes, as the one line of the failure states them.
_NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "the file-size limit is reached (ulimit -f)"}


class NoRoomError(OSError):
    """A file that could not be written for lack of room; the message names it and the cause."""

    def __init__(self, path: Path, code: int) -> None:
        super().__init__(f"{path}: cannot be written: {_NO_ROOM[code]} ({errno.errorcode[code]}); free space or "
                         "raise the limit, then run the command again")
        self.errno = code


def _errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError):
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e))  # safetensors' I/O errors (Rust's) keep only this
    return int(m.group(1)) if m else None


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes of `path` in the block: a failure for lack of room becomes a `NoRoomError` naming the
    file and the cause, which the writers' own messages leave out (`[Errno 28] No space left on
    device`, safetensors' `File too large (os error 27)`)."""
    try:
        yield
    except Exception as e:
        code = _errno_of(e)
        if code not in _NO_ROOM:
            raise
        raise NoRoomError(path, code) from e


class _KeptWriteError:
    """A file as `torch.save` writes it, keeping the OSError of a failed write: torch turns it
    into a RuntimeError without its errno (`[enforce fail at inline_container.cc]`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj, path)`, a failed write raised as the OSError it was."""
    with open(path, "wb") as f:
        kept = _KeptWriteError(f)
        try:
            torch.save(obj, kept)
        except RuntimeError:
            if kept.error is None:
                raise
            raise kept.error from None


def atomic_save(save_fn, path: Path) -> None:
    """`save_fn(tmp)` writes the file under a temporary name, then it is renamed into place."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with writing(path):
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_drafter(drafter: DFlashDrafter, path: str | Path, *, dtype: torch.dtype | None = None,
                 training_state: dict[str, Any] | None = None, config_extra: dict[str, Any] | None = None) -> Path:
    """Write the drafter in the reference format (each file atomically), `config_extra` merged into
    its config.json, and the SHA-256 of every file written in SHA256SUMS (`sha256sum -c` checks
    them; so does every loader here)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SUMS).unlink(missing_ok=True)  # a kill before the new sums leaves none, never stale ones
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg = {**drafter.config.to_json_dict(), **(config_extra or {})}
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    atomic_save(lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}), path / WEIGHTS)
    atomic_write_json(path / CONFIG, cfg)
    names = [WEIGHTS, CONFIG]
    if training_state is not None:
        atomic_save(lambda tmp: torch_save(training_state, tmp), path / TRAINING_STATE)
        names.append(TRAINING_STATE)
    atomic_write_bytes(path / SUMS, "".join(f"{sha256_file(path / n)}  {n}\n" for n in sorted(names)).encode())
    return path


def recorded_sums(directory: Path) -> dict[str, str] | None:
    """name -> sha256 from `directory`/SHA256SUMS; None when there is none (published drafters)."""
    f = directory / SUMS
    if not f.is_file():
        return None
    sums = {}
    try:
        lines = f.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        lines = ["?"]
    for line in lines:
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](\S+)", line)
        if not m:
            raise CheckpointError(f"{f}: expected lines '<64 hex digits>  FILE' (sha256sum format), found {line[:80]!r}; "
                                  f"it is damaged: delete it to use {directory} unchecked")
        sums[m.group(2)] = m.group(1)
    return sums


def verify_file(path: Path) -> None:
    """`path` against the SHA-256 that SHA256SUMS beside it records, when there is one (a file it
    does not list is refused: a cut SHA256SUMS must not leave the rest unchecked)."""
    sums = recorded_sums(path.parent)
    if sums is None:
        return
    want = sums.get(path.name)
    if want is None:
        raise CheckpointError(f"{path}: not listed in {path.parent / SUMS} (damaged, or the file was put there later); "
                              f"restore it, or delete {SUMS} to use the directory unchecked")
    if sha256_file(path) != want:
        raise CheckpointError(f"{path}: differs from the SHA-256 recorded in {path.parent / SUMS} (damaged or edited "
                              f"since it was written); restore it, or delete {SUMS} to use it as it is")


def load_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG}; a drafter directory holds {CONFIG} and {WEIGHTS}")
    verify_file(cfg_file)
    try:
        raw = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e}); fix it, or export the drafter again") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file}: top level is a {type(raw).__name__}, expected a JSON object (a drafter config)")
    bad = config_value_problems(raw)
    if bad:
        raise CheckpointError(f"{cfg_file}: " + "; ".join(bad))
    try:
        return DrafterConfig.from_json_dict(raw, source=str(cfg_file))
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# Optional drafter config fields: (check, what is expected). Sizes are checked by `from_json_dict`.
_CONFIG_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
    "rms_norm_eps": (lambda v: _is_number(v) and v > 0, "a positive number"),
    "rope_theta": (lambda v: _is_number(v) and v > 0, "a positive number"),
    "max_position_embeddings": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "layer_types": (lambda v: v is None or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
                    "a list of layer type names"),
    "sliding_window": (lambda v: v is None or (_is_int(v) and v >= 1), "null or a positive integer"),
    "attention_bias": (lambda v: isinstance(v, bool), "true or false"),
    "dflash_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "dflash_config.mask_token_id": (lambda v: _is_int(v) and v >= 0, "a token id (an integer >= 0)"),
    "dflash_config.target_layer_ids": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
                                       "a list of layer indices (integers)"),
}


def config_value_problems(raw: dict[str, Any]) -> list[str]:
    """Values of a drafter config.json of the wrong type or range, each as "field: expected ..., got ..."."""
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    present = {**raw, **{f"dflash_config.{k}": v for k, v in dflash.items()}}
    return [f"field '{k}': expected {what}, got {present[k]!r}"[:200]
            for k, (ok, what) in _CONFIG_VALUES.items() if k in present and not ok(present[k])]


def load_drafter(path: str | Path, target: Any = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load and validate a reference-format drafter directory, written by us or by any other tool.

    With a `target` (a `dflashkit.target.Target`), also checks that the drafter fits it."""
    path = Path(path)
    config = load_config(path)
    wfile = path / WEIGHTS
    if not wfile.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS} (a drafter directory holds {CONFIG} and {WEIGHTS}); copy the "
                              "weights there, or export the drafter again")
    verify_file(wfile)
    state = read_safetensors(wfile)
    check_tensors(config, state, wfile)
    nonfinite = [k for k, v in state.items() if not (v.is_floating_point() and bool(torch.isfinite(v).all()))]
    if nonfinite:
        raise CheckpointError(f"{wfile}: tensors {nonfinite[:4]} hold non-finite values or are not floating point; "
                              "a usable drafter has finite weights")
    if target is not None:
        problems = target_problems(config, target)
        if problems:
            raise CheckpointError(f"{path}: does not fit target {target.name}: " + "; ".join(problems))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype or next(iter(state.values())).dtype)


def check_tensors(config: DrafterConfig, state: dict[str, torch.Tensor], wfile: Path) -> None:
    """The tensors of `wfile` against the drafter its config.json declares: names and shapes. A
    family module's tensors that are missing, unexpected or misshapen are reported under the
    `dflash_config` field that declares the module (family.DECLARED)."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in DFlashDrafter(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    _check_family_tensors(config, missing, unexpected, wfile)
    if missing:
        raise CheckpointError(f"{wfile}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"({len(missing)} in all) for a {config.num_hidden_layers}-layer drafter")
    if unexpected:
        raise CheckpointError(f"{wfile}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                              f"({len(unexpected)} in all); tensor names must follow the reference format")
    wrong = [f"{k}: expected {tuple(expected[k])}, got {tuple(state[k].shape)}" + _shaped_by(config, k)
             for k in expected if state[k].shape != expected[k]]
    if wrong:
        raise CheckpointError(f"{wfile}: tensors of the wrong shape for {CONFIG}: " + "; ".join(wrong[:6]))


def _check_family_tensors(config: DrafterConfig, missing: list[str], unexpected: list[str], wfile: Path) -> None:
    for names, declared in ((missing, True), (unexpected, False)):
        found = set(filter(None, map(family.declared_by, names)))
        for d in (d for d in family.DECLARED if d in found):
            mine = [k for k in names if family.declared_by(k) == d]
            value = f"dflash_config.{d.field}={getattr(config, d.field)!r}"
            if declared:
                raise CheckpointError(f"{wfile}: {CONFIG}'s {value} declares {d.what}, but its tensors {mine[:4]} are "
                                      f"missing ({len(mine)} in all); export the drafter with them, or drop the field")
            raise CheckpointError(f"{wfile}: tensors {mine[:4]} ({len(mine)} in all) belong to {d.what}, which "
                                  f"{CONFIG} does not declare ({value}); declare it there, or drop those tensors")


def _shaped_by(config: DrafterConfig, tensor: str) -> str:
    d = family.declared_by(tensor)
    return "" if d is None else " (shaped by " + ", ".join(f"dflash_config.{f}={getattr(config, f)!r}" for f in d.shaped_by) + ")"


# Parts for moving a drafter through a channel that caps file sizes (a remote GPU job may return
# files of at most 16 MB each): 15 MiB is under that cap in any unit.
PART_BYTES = 15 * 2**20


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
    """`split_drafter`'s parts -> the drafter directory `out` (config.json + model.safetensors +
    SHA256SUMS), each file checked against SHA256SUMS before it is written."""
    parts, out = Path(parts), Path(out)
    sums = recorded_sums(parts) or {}
    pieces = sorted(parts.glob(f"{WEIGHTS}.part*"))
    files = {CONFIG: (parts / CONFIG).read_bytes(), WEIGHTS: b"".join(p.read_bytes() for p in pieces)}
    for name, data in files.items():
        if hashlib.sha256(data).hexdigest() != sums.get(name):
            raise CheckpointError(f"{parts}: {name} does not match its SHA-256 in {SUMS} "
                                  f"({len(pieces)} weight parts found: one missing or damaged?)")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
    atomic_write_bytes(out / SUMS, (parts / SUMS).read_bytes())
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


# What a training state must hold (see train.py): each key, a check of its value and what is
# expected. Checked before use, so that a damaged or crafted file is reported as such instead of
# failing deep inside the trainer, or training from a wrong step.
def _count(lo: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= lo


def _tensors(v: Any, leaf: Callable[[Any], bool]) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and leaf(x) for k, x in v.items())


def _finite_tensor(v: Any) -> bool:
    return torch.is_tensor(v) and v.is_floating_point() and bool(torch.isfinite(v).all())


def _python_rng(v: Any) -> bool:
    """`random.getstate()`: (version, 625 ints, None or a float)."""
    return (isinstance(v, tuple) and len(v) == 3 and _is_int(v[0]) and isinstance(v[1], tuple)
            and len(v[1]) == 625 and all(_is_int(x) for x in v[1]) and (v[2] is None or _is_number(v[2])))


def _rng(v: Any) -> bool:
    def byte_state(t: Any) -> bool:
        return torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1
    return (isinstance(v, dict) and byte_state(v.get("torch")) and _python_rng(v.get("python"))
            and ("cuda" not in v or byte_state(v["cuda"])))


def _best(v: Any) -> bool:
    def scores(x: Any) -> bool:
        return isinstance(x, dict) and all(isinstance(k, str) and _is_number(y) for k, y in x.items())
    return (isinstance(v, dict) and _is_number(v.get("tau_sim")) and (v.get("step") is None or _count(0)(v.get("step")))
            and all(scores(v[k]) for k in ("tau_sim_by_suite", "tau_rounds_probes") if k in v))


def _scheduler(v: Any) -> bool:
    def rates(x: Any) -> bool:
        return isinstance(x, list) and all(_is_number(r) for r in x)
    # lr_lambdas: None per group for plain functions; anything else would be set on the schedule's functions
    return (isinstance(v, dict) and _count(-1)(v.get("last_epoch"))
            and all(rates(v[k]) for k in ("base_lrs", "_last_lr") if k in v)
            and ("lr_lambdas" not in v or (isinstance(v["lr_lambdas"], list) and all(x is None for x in v["lr_lambdas"]))))


def _optimizer_entry(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and (_finite_tensor(x) or _is_number(x)) for k, x in v.items())


TRAINING_STATE_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "version": (_is_int, "an integer"),
    "step": (_count(0), "a step number (an integer >= 0)"),
    "total_steps": (_count(1), "an integer >= 1"),
    "batch_size": (_count(1), "an integer >= 1"),
    "num_train": (_count(0), "an integer >= 0"),
    "best": (_best, "{'tau_sim': number, 'step': step or null, ...}"),
    "rng": (_rng, "{'torch': uint8 tensor, 'python': random.getstate(), 'cuda' (optional): uint8 tensor}"),
    "params": (lambda v: _tensors(v, _finite_tensor), "parameter name -> finite floating-point tensor"),
    "optimizer": (lambda v: _tensors(v, _optimizer_entry), "parameter name -> {state name: finite tensor or number}"),
    "scheduler": (_scheduler, "a learning-rate scheduler state (integer last_epoch, lists of rates)"),
}


def load_training_state(path: str | Path) -> dict[str, Any] | None:
    """`training_state.pt` of a checkpoint directory, or None when there is none.

    Loaded with `weights_only=True`: tensors and plain data only, so a crafted file cannot run code.
    Checked against SHA256SUMS and for the type and range of every value."""
    f = Path(path) / TRAINING_STATE
    if not f.is_file():
        return None
    verify_file(f)
    try:
        with quiet_unpickler():
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged archive fails in many ways (UnpicklingError, OSError from a seek, ...)
        raise CheckpointError(f"{f}: not a training state this tool can load safely (tensors and plain data only): "
                              f"{refusal_reason(e)}") from None
    # A sharded state (several ranks) keeps the weights and moments in its shards, not here.
    sharded = isinstance(state, dict) and state.get("sharded") == SHARDED_STATE
    values = {k: v for k, v in TRAINING_STATE_VALUES.items() if not (sharded and k in ("params", "optimizer"))}
    missing = [k for k in values if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{f}: malformed training state, missing {', '.join(missing)}; "
                              "it was not written by `dflashkit train` or is damaged")
    bad = [f"'{k}': expected {what}" for k, (ok, what) in values.items() if not ok(state[k])]
    if not bad and state["step"] > state["total_steps"]:
        bad.append(f"'step': {state['step']} is past total_steps {state['total_steps']}")
    if bad:
        raise CheckpointError(f"{f}: malformed training state, field {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return state


@contextmanager
def quiet_unpickler() -> Iterator[None]:
    """torch's weights-only unpickler warns (two lines on stderr) about a pickle written with
    another protocol than its own, a raw pickle among them, before it reads or refuses it: the
    load's outcome, or its one-line refusal, is all there is to say."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        yield


def refusal_reason(e: BaseException) -> str:
    """Why torch.load refused a file, in one line, without torch's advice to retry with
    `weights_only=False` (loading a file that way can run any code inside it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    advice = re.compile(r"weights_only|Weights only load failed|trusted source|documentation of torch\.load", re.I)
    kept = [ln for ln in lines if not advice.search(ln)]
    return (kept[0].rstrip(".") if kept else type(e).__name__)[:300]
