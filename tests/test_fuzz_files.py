"""Damaged files: seeded random byte flips and truncations of a checkpoint directory (with its
training state), a feature cache and a tokenized file, loaded in this process (and a few through
the CLI). Every outcome is either the same result as the intact file's or the project's readable
error (one line naming the file; exit code 1 from the CLI), never another exception and never
damaged data taken silently (the recorded checksums are what catch value flips).

Also: hand-crafted values in a training state, manifest paths that leave their directory, shard
offsets past the data, and a torn last line of `metrics.jsonl` on resume (end to end)."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_drafter
from datahelpers import run_cli, save_tiny_target
from dflashkit.checkpoint import (SUMS, CheckpointError, atomic_write_json, load_drafter, load_training_state,
                                  save_drafter, sha256_file)
from dflashkit.cli import expected_errors
from dflashkit.data.chat import load_tokenized
from dflashkit.data.features import FeatureCache, extract_features
from dflashkit.target import load_target
from test_checkpoint import _Payload
from train_job import run_job, tiny_samples

CASES_PER_FILE = 60  # flips and truncations of each file: several hundred cases in all


def damage(data: bytes, rng: random.Random) -> bytes:
    """One random byte flipped (1 to 8 of its bits), or the data cut at a random length."""
    if rng.random() < 0.25 or not data:
        return data[:rng.randrange(len(data))] if data else data
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1:]


def fuzz(files: list[Path], load: Callable[[], Any], same: Callable[[Any], bool], seed: int,
         names: str) -> dict[str, int]:
    """Damage each of `files` CASES_PER_FILE times (each case alone, the file restored after it);
    `load()` must give a result that `same` accepts or raise an expected error naming `names`."""
    rng = random.Random(seed)
    seen = {"refused": 0, "same": 0}
    for f in files:
        intact = f.read_bytes()
        for case in range(CASES_PER_FILE):
            f.write_bytes(damage(intact, rng))
            try:
                got = load()
            except expected_errors() as e:
                msg = str(e)
                assert names in msg and "\n" not in msg, f"{f.name} case {case}: unreadable error {msg!r}"
                seen["refused"] += 1
            else:
                assert same(got), f"{f.name} case {case}: damaged data taken silently"
                seen["same"] += 1
            finally:
                f.write_bytes(intact)
    return seen


def _state_equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _training_state(drafter) -> dict[str, Any]:
    params = {k: v.float() for k, v in drafter.state_dict().items()}
    return {"version": 1, "step": 3, "total_steps": 10, "batch_size": 4, "num_train": 20,
            "best": {"tau_sim": 1.5, "step": 2}, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "params": params, "optimizer": {k: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(v)}
                                            for k, v in params.items()},
            "scheduler": {"base_lrs": [6e-4], "last_epoch": 3, "_last_lr": [5e-4], "lr_lambdas": [None]}}


@pytest.fixture(scope="module")
def checkpoint(tiny_target, tmp_path_factory):
    d = make_tiny_drafter(tiny_target)
    path = save_drafter(d, tmp_path_factory.mktemp("ck") / "ck", training_state=_training_state(d))
    return path, d.state_dict(), load_training_state(path)


def _load_checkpoint(path: Path) -> tuple[dict, dict]:
    return load_drafter(path).state_dict(), load_training_state(path)


def test_damaged_checkpoint_is_refused_or_identical(checkpoint):
    path, weights, state = checkpoint
    files = [path / n for n in ("config.json", "model.safetensors", "training_state.pt", SUMS)]
    seen = fuzz(files, lambda: _load_checkpoint(path), lambda got: _state_equal(got, (weights, state)), 0, str(path))
    assert seen["refused"] > 0.9 * len(files) * CASES_PER_FILE, seen


def test_damaged_checkpoint_without_sums_gives_only_readable_errors(checkpoint, tmp_path):
    """A published drafter has no SHA256SUMS: a flipped weight cannot be told from a trained one, but
    every damage that breaks the format or a value's type or range is one readable error."""
    path = tmp_path / "published"
    shutil.copytree(checkpoint[0], path)
    (path / SUMS).unlink()
    files = [path / n for n in ("config.json", "model.safetensors", "training_state.pt")]
    seen = fuzz(files, lambda: _load_checkpoint(path), lambda got: True, 1, str(path))
    assert seen["refused"] > 0, seen


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("feats")
    target = load_target(save_tiny_target(root / "model", num_layers=4, hidden=32))
    samples = tiny_samples(6)
    extract_features(target, samples, [1, 2], root / "cache", batch_size=3, shard_size=80)
    return root / "cache", target


def _cache_view(path: Path, target) -> tuple:
    """What a reader of the cache gets: every sample, the layers and sizes, and whether it fits the target."""
    c = FeatureCache(path)
    samples = [(s.id, s.input_ids.tolist(), s.loss_mask.tolist(), s.features) for s in (c[i] for i in range(len(c)))]
    return samples, c.layer_ids, c.hidden_size, c.target_problems(target)


