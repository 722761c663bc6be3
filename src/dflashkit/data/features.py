"""Target features: the tapped hidden states the drafter is conditioned on, offline or online.

The feature of token `t` is `target.forward(ids, layer_ids).features[:, t]`: the outputs of the
decoder layers in `layer_ids`, concatenated in that order (`[T, n_taps * H]`, see target.py).

Offline cache (`dflashkit extract`), a directory of plain files:

* `shard-00000.safetensors`: `input_ids` [N] int32, `loss_mask` [N] uint8, `offsets` [n+1] int64
  (sample j is rows offsets[j]:offsets[j+1]), `features` [N, n_taps*H] in the storage dtype, and
  for fp8 `scales` [N, n_taps] float32; the sample ids, layers and dtype are in the file's
  metadata (key `dflashkit`, JSON).
* `shard-00000.json`: the shard's sha256, counts and ids, written after the shard: a shard
  without it is unfinished and redone.
* `settings.json`: what is being extracted (target identity, layers, dtype, samples); a resumed
  run with other settings is refused.
* `manifest.json`: settings + counts + every shard with its sha256, written when all shards exist.

Shards are fixed ranges of samples (cut at `shard_size` tokens), so a run resumes shard by shard
and torchrun ranks take disjoint shards (shard k belongs to rank k % world). fp8 is
`float8_e4m3fn` with one float32 scale per token and tap: half the bytes of bf16.

Online features (`online_features`) are the same computation inside the training process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from bisect import bisect_right
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dflashkit.checkpoint import atomic_save, atomic_write_json, remove_stale_temp_files, sha256_file
from dflashkit.data.chat import TokenizedSample
from dflashkit.parallel import lockstep
from dflashkit.progress import Bar, progress

log = logging.getLogger(__name__)

FORMAT = "dflashkit-features/1"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": FP8}


@dataclass
class FeatureSample:
    id: str
    input_ids: Tensor  # [T] long
    loss_mask: Tensor  # [T] bool
    features: Tensor  # [T, n_taps * H]


# ---- the computation ----------------------------------------------------------------------------


def online_features(target: Any, input_ids: Tensor, layer_ids: list[int], attention_mask: Tensor | None = None) -> Tensor:
    """[b, T] token ids -> [b, T, n_taps * H] features, computed by the target now."""
    return target.forward(input_ids, list(layer_ids), attention_mask=attention_mask, logits=False, hidden=False).features


def quantize_fp8(x: Tensor, n_taps: int) -> tuple[Tensor, Tensor]:
    """[T, n*H] -> (fp8 [T, n*H], float32 scales [T, n]): one scale per token and tap, so a tap's
    large activations do not flatten another tap's small ones."""
    T = x.shape[0]
    x = x.float().reshape(T, n_taps, -1)
    scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [T, n]
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(T, -1), scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    T, n = scale.shape
    return (q.float().reshape(T, n, -1) * scale[..., None]).reshape(T, -1).to(dtype)


def target_identity(target: Any) -> dict[str, Any]:
    """What identifies the target whose features these are: name, config hash, and a fingerprint
    of its weights (final norm + every 1009th embedding row; cheap, catches a different checkpoint)."""
    cfg = target.config.to_dict()
    for k in ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"):
        cfg.pop(k, None)
    h = hashlib.sha256()
    emb = target.model.get_input_embeddings().weight
    for t in (target.final_norm.weight, emb[::1009]):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return {"name": target.name, "num_layers": target.num_layers, "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
            "weights_fingerprint": h.hexdigest()}


# ---- extraction --------------------------------------------------------------------------------


