"""`target.parallel=shard`: the frozen target's decoder layers sharded over gloo ranks (FSDP2) give
the whole target's features, extraction and training, on a dense and a hybrid target."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from datahelpers import save_tiny_target
from dflashkit.config import ConfigError, load_config
from dflashkit.data.features import FeatureCache
from shard_job import extract_samples, forwards_per_rank, run_rank
from train_job import losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    """A hybrid whose embedding and LM head are tied, saved with a tokenizer."""
    return str(save_tiny_target(tmp_path_factory.mktemp("target") / "hybrid", num_layers=6, hybrid=True))


def _spawn(world: int, work: Path, path: str, trained: list[str], resume: bool, local_world: int) -> list[dict]:
    mp.spawn(run_rank, args=(world, _free_port(), str(work), path, trained, resume, local_world), nprocs=world,
             join=True)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]


def _check_features(ranks: list[dict], world: int) -> None:
    for rank, result in enumerate(ranks):
        for what, r in result.items():
            assert r["error"] <= 1e-5, (rank, what, r)
            assert r["share"] == pytest.approx(1 / world, abs=0.02), (rank, what, r)  # its shard, not the whole
        assert result["loaded"]["head_equal"] and result["loaded"]["tied"], rank  # tied: one tensor still


def _check_extract(work: Path, world: int) -> None:
    """The sharded ranks' cache holds one process's features (ranks with unequal numbers of forwards)."""
    assert len(set(forwards_per_rank(world))) > 1
    want, got = FeatureCache(work / "one"), FeatureCache(work / "extract")
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


def test_two_ranks_shard_the_target(tmp_path, hybrid_dir):
    ranks = _spawn(2, tmp_path, hybrid_dir, ["dense", "hybrid"], resume=True, local_world=2)
    _check_features(ranks, 2)
    _check_extract(tmp_path, 2)
    _check_training(tmp_path, ["dense", "hybrid"])
    _check_resume(tmp_path)


def test_four_ranks_shard_the_target(tmp_path, hybrid_dir):
    """Features over 4 ranks; training as on 2 nodes of 2 (sharded within a node, replicated across),
    the drafter data-parallel (DDP) or sharded too (FSDP2: the same losses up to float rounding)."""
    ranks = _spawn(4, tmp_path, hybrid_dir, ["dense"], resume=False, local_world=2)
    _check_features(ranks, 4)
    _check_extract(tmp_path, 4)
    _check_training(tmp_path, ["dense"])
    assert losses(tmp_path / "train-dense-shard-fsdp") == pytest.approx(losses(tmp_path / "train-dense-shard"), rel=1e-5)


def test_probes_need_the_whole_target(monkeypatch):
    from dflashkit.parallel import training_target

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["target.parallel=shard", "train.probes=suites"])
    with pytest.raises(ValueError, match="train.probes: .*target.parallel=shard"):
        training_target(cfg, None, torch.device("cpu"))


def test_the_setting_is_checked():
    assert load_config(None, []).target.parallel == "replicate"
    with pytest.raises(ConfigError, match="target.parallel"):
        load_config(None, ["target.parallel=tensor"])
