"""`target.parallel=shard`: the frozen target's decoder layers sharded over gloo ranks (FSDP2) give
the whole target's features, extraction and training, on a dense and a hybrid target."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from datahelpers import save_tiny_target
from dflashkit.config import ConfigError, load_config
from dflashkit.data.features import FeatureCache, extract_features
from dflashkit.target import load_target
from shard_job import EXTRACT_SHARD_TOKENS, LAYERS, extract_samples, run_rank
from train_job import losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("targets")
    return {"dense": str(save_tiny_target(root / "dense", num_layers=6)),
            "hybrid": str(save_tiny_target(root / "hybrid", num_layers=6, hybrid=True))}


def _spawn(world: int, work: Path, dirs: dict[str, str], trained: list[str], local_world: int) -> list[dict]:
    mp.spawn(run_rank, args=(world, _free_port(), str(work), dirs, trained, local_world), nprocs=world, join=True)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]


def _check_features(ranks: list[dict], world: int) -> None:
    for rank, result in enumerate(ranks):
        for what, r in result.items():
            assert r["error"] <= 1e-5, (rank, what, r)
            assert r["share"] == pytest.approx(1 / world, abs=0.02), (rank, what, r)  # its shard, not the whole
            assert r.get("head_equal", True), (rank, what)
        assert result["loaded/dense"]["tied"]  # the tied embedding and LM head stay one tensor


def _check_extract(work: Path, dirs: dict[str, str], tmp_path: Path) -> None:
    """The sharded ranks' cache holds one process's features."""
    one = extract_features(load_target(dirs["dense"]), extract_samples(), LAYERS, tmp_path / "one", dtype="float32",
                           batch_size=3, shard_size=EXTRACT_SHARD_TOKENS)
    assert one["num_shards"] == 7  # unequal shares over 2 and over 4 ranks
    want, got = FeatureCache(tmp_path / "one"), FeatureCache(work / "extract")
    assert len(got) == len(want) == len(extract_samples())
    for a, b in zip(got, want):
        assert a.id == b.id and a.input_ids.equal(b.input_ids) and a.loss_mask.equal(b.loss_mask)
        assert float((a.features - b.features).abs().max()) <= 1e-5


def _check_training(work: Path, trained: list[str]) -> None:
    for name in trained:
        ref = losses(work / f"train-{name}-replicate")
        assert sorted(ref) == list(range(1, 21))
        assert losses(work / f"train-{name}-shard") == ref, name
        assert losses(work / f"train-{name}-shard", "eval") == losses(work / f"train-{name}-replicate", "eval"), name


def _check_resume(work: Path) -> None:
    """Resumed at step 10 under sharding: steps 11..20 and the final weights bit for bit."""
    from safetensors.torch import load_file

    full, resumed = work / "train-dense-shard", work / "train-dense-shard-resumed"
    ref = losses(full)
    assert losses(resumed) == {s: ref[s] for s in range(11, 21)}
    a, b = load_file(full / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_two_ranks_shard_the_target(tmp_path, dirs):
    work = tmp_path / "work"
    ranks = _spawn(2, work, dirs, ["dense", "hybrid"], local_world=2)
    _check_features(ranks, 2)
    _check_extract(work, dirs, tmp_path)
    _check_training(work, ["dense", "hybrid"])
    _check_resume(work)


def test_four_ranks_shard_the_target(tmp_path, dirs):
    """Features over 4 ranks; training as on 2 nodes of 2 (sharded within a node, replicated across)."""
    work = tmp_path / "work"
    ranks = _spawn(4, work, dirs, ["dense"], local_world=2)
    _check_features(ranks, 4)
    _check_extract(work, dirs, tmp_path)
    _check_training(work, ["dense"])
    _check_resume(work)


def test_the_setting_is_checked():
    assert load_config(None, []).target.parallel == "replicate"
    with pytest.raises(ConfigError, match="target.parallel"):
        load_config(None, ["target.parallel=tensor"])