def plan_shards(lengths: Sequence[int], shard_size: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) sample ranges of at most `shard_size` tokens (a longer sample alone)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_size:
            shards.append((start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append((start, len(lengths)))
    return shards


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def extract_features(target: Any, samples: Sequence[TokenizedSample], layer_ids: list[int], out_dir: str | Path, *,
                     dtype: str = "bfloat16", batch_size: int = 8, shard_size: int = 1 << 16,
                     rank: int | None = None, world: int | None = None) -> dict[str, Any] | None:
    """Write this rank's shards of `samples`' features to `out_dir`; return the manifest once every
    shard exists (None while other ranks are still working). Resumes: finished shards are kept."""
    if dtype not in STORAGE:
        raise ValueError(f"feature dtype {dtype!r}: expected one of {', '.join(STORAGE)}")
    if not samples:
        raise ValueError("no samples to extract features for")
    target.check_layer_ids(layer_ids)
    env_rank, env_world = _dist_rank_world()
    rank, world = env_rank if rank is None else rank, env_world if world is None else world
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    check_token_ids(samples, target.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)  # of killed runs (a live rank's files are kept)
    settings = {"format": FORMAT, "target": target_identity(target), "layer_ids": list(layer_ids),
                "hidden_size": target.hidden_size, "dtype": dtype, "shard_size": shard_size,
                "num_samples": len(samples), "samples_sha256": samples_fingerprint(samples)}
    _check_or_write_settings(out / "settings.json", settings)
    shards = plan_shards([len(s.input_ids) for s in samples], shard_size)
    mine = [k for k in range(len(shards)) if k % world == rank and not (out / f"{_shard_name(k)}.json").exists()]
    total = sum(len(samples[i].input_ids) for k in mine for i in range(*shards[k]))
    bar = progress(total=total, desc=f"extract (rank {rank}/{world})", unit="tok", unit_scale=True)
    t0 = time.perf_counter()
    with lockstep(target):  # a sharded target's forwards pair up across ranks with unequal shares
        for k in mine:
            _write_shard(target, samples, shards[k], k, list(layer_ids), out, dtype, batch_size, bar)
    bar.close()
    dt = time.perf_counter() - t0
    log.info("rank %d: %d shards, %d tokens in %.1fs (%.0f tokens/s)", rank, len(mine), total, dt, total / dt if dt else 0)
    return write_manifest(out, settings, len(shards))


def samples_fingerprint(samples: Sequence[TokenizedSample]) -> str:
    """sha256 of the samples' content (ids, token ids, loss masks): a re-tokenised input, even of the
    same lengths, is another input."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.id, list(s.input_ids), list(s.loss_mask)], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def check_token_ids(samples: Sequence[TokenizedSample], vocab_size: int) -> None:
    """Every token id inside the target's vocabulary (checked before anything is written)."""
    for s in samples:
        bad = [t for t in s.input_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sample {s.id!r}: token id {bad[0]!r} is outside the target's vocabulary "
                             f"(0..{vocab_size - 1}); the tokenized file was made with another tokenizer or is damaged")


def _check_or_write_settings(path: Path, settings: dict[str, Any]) -> None:
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e}); delete the directory and extract again") from None
        diff = sorted(k for k in settings if not isinstance(old, dict) or old.get(k) != settings[k])
        if diff:
            what = " (the input samples' content changed)" if "samples_sha256" in diff else ""
            raise ValueError(f"{path.parent} holds features extracted with other settings ({', '.join(diff)} differ"
                             f"{what}); extract into another directory or delete it")
    else:
        atomic_write_json(path, settings)


