"""Typed configuration: recipe defaults, YAML + overrides, one readable line per bad field."""

from __future__ import annotations

import pytest

from dflashkit.cli import main
from dflashkit.config import ConfigError, load_config
from dflashkit.drafter import default_gamma, default_target_layer_ids


def test_defaults_are_the_recipe():
    c = load_config()
    assert (c.train.lr, c.train.weight_decay, c.train.warmup_ratio, c.train.grad_clip) == (6e-4, 0.0, 0.04, 1.0)
    assert c.train.anchors_per_seq == 512 and c.drafter.block_size == 16 and c.train.loss == "ce"
    assert c.train.feature_noise == 0.0
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]


def test_default_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1.0e-4\n  batch_size: 4\ndrafter:\n  num_layers: 2\n")
    c = load_config(f, ["train.lr=3e-4", "drafter.layer_types=[full_attention, sliding_attention]", "drafter.sliding_window=64"])
    assert c.train.lr == 3e-4 and c.train.batch_size == 4 and c.drafter.layer_types[1] == "sliding_attention"


@pytest.mark.parametrize("override,match", [
    ("train.lr=fast", r"field 'train.lr'.*valid number.*'fast'"),
    ("train.lrr=1", r"unknown field 'train.lrr'"),
    ("drafter.block_size=1", r"field 'drafter.block_size'.*greater than or equal to 2"),
    ("train.loss=mse", r"field 'train.loss'.*'ce', 'kl' or 'dpace'"),
    ("lr=1", r"expected section.field=value"),
    ("drafter.layer_types=[sliding_attention,full_attention,full_attention,full_attention,full_attention]",
     r"sliding_window must be set"),
])
def test_bad_fields_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"c.yaml: expected a mapping"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_config_prints_and_fails_cleanly(capsys):
    assert main(["config", "train.lr=0.001"]) == 0
    assert "lr: 0.001" in capsys.readouterr().out
    assert main(["config", "train.lr=x"]) == 1
    err = capsys.readouterr().err
    assert "train.lr" in err and "Traceback" not in err


def test_config_dump_with_comments_reads_back(tmp_path):
    """`dflashkit config > my.yaml` gives a config that documents itself and loads as it was."""
    from dflashkit.config import dump_config, load_config

    cfg = load_config(None, ["train.output_dir=runs/a #1", "drafter.target_layer_ids=[1,2,3,4,5]",
                             "eval.ddtree_budgets=[16]", "train.lr=3e-4"])
    text = dump_config(cfg, comments=True)
    assert "  loss: ce  # ce: the recipe (hard labels, slot decay gamma); values: ce, kl, dpace" in text.splitlines()
    assert "  batch_size: 16  # sequences per optimiser step (global)" in text.splitlines()
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml") == cfg


def test_cli_version_names_the_stack(capsys):
    import torch
    from importlib.metadata import version

    with pytest.raises(SystemExit, match="0"):
        main(["--version"])
    out = capsys.readouterr().out
    assert out.startswith(f"dflashkit {version('dflashkit')} (torch {version('torch')}, transformers ")
    # the installed distribution is the torch that runs (a wheel's metadata may omit a local label such as +cu130)
    assert torch.__version__.split("+")[0] == version("torch").split("+")[0]


@pytest.mark.parametrize("override,match", [
    ("train.max_steps=true", r"field 'train.max_steps'.*not a boolean"),
    ("train.lr=.inf", r"field 'train.lr'.*finite number"),
    ("train.tensorboard=1", r"field 'train.tensorboard'.*valid boolean"),
    ("data.seed=1180591620717411303424", r"field 'data.seed'.*less than or equal"),
    ("drafter.target_layer_ids=[1,-2]", r"field 'drafter.target_layer_ids.1'.*greater than or equal to 0"),
    ("drafter.target_layer_ids=[1,1]", r"field 'drafter.target_layer_ids'.*\[1, 1\] taps a layer twice; expected "
                                       r"distinct layers"),
])
def test_numbers_are_strict(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])
    assert load_config(None, ["train.lr=1e-3", "train.max_steps=5"]).train.max_steps == 5  # YAML strings still parse


def test_default_taps_are_distinct():
    assert default_target_layer_ids(4, 2) == [1, 2]  # the formula would give [1, 1]
    assert default_target_layer_ids(4, 3) == [0, 1, 2]
    for L in range(2, 40):
        for n in range(1, L):
            ids = default_target_layer_ids(L, n)
            assert len(set(ids)) == n and all(0 <= i < L for i in ids) and (n == 1 or L - 1 not in ids), (L, n, ids)
    with pytest.raises(ValueError, match="too shallow for 4 distinct taps"):
        default_target_layer_ids(4, 4)


def test_cli_error_boundary(tmp_path, capsys, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_bytes(bytes(range(256)))
    assert main(["config", "--config", str(f)]) == 1
    assert f"{f}: not a text file" in capsys.readouterr().err
    # An unexpected exception is a bug: one line saying so, the traceback behind --debug.
    monkeypatch.setattr("dflashkit.config.dump_config", lambda cfg, **kw: {}["boom"])
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "internal error: KeyError: 'boom'" in err and "--debug" in err and "Traceback" not in err
    with pytest.raises(KeyError):
        main(["config", "--debug"])
    with pytest.raises(SystemExit):  # not an override: argparse's usage error
        main(["config", "--bogus"])


def test_every_shipped_config_file_validates():
    # a recipe in configs/ that no longer loads would fail a user at the start of a GPU job
    from pathlib import Path

    from dflashkit.data.selfprompts import read_spec

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for f in configs:
        if f.name.startswith("self_prompts"):  # a `data.self_prompts` file, not a Config
            assert read_spec(f).weights["chat"] > 0, f
        else:
            load_config(f)