def test_damaged_feature_cache_is_refused_or_identical(feature_cache):
    path, target = feature_cache
    ref = _cache_view(path, target)
    assert len(json.loads((path / "manifest.json").read_text())["shards"]) >= 2

    def same(got: tuple) -> bool:
        """The same samples and layers; a damaged target identity is caught where the cache is used
        (train and eval refuse a cache whose `target_problems` are not empty)."""
        (s1, layers, hidden, problems), (s2, *rest) = got, ref
        return [layers, hidden] == rest[:2] and (problems == rest[2] or bool(problems)) and len(s1) == len(s2) and all(
            a[:3] == b[:3] and torch.equal(a[3], b[3]) for a, b in zip(s1, s2))

    files = [path / "manifest.json", *sorted(path.glob("shard-*.safetensors"))]
    seen = fuzz(files, lambda: _cache_view(path, target), same, 2, str(path))
    assert seen["refused"] > 0.5 * len(files) * CASES_PER_FILE, seen


def test_damaged_tokenized_file_is_refused_or_identical(tmp_path):
    from dflashkit.data.chat import load_tokenizer, tokenize_file

    src = tmp_path / "chats.jsonl"
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                          {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(8)]
    src.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "tok.jsonl"
    tokenize_file(src, load_tokenizer(), out, max_length=256)
    ref = load_tokenized(out)
    seen = fuzz([out, out.with_name("tok.jsonl.sha256")], lambda: load_tokenized(out), lambda got: got == ref, 3,
                str(tmp_path))
    assert seen["refused"] > 0.9 * 2 * CASES_PER_FILE, seen


def test_damaged_files_through_the_cli_exit_1(checkpoint, feature_cache, tmp_path):
    """A few damaged files given to commands: one line, exit code 1."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint[0], ck)
    w = ck / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x10  # one bit of one weight: the format is intact, only the sum can tell
    w.write_bytes(bytes(data))
    res = run_cli("export", str(ck), "--out", str(tmp_path / "exp"))
    assert res.returncode == 1 and "differs from the SHA-256 recorded" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr

    cache = tmp_path / "cache"
    shutil.copytree(feature_cache[0], cache)
    shard = sorted(cache.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # the same size: only the recorded sha256 tells
    shard.write_bytes(bytes(data))
    res = run_cli("check-features", str(feature_cache[0]), str(cache))
    assert res.returncode == 1 and f"{shard}: sha256 differs" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


# ---- crafted values ----------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,expected", [
    ("step", "3", "'step': expected a step number"),
    ("step", -4, "'step': expected a step number"),
    ("step", 11, "'step': 11 is past total_steps 10"),
    ("total_steps", 0, "'total_steps': expected an integer >= 1"),
    ("rng", [1, 2], "'rng': expected"),
    ("rng", {"torch": torch.zeros(3), "python": random.getstate()}, "'rng': expected"),
    ("optimizer", ["adam"], "'optimizer': expected parameter name"),
    ("best", 0.5, "'best': expected"),
    ("params", {"fc.weight": torch.tensor([float("nan")])}, "'params': expected parameter name -> finite"),
    ("scheduler", {"last_epoch": "3"}, "'scheduler': expected"),
    ("scheduler", {"last_epoch": 3, "lr_lambdas": [{"x": 1}]}, "'scheduler': expected"),
])
def test_training_state_values_are_checked(tiny_target, tmp_path, field, value, expected):
    d = make_tiny_drafter(tiny_target)
    state = _training_state(d)
    state[field] = value
    save_drafter(d, tmp_path / "ck", training_state=state)  # its sums match: only the values are wrong
    with pytest.raises(CheckpointError, match=rf"ck/training_state.pt: malformed training state, field {expected}"):
        load_training_state(tmp_path / "ck")


def test_a_cut_sums_file_leaves_nothing_unchecked(checkpoint, tmp_path):
    """SHA256SUMS cut at a line's end (it lists config and weights, not the training state): the
    state it no longer lists is refused, not loaded unchecked; an emptied one refuses every file."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint[0], ck)
    lines = (ck / SUMS).read_text().splitlines(keepends=True)
    (ck / SUMS).write_text("".join(n for n in lines if "training_state" not in n))
    load_drafter(ck)
    with pytest.raises(CheckpointError, match=r"ck/training_state.pt: not listed in .*SHA256SUMS"):
        load_training_state(ck)
    (ck / SUMS).write_text("")
    with pytest.raises(CheckpointError, match=r"ck/config.json: not listed in"):
        load_drafter(ck)


def test_checkpoint_config_values_are_checked(tiny_target, tmp_path):
    save_drafter(make_tiny_drafter(tiny_target), tmp_path / "ck")
    (tmp_path / "ck" / SUMS).unlink()
    cfg_file = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for field, value in [("rms_norm_eps", "1e-6"), ("block_size", 1.5), ("sliding_window", -1), ("rope_theta", 0)]:
        cfg_file.write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(CheckpointError, match=rf"config.json: field '{field}': expected"):
            load_drafter(tmp_path / "ck")
    cfg_file.write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"], "target_layer_ids": ["1"]}}))
    with pytest.raises(CheckpointError, match=r"field 'dflash_config.target_layer_ids': expected a list of layer indices"):
        load_drafter(tmp_path / "ck")