@torch.no_grad()
def _write_shard(target: Any, samples: Sequence[TokenizedSample], span: tuple[int, int], k: int, layer_ids: list[int],
                 out: Path, dtype: str, batch_size: int, bar: Bar) -> None:
    start, end = span
    idx = list(range(start, end))
    n_taps = len(layer_ids)
    feats: dict[int, Tensor] = {}
    # Longest first within the shard: little padding (right side; causal attention never sees it).
    by_length = sorted(idx, key=lambda i: -len(samples[i].input_ids))
    for b in range(0, len(idx), batch_size):
        batch = by_length[b:b + batch_size]
        T = len(samples[batch[0]].input_ids)
        x = torch.zeros(len(batch), T, dtype=torch.long)
        for j, i in enumerate(batch):
            x[j, :len(samples[i].input_ids)] = torch.tensor(samples[i].input_ids)
        f = online_features(target, x.to(target.device), layer_ids).cpu()  # [b, T, n*H]
        for j, i in enumerate(batch):
            feats[i] = f[j, :len(samples[i].input_ids)]
            bar.update(len(samples[i].input_ids))
    rows = torch.cat([feats[i] for i in idx])  # [N, n*H], samples in order
    tensors = {"input_ids": torch.tensor([t for i in idx for t in samples[i].input_ids], dtype=torch.int32),
               "loss_mask": torch.tensor([m for i in idx for m in samples[i].loss_mask], dtype=torch.uint8),
               "offsets": torch.tensor([0] + [len(samples[i].input_ids) for i in idx]).cumsum(0)}
    if dtype == "fp8":
        tensors["features"], tensors["scales"] = quantize_fp8(rows, n_taps)
    else:
        tensors["features"] = rows.to(STORAGE[dtype]).contiguous()
    ids = [samples[i].id for i in idx]
    name = _shard_name(k)
    # One metadata key: safetensors writes a metadata dict in hash order, and the bytes (and so
    # the checksum) of identical shards would differ from run to run.
    meta = json.dumps({"ids": ids, "layer_ids": layer_ids, "dtype": dtype}, sort_keys=True)
    atomic_save(lambda tmp: save_file(tensors, tmp, metadata={"dflashkit": meta}), out / f"{name}.safetensors")
    digest = sha256_file(out / f"{name}.safetensors")
    atomic_write_json(out / f"{name}.json", {
        "file": f"{name}.safetensors", "sha256": digest, "bytes": (out / f"{name}.safetensors").stat().st_size,
        "first_sample": start, "num_samples": end - start, "num_tokens": int(tensors["offsets"][-1]),
        "supervised_tokens": int(tensors["loss_mask"].sum()), "ids": ids})


def write_manifest(out: Path, settings: dict[str, Any], num_shards: int) -> dict[str, Any] | None:
    """The manifest, written once every shard is finished (by whichever rank finishes last)."""
    parts = []
    for k in range(num_shards):
        p = out / f"{_shard_name(k)}.json"
        if not p.exists():
            return None
        parts.append(json.loads(p.read_text()))
    shards = [{k: v for k, v in s.items() if k != "ids"} for s in parts]
    tokens = sum(s["num_tokens"] for s in shards)
    size = sum(s["bytes"] for s in shards)
    manifest = {**settings, "num_shards": num_shards, "num_tokens": tokens,
                "supervised_tokens": sum(s["supervised_tokens"] for s in shards), "bytes": size,
                "bytes_per_token": round(size / tokens, 2), "shards": shards}
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


# ---- reading ---------------------------------------------------------------------------------------


class _ShardEntry(BaseModel):
    model_config = ConfigDict(strict=True)
    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)
    first_sample: int = Field(ge=0)
    num_samples: int = Field(ge=1)
    num_tokens: int = Field(ge=0)


class _Manifest(BaseModel):
    """The manifest's fields that reading relies on (others are informative)."""
    model_config = ConfigDict(strict=True)
    format: Literal["dflashkit-features/1"]
    target: dict[str, Any]
    layer_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    hidden_size: int = Field(ge=1)
    dtype: Literal["bfloat16", "float16", "float32", "fp8"]
    num_samples: int = Field(ge=0)
    num_shards: int = Field(ge=0)
    shards: list[_ShardEntry]


def read_manifest(mpath: Path) -> dict[str, Any]:
    """manifest.json, its values checked: types and ranges, shards that cover the samples in order."""
    try:
        raw = json.loads(mpath.read_bytes().decode("utf-8"))
        m = _Manifest.model_validate(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath}: not valid JSON ({e}); extract the features again") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "top level"
        raise ValueError(f"{mpath}: field '{where}': {err['msg']} (got {repr(err.get('input'))[:80]})") from None
    start = 0
    for k, s in enumerate(m.shards):
        if s.first_sample != start:
            raise ValueError(f"{mpath}: field 'shards.{k}.first_sample' is {s.first_sample}, expected {start} "
                             "(shards hold consecutive samples)")
        start += s.num_samples
    if start != m.num_samples or len(m.shards) != m.num_shards:
        raise ValueError(f"{mpath}: {len(m.shards)} shards of {start} samples, but num_shards is {m.num_shards} "
                         f"and num_samples {m.num_samples}")
    return raw


