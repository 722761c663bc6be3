"""Fine-tuning a published drafter: the preset, and the workflow (start from a reference-format
drafter, train on suite-labelled data, held-out split by suite, before/after τ on that split)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_target
from datahelpers import one_thread  # noqa: F401
from dflashkit.checkpoint import load_drafter, save_drafter
from dflashkit.config import Config, load_config
from dflashkit.data.chat import TokenizedSample
from dflashkit.data.features import FeatureCache, extract_features
from dflashkit.decode.engine import Engine
from dflashkit.decode.loop import generate
from dflashkit.demo import FINETUNE_LR, FINETUNE_WARMUP, bundled_drafter_dir
from dflashkit.evaluate import evaluate_offline, heldout_items
from dflashkit.train import train

REPO = Path(__file__).resolve().parents[1]


def test_finetune_preset_starts_from_the_bundled_drafter_with_a_lower_lr():
    cfg = load_config(REPO / "configs" / "finetune.yaml")
    assert (REPO / cfg.drafter.init_from).resolve() == bundled_drafter_dir().resolve()
    assert (cfg.train.lr, cfg.train.warmup_ratio) == (FINETUNE_LR, FINETUNE_WARMUP)  # what the demo uses
    assert cfg.train.lr < Config().train.lr and cfg.train.max_steps <= 500


def finetune(target, samples: list[TokenizedSample], tmp_path: Path, *overrides: str):
    """Save a tiny starting drafter, cache the samples' features, fine-tune from it with the
    preset plus `overrides` -> (start drafter, config, feature cache, output directory)."""
    start = make_tiny_drafter(target)
    save_drafter(start, tmp_path / "start")
    extract_features(target, samples, list(start.config.target_layer_ids), tmp_path / "feats", dtype="float32")
    cfg = load_config(REPO / "configs" / "finetune.yaml", [
        f"drafter.init_from={tmp_path / 'start'}", f"data.features={tmp_path / 'feats'}",
        f"train.output_dir={tmp_path / 'ft'}", "train.tensorboard=false", "target.device=cpu", *overrides])
    cache = FeatureCache(tmp_path / "feats")
    return start, cfg, cache, train(cfg, target=target, samples=cache)


def random_samples(seed: int, n: int = 8) -> list[TokenizedSample]:
    """n random 40-token sequences, the last 32 supervised: nothing to learn, for plumbing."""
    g = torch.Generator().manual_seed(seed)
    return [TokenizedSample(f"s-{i}", torch.randint(3, 120, (40,), generator=g).tolist(), [0] * 8 + [1] * 32)
            for i in range(n)]


@pytest.mark.usefixtures("one_thread")
def test_finetune_workflow_tiny(tmp_path):
    """Two suites of the target's own greedy answers; training starts from a saved drafter; the
    held-out split holds both suites, best.json has τ_sim per suite, and the adapted drafter beats
    the starting one on the held-out split (decoding rounds replayed offline)."""
    target = make_tiny_target()
    g = torch.Generator().manual_seed(0)
    samples = []
    for suite in ("alpha", "beta"):
        # a narrow domain: three prompts per suite, each seen several times (a random tiny target
        # has no structure that a drafter could generalise from in a few steps)
        prompts = [torch.randint(3, 120, (1, 8), generator=g) for _ in range(3)]
        answers = [generate(Engine(target), ids, max_new_tokens=40, method="ar").tokens for ids in prompts]
        for i in range(10):
            samples.append(TokenizedSample(f"{suite}-{i}", prompts[i % 3][0].tolist() + answers[i % 3],
                                           [0] * 8 + [1] * len(answers[i % 3])))
    start, cfg, cache, out = finetune(target, samples, tmp_path, "train.max_steps=40", "train.batch_size=4",
                                      "train.micro_batch_size=4", "train.anchors_per_seq=16", "train.eval_every=10",
                                      "train.eval_samples=4", "train.lr=3e-3")
    best = json.loads((out / "best.json").read_text())
    assert set(best["tau_sim_by_suite"]) == {"alpha", "beta"}
    held = heldout_items(cache, cfg.train.eval_samples, cfg.train.seed)
    assert sorted(s.id.split("-")[0] for s in held) == ["alpha", "alpha", "beta", "beta"]
    after = load_drafter(out / "best", target)
    rep = evaluate_offline({"before": start, "after": after}, target, held, methods=["dflash"])
    tau = {n: d["methods"]["dflash"]["tau"] for n, d in rep["drafters"].items()}
    assert tau["after"] > tau["before"] + 0.3, tau


@pytest.mark.usefixtures("one_thread")
def test_the_starting_drafter_is_a_candidate_for_best(tmp_path):
    """Fine-tuning that never improves held-out τ_sim leaves best/ = the starting drafter (step 0),
    never a worse one."""
    target = make_tiny_target()
    samples = random_samples(seed=1)
    start, _, _, out = finetune(target, samples, tmp_path, "train.max_steps=2", "train.batch_size=2",
                                "train.micro_batch_size=2", "train.anchors_per_seq=8", "train.eval_every=1",
                                "train.eval_samples=2", "train.lr=1e-12")
    assert json.loads((out / "best.json").read_text())["step"] == 0
    best = load_drafter(out / "best", target)
    for name, p in start.state_dict().items():
        torch.testing.assert_close(best.state_dict()[name], p, msg=name)


def test_a_grown_drafter_drafts_as_the_one_it_grew_from(smollm2):
    """`grow`'s new layers start as the identity: the bundled drafter with two more layers takes
    the same rounds, token for token, on a real prompt."""
    from dflashkit.drafter import grow

    bundled = load_drafter(bundled_drafter_dir(), smollm2, dtype=torch.float32)
    grown = grow(bundled, 2)
    assert grown.config.num_hidden_layers == bundled.config.num_hidden_layers + 2
    ids = smollm2.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    runs = [generate(Engine(smollm2, d), ids, max_new_tokens=24, method="dflash") for d in (bundled, grown)]
    assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
    assert max(runs[0].accept_lengths) > 1  # rounds that the drafter shaped, not τ = 1 throughout


@pytest.mark.usefixtures("one_thread")
def test_grow_layers_trains_the_new_layers(tmp_path):
    """drafter.grow_layers: training starts from the loaded drafter with more layers, whose zero
    output projections learn; the saved drafter has the grown shape."""
    target = make_tiny_target()
    samples = random_samples(seed=2)
    start, _, _, out = finetune(target, samples, tmp_path, "drafter.grow_layers=1", "train.max_steps=3",
                                "train.batch_size=2", "train.micro_batch_size=2", "train.anchors_per_seq=8",
                                "train.eval_every=100", "train.eval_samples=2", "train.lr=1e-3")
    final = load_drafter(out / "final", target)
    assert final.config.num_hidden_layers == start.config.num_hidden_layers + 1
    new = final.layers[-1]
    assert new.self_attn.o_proj.weight.abs().max() > 0 and new.mlp.down_proj.weight.abs().max() > 0


def test_grow_layers_needs_a_drafter_to_grow():
    import pytest

    with pytest.raises(ValueError, match="grow_layers needs init_from"):
        load_config(None, ["drafter.grow_layers=2"])