def _rewrite_manifest(path: Path, change: Callable[[dict], None]) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    atomic_write_json(path / "manifest.json", m)


def test_manifest_paths_stay_inside_the_cache(feature_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache[0], cache)
    intact = (cache / "manifest.json").read_bytes()
    outside = tmp_path / "outside.safetensors"
    shutil.copy(cache / "shard-00000.safetensors", outside)
    (cache / "link.safetensors").symlink_to(outside)
    for name in ["../outside.safetensors", str(outside), "link.safetensors", "sub/../shard-00000.safetensors"]:
        _rewrite_manifest(cache, lambda m: m["shards"][0].update(file=name))
        with pytest.raises(ValueError, match="is not a file name inside"):
            FeatureCache(cache)
        (cache / "manifest.json").write_bytes(intact)
    _rewrite_manifest(cache, lambda m: m.update(num_samples="6"))
    with pytest.raises(ValueError, match=r"manifest.json: field 'num_samples': Input should be a valid integer \(got '6'\)"):
        FeatureCache(cache)
    (cache / "manifest.json").write_bytes(intact)
    _rewrite_manifest(cache, lambda m: m["shards"][1].update(first_sample=0))
    with pytest.raises(ValueError, match=r"field 'shards.1.first_sample' is 0, expected"):
        FeatureCache(cache)


def test_shard_offsets_past_the_data_are_refused(feature_cache, tmp_path):
    """A shard rewritten with consistent sums (as a crafted one would be) whose offsets point past
    its rows: refused when the shard is first read, naming the tensor."""
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache[0], cache)
    shard = cache / "shard-00000.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(shard)
    tensors["offsets"] = tensors["offsets"].clone()
    tensors["offsets"][-1] += 1000
    save_file(tensors, shard, metadata=meta)
    _rewrite_manifest(cache, lambda m: m["shards"][0].update(sha256=sha256_file(shard), bytes=shard.stat().st_size))
    c = FeatureCache(cache)
    with pytest.raises(ValueError, match=rf"{shard}: tensor 'offsets' must rise from 0 to its \d+ rows"):
        c[0]


# ---- append-only logs ---------------------------------------------------------------------------


def test_a_torn_metrics_line_does_not_block_resume(tmp_path, caplog):
    """Killed in the middle of writing a metrics record after its last checkpoint: `--resume`
    drops the half line (saying so), continues, and logs every step once."""
    from dflashkit.train import TrainingStopped

    out = tmp_path / "run"
    with pytest.raises(TrainingStopped):
        run_job(str(out), ["train.save_every=100", "train.eval_every=100"], signal_at=3)
    metrics = out / "metrics.jsonl"
    with open(metrics, "ab") as f:
        f.write(b'{"step": 4, "kind": "train", "loss": 3.1')  # the kill cut this write
    run_job(str(out), ["train.save_every=100", "train.eval_every=100"], resume=True)
    assert "dropping an incomplete last line" in caplog.text
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("write", [torch.save, lambda obj, f: f.write_bytes(pickle.dumps(obj))],
                         ids=["torch.save", "raw-pickle"])
def test_a_crafted_pickled_target_is_one_readable_refusal(tmp_path, write):
    """A target whose weights are a crafted pytorch_model.bin (torch's archive or a raw pickle): exit
    1 with one line that names the target, nothing else on stderr (not torch's warning about the
    pickle protocol), never torch's advice to load it with weights_only=False, and the payload
    never runs."""
    model = save_tiny_target(tmp_path / "model")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    write({"model.embed_tokens.weight": _Payload(str(marker))}, model / "pytorch_model.bin")
    res = run_cli("generate", "--prompt", "hi", "--method", "ar", f"target.path={model}", "target.device=cpu")
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(err) == 1 and err[0].startswith("dflashkit generate: error: "), res.stderr
    assert f"target '{model}': a pickled weights file (*.bin) is not one that loads safely" in err[0]
    assert "weights_only" not in res.stderr and "internal error" not in res.stderr and not marker.exists()


def test_a_raw_pickle_training_state_is_refused_without_torchs_warning(tmp_path):
    """A training_state.pt that is a raw pickle, with no SHA256SUMS to refuse it first: one
    refusal naming it, no warning of torch's before it, and the payload never runs."""
    marker = tmp_path / "pwned"
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "training_state.pt").write_bytes(pickle.dumps({"step": 1, "evil": _Payload(str(marker))}))
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(CheckpointError, match=r"ck/training_state.pt: not a training state .* safely") as e:
        warnings.simplefilter("always")
        load_training_state(tmp_path / "ck")
    assert not caught, [str(w.message) for w in caught]
    assert "\n" not in str(e.value) and not marker.exists()