def shard_file(directory: Path, name: str) -> Path:
    """A shard named in a manifest: a plain file name inside `directory`, never a path out of it
    (no '/', '..' or absolute path, no link that leads elsewhere)."""
    f = directory / name
    if Path(name).name != name or name in (".", "..") or "\\" in name or f.resolve().parent != directory.resolve():
        raise ValueError(f"{directory / 'manifest.json'}: shard file {name!r} is not a file name inside {directory}")
    return f


# dtype names in a safetensors header, by storage dtype
_HEADER_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8": "F8_E4M3"}


def shard_index(f: Path, entry: dict[str, Any], manifest: dict[str, Any]) -> tuple[list[int], list[str]]:
    """(offsets, ids) of a shard, after checking its tensors' names, dtypes and shapes, its offsets
    (from 0, non-decreasing, ending at its row count) and its metadata against the manifest."""
    from safetensors import SafetensorError

    n, rows, taps = entry["num_samples"], entry["num_tokens"], len(manifest["layer_ids"])
    want = {"input_ids": ("I32", [rows]), "loss_mask": ("U8", [rows]), "offsets": ("I64", [n + 1]),
            "features": (_HEADER_DTYPES[manifest["dtype"]], [rows, taps * manifest["hidden_size"]])}
    if manifest["dtype"] == "fp8":
        want["scales"] = ("F32", [rows, taps])
    try:
        with safe_open(str(f), "pt") as sf:
            have = {k: (sf.get_slice(k).get_dtype(), sf.get_slice(k).get_shape()) for k in sf.keys()}
            if have != want:
                raise ValueError(f"tensors {have}, expected {want}")
            meta = json.loads((sf.metadata() or {}).get("dflashkit", "null"))
            offsets, ids, mask = sf.get_tensor("offsets"), sf.get_tensor("input_ids"), sf.get_tensor("loss_mask")
    except (SafetensorError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a readable feature shard ({e})") from None
    except ValueError as e:
        raise ValueError(f"{f}: {e}"[:400]) from None
    ok_meta = (isinstance(meta, dict) and meta.get("layer_ids") == manifest["layer_ids"]
               and meta.get("dtype") == manifest["dtype"] and isinstance(meta.get("ids"), list)
               and len(meta["ids"]) == n and all(isinstance(i, str) for i in meta["ids"]))
    if not ok_meta:
        raise ValueError(f"{f}: metadata 'dflashkit' does not match the manifest (expected {n} sample ids, "
                         f"layer_ids {manifest['layer_ids']}, dtype {manifest['dtype']!r})")
    if int(offsets[0]) != 0 or int(offsets[-1]) != rows or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{f}: tensor 'offsets' must rise from 0 to its {rows} rows")
    if bool((ids < 0).any()) or bool((mask > 1).any()):
        raise ValueError(f"{f}: tensor 'input_ids' holds negative token ids or 'loss_mask' values other than 0 and 1")
    return offsets.tolist(), meta["ids"]


class FeatureCache:
    """Read an extracted feature directory as a sequence of `FeatureSample`s (features
    de-quantised to `dtype`). Picklable (no open files), so DataLoader workers can share it."""

    def __init__(self, path: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        """Opening checks the manifest's values, that every shard lies inside the directory, and
        every shard's size and sha256 (read once, on parallel threads); each shard's tensors are
        checked against the manifest when first read."""
        self.path, self.dtype = Path(path), dtype
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            hint = (" (extraction is unfinished: run `dflashkit extract` again to complete it)"
                    if (self.path / "settings.json").exists() else "")
            raise FileNotFoundError(f"{mpath} does not exist{hint}")
        self.manifest: dict[str, Any] = read_manifest(mpath)
        for s in self.manifest["shards"]:
            f = shard_file(self.path, s["file"])
            if not f.is_file() or f.stat().st_size != s["bytes"]:
                raise ValueError(f"{f}: missing or not the size the manifest records ({s['bytes']} bytes)")
        bad = self.verify()
        if bad:
            raise ValueError(f"{bad[0]}" + (f" (and {len(bad) - 1} more shards)" if len(bad) > 1 else ""))
        self._starts = [s["first_sample"] for s in self.manifest["shards"]]
        self._index: dict[int, tuple[list[int], list[str]]] = {}  # shard -> (offsets, ids), read on first use

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def ids(self) -> list[str]:
        """Every sample id, in order (read from the shards' metadata)."""
        return [sid for k in range(len(self.manifest["shards"])) for sid in self._shard(k)[1]]

    def verify(self) -> list[str]:
        """Shards whose sha256 differs from the manifest's, hashed on threads (hashlib releases the
        GIL); under torchrun each rank hashes its share (shard k on rank k % world): one read in all."""
        rank, world = _dist_rank_world()
        shards = self.manifest["shards"][rank::world]
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda s: sha256_file(self.path / s["file"]), shards))
        return [f"{self.path / s['file']}: sha256 differs from the one the manifest records (damaged or replaced); "
                "extract the features again" for s, d in zip(shards, digests) if d != s["sha256"]]

    def target_problems(self, target: Any) -> list[str]:
        """Why these features may not be `target`'s (empty when the identities agree)."""
        have, want = self.manifest["target"], target_identity(target)
        return [f"feature cache {self.path}: target {k} is {have.get(k)!r}, the target given has {want[k]!r}"
                for k in want if k != "name" and have.get(k) != want[k]]

    def _shard(self, k: int) -> tuple[list[int], list[str]]:
        if k not in self._index:
            self._index[k] = shard_index(self.path / self.manifest["shards"][k]["file"], self.manifest["shards"][k],
                                         self.manifest)
        return self._index[k]

    def __getitem__(self, i: int) -> FeatureSample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        i %= len(self)
        k = bisect_right(self._starts, i) - 1
        offsets, ids = self._shard(k)
        j = i - self._starts[k]
        a, b = offsets[j], offsets[j + 1]
        with safe_open(str(self.path / self.manifest["shards"][k]["file"]), "pt") as f:
            feats = f.get_slice("features")[a:b]
            if self.manifest["dtype"] == "fp8":
                feats = dequantize_fp8(feats, f.get_slice("scales")[a:b], self.dtype)
            return FeatureSample(id=ids[j], input_ids=f.get_slice("input_ids")[a:b].long(),
                                 loss_mask=f.get_slice("loss_mask")[a:b].bool(), features=feats.to(self.dtype))


# ---- CLI: dflashkit extract ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options, positive_int

    p.add_argument("--input", metavar="JSONL", help="tokenized samples (default: data.tokenized)")
    p.add_argument("--out", metavar="DIR", help="feature directory (default: data.features)")
    p.add_argument("--shard-size", type=positive_int, default=1 << 16, help="tokens per shard (at most)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.data.chat import load_tokenized
    from dflashkit.drafter import default_target_layer_ids
    from dflashkit.parallel import load_configured_target
    from dflashkit.rundir import output_directory

    cfg = config_from_args(args)
    src, out = args.input or cfg.data.tokenized, args.out or cfg.data.features
    if not src or not out:
        raise ValueError("extract needs an input (--input or data.tokenized=PATH) and an output (--out or data.features=DIR)")
    samples = load_tokenized(src)
    rank, world = _dist_rank_world()
    device = resolve_device(cfg.target.device)
    if device == "cuda" and world > 1:
        device = f"cuda:{os.environ.get('LOCAL_RANK', rank)}"
    # Each rank of a job holds a lock of its own (they share the directory); a second job meets
    # rank 0's at once, before its target loads.
    with output_directory(out, "extract", lock=".lock" if rank == 0 else f".lock.rank{rank}"):
        target = load_configured_target(cfg.target, torch.device(device))
        layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(target.num_layers, cfg.drafter.num_taps)
        t0 = time.perf_counter()
        manifest = extract_features(target, samples, layer_ids, out, dtype=cfg.data.feature_dtype,
                                    batch_size=cfg.data.batch_size, shard_size=args.shard_size, rank=rank, world=world)
        dt = time.perf_counter() - t0
    if manifest is None:
        print(f"rank {rank}: shards done in {dt:.1f}s; the manifest is written by the last rank to finish")
    else:
        print(f"{out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, layers {layer_ids}, "
              f"{manifest['dtype']}: {manifest['bytes'] / 2**20:.1f} MiB ({manifest['bytes_per_token']} bytes/token); "
              f"this run {dt:.1f}s")
    return 0
