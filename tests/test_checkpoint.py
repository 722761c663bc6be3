"""Reference checkpoint format: round trip, foreign directories, and one clear error per defect."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_drafter
from dflashkit.checkpoint import CheckpointError, join_drafter, load_drafter, save_drafter, split_drafter
from dflashkit.decode.cache import drafter_cache
from dflashkit.drafter import draft_block

REFERENCE_NAMES = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{{i}}.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"), "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))]


def _logits(drafter, target, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(3, 120, (1, 14))
    feats = target.forward(ids, drafter.config.target_layer_ids).features
    return target.lm_head(draft_block(drafter, target.embed, drafter_cache(drafter), feats[:, :10], ids[:, 10]))


def test_round_trip_bit_exact(tiny_target, tmp_path):
    d = make_tiny_drafter(tiny_target)
    save_drafter(d, tmp_path / "ck", training_state={"step": 7})
    d2 = load_drafter(tmp_path / "ck", tiny_target)
    for k, v in d.state_dict().items():
        assert torch.equal(v, d2.state_dict()[k]), k
    assert d2.config == d.config
    torch.testing.assert_close(_logits(d, tiny_target), _logits(d2, tiny_target), atol=0, rtol=0)
    names = set(load_file(str(tmp_path / "ck" / "model.safetensors")))
    expected = {n.format(i=i) for n in REFERENCE_NAMES for i in range(d.config.num_hidden_layers)}
    assert names == expected


def _reference_dir(tmp_path, target, n_layers=2, ids=(1, 3, 4), H=64, mask_id=127, **overrides):
    """A directory as a reference tool writes it: Qwen3 config + DFlash fields, random tensors."""
    tc = target.config
    heads, kv, hd, inter = 4, 2, 16, 128
    cfg = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 8, "bos_token_id": 1,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(ids)}, "dtype": "float32",
        "eos_token_id": 2, "head_dim": hd, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": inter, "layer_types": ["full_attention"] * n_layers, "max_position_embeddings": 512,
        "max_window_layers": n_layers, "model_type": "qwen3", "num_attention_heads": heads, "num_hidden_layers": n_layers,
        "num_key_value_heads": kv, "num_target_layers": tc.num_hidden_layers, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 128,
    }
    cfg.update(overrides)
    shapes = {"fc.weight": (H, len(ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                   p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                   p + "mlp.down_proj.weight": (H, inter)}
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) * 0.05 + (1.0 if len(s) == 1 else 0.0) for k, s in shapes.items()}
    d = tmp_path / "ref"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    return d, tensors


def test_foreign_reference_directory_loads_and_matches(tiny_target, tmp_path):
    d, tensors = _reference_dir(tmp_path, tiny_target)
    drafter = load_drafter(d, tiny_target)
    assert drafter.config.target_layer_ids == [1, 3, 4] and drafter.config.block_size == 8
    # the in-memory model built from the same tensors gives the same logits
    from dflashkit.drafter import DFlashDrafter

    mem = DFlashDrafter(drafter.config)
    mem.load_state_dict(tensors)
    torch.testing.assert_close(_logits(drafter, tiny_target), _logits(mem, tiny_target), atol=0, rtol=0)
    # and re-saving keeps foreign keys we do not interpret
    save_drafter(drafter, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["initializer_range"] == 0.02 and again["dflash_config"]["target_layer_ids"] == [1, 3, 4]


@pytest.mark.parametrize("defect,match", [
    ("missing_tensor", r"missing tensors \['layers.1.mlp.up_proj.weight'\]"),
    ("unexpected_tensor", r"unexpected tensors \['lm_head.weight'\]"),
    ("wrong_shape", r"fc.weight: expected \(64, 192\), got \(64, 128\)"),
    ("layer_id_out_of_range", r"target_layer_ids"),
    ("hidden_size", r"hidden_size 32 != target hidden size 64"),
    ("vocab", r"vocab_size 200 != target vocabulary 128"),
    ("no_mask_token", r"mask_token_id' is missing"),
    ("no_config", r"no config.json"),
])
def test_malformed_checkpoints(tiny_target, tmp_path, defect, match):
    d, tensors = _reference_dir(tmp_path, tiny_target)
    cfg = json.loads((d / "config.json").read_text())
    if defect == "missing_tensor":
        del tensors["layers.1.mlp.up_proj.weight"]
    elif defect == "unexpected_tensor":
        tensors["lm_head.weight"] = torch.zeros(128, 64)
    elif defect == "wrong_shape":
        tensors["fc.weight"] = torch.zeros(64, 128)
    elif defect == "layer_id_out_of_range":
        cfg["dflash_config"]["target_layer_ids"] = [1, 3, 9]
    elif defect == "hidden_size":
        d, tensors = _reference_dir(tmp_path, tiny_target, H=32)
        cfg = json.loads((d / "config.json").read_text())
    elif defect == "vocab":
        cfg["vocab_size"] = 200
    elif defect == "no_mask_token":
        del cfg["dflash_config"]["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    if defect == "no_config":
        (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=match):
        load_drafter(d, tiny_target)


@pytest.mark.slow
def test_mask_token_rules_smollm2(smollm2, tmp_path):
    from dflashkit.config import DrafterSettings
    from dflashkit.drafter import new_drafter
    from dflashkit.vocab import default_mask_token_id, mask_token_problems

    tok = smollm2.tokenizer
    mask = default_mask_token_id(tok, smollm2.vocab_size)
    assert mask == 16 and tok.convert_ids_to_tokens(mask) == "<empty_output>"
    for bad in (0, 1, 2):  # UNK, BOS (<|im_start|>), EOS = PAD (<|im_end|>)
        assert mask_token_problems(bad, tok, smollm2.vocab_size), bad
    assert "ordinary text token" in mask_token_problems(tok.convert_tokens_to_ids("the"), tok, smollm2.vocab_size)[0]
    drafter = new_drafter(smollm2, DrafterSettings(num_layers=1, num_taps=2))
    drafter.config.mask_token_id = 2
    save_drafter(drafter, tmp_path / "eos")
    with pytest.raises(CheckpointError, match="BOS/EOS/PAD/stop token"):
        load_drafter(tmp_path / "eos", smollm2)


class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_training_state_does_not_run_code(tmp_path):
    from dflashkit.checkpoint import load_training_state

    marker = tmp_path / "pwned"
    (tmp_path / "ck").mkdir()
    torch.save({"step": 1, "evil": _Payload(str(marker))}, tmp_path / "ck" / "training_state.pt")
    with pytest.raises(CheckpointError, match=r"ck/training_state.pt: not a training state .* safely") as e:
        load_training_state(tmp_path / "ck")
    assert not marker.exists()
    assert "Unsupported global" in str(e.value) or "unsupported GLOBAL" in str(e.value)
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)  # never torch's advice to load it unsafely


def test_malformed_training_state_and_truncated_weights(tiny_target, tmp_path):
    from dflashkit.checkpoint import load_training_state

    d = make_tiny_drafter(tiny_target)
    save_drafter(d, tmp_path / "ck", training_state={"step": 7})
    with pytest.raises(CheckpointError, match=r"training_state.pt: malformed training state, missing version"):
        load_training_state(tmp_path / "ck")
    w = tmp_path / "ck" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"ck/model.safetensors: differs from the SHA-256 recorded in .*SHA256SUMS"):
        load_drafter(tmp_path / "ck", tiny_target)
    (tmp_path / "ck" / "SHA256SUMS").unlink()  # as a published drafter, which has no sums
    with pytest.raises(CheckpointError, match=r"ck/model.safetensors: not a readable safetensors file"):
        load_drafter(tmp_path / "ck", tiny_target)
    (tmp_path / "ck" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: top level is a list, expected a JSON object"):
        load_drafter(tmp_path / "ck", tiny_target)


def test_files_respect_the_umask(tiny_target, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        save_drafter(make_tiny_drafter(tiny_target), tmp_path / "ck")
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "ck").iterdir()} == {"0o644"}


def test_split_and_join_round_trip(tiny_target, tmp_path):
    """A drafter cut into size-capped parts (+ SHA-256 sums) and joined again is the same directory,
    bit for bit; a missing part is caught by the sums, not by a later load."""
    d = make_tiny_drafter(tiny_target)
    save_drafter(d, tmp_path / "ck")
    size = (tmp_path / "ck" / "model.safetensors").stat().st_size
    files = split_drafter(tmp_path / "ck", tmp_path / "parts", part_bytes=size // 3 + 1)
    assert [f.name for f in files] == ["config.json"] + [f"model.safetensors.part{i:03d}" for i in range(3)] + ["SHA256SUMS"]
    assert all(f.stat().st_size <= size // 3 + 1 for f in files[1:-1])
    join_drafter(tmp_path / "parts", tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(p.name for p in (tmp_path / "ck").iterdir())
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "ck" / name).read_bytes()
    d2 = load_drafter(tmp_path / "back", tiny_target)
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d.state_dict().items())
    (tmp_path / "parts" / "model.safetensors.part001").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256"):
        join_drafter(tmp_path / "parts", tmp_path / "again")


def test_resume_refuses_another_target_or_training_set(tmp_path):
    """A training state records the target's identity and the training set's ids: resuming it with
    another of either is refused with one line naming the way forward, even at equal sizes."""
    from conftest import make_tiny_target
    from dflashkit.config import load_config
    from dflashkit.train import TrainingStopped, train
    from train_job import BASE, run_job, tiny_samples

    out = tmp_path / "run"
    with pytest.raises(TrainingStopped):
        run_job(str(out), ["train.save_every=100"], signal_at=2)
    renamed = [type(s)(f"x{s.id}", s.input_ids, s.loss_mask) for s in tiny_samples()]
    with pytest.raises(ValueError, match=r"--resume: .* was trained with another training set .*--overwrite"):
        run_job(str(out), ["train.save_every=100"], resume=True, samples=renamed)
    cfg = load_config(None, [*BASE, f"train.output_dir={out}", "train.save_every=100"])
    with pytest.raises(ValueError, match=r"--resume: .* was trained with another target \(config or weights\)"):
        train(cfg, target=make_tiny_target(seed=5), samples=tiny_samples(), resume=True)
    run_job(str(out), ["train.save_every=100"], resume=True)  # the same ones resume
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("kind,defect,match", [
    ("dflash2", "selector_tensors_missing", r"config.json's dflash_config.selector_rank=8 declares a candidate selector, "
                                            r"but its tensors \['candidate_selector.hidden_projection.weight'"),
    ("dflash2", "conv_undeclared", r"tensors \['layers.0.attention_conv.base_kernel'.*belong to block convolutions, "
                                   r"which config.json does not declare \(dflash_config.conv_kernel_size=None\)"),
    ("dflash2", "top_k_over_vocab", r"config.json: .*'selector_top_k': expected an int in \[1, vocab_size=128\], got 500"),
    ("dflash2", "group_not_dividing", r"config.json: .*'conv_group_size': expected a divisor of hidden_size=64, got 24"),
    ("dspark", "gated_without_gate", r"dflash_config.markov_head_type='gated' declares the Markov head's gate"),
    ("dspark", "markov_rank_0", r"config.json: .*'confidence_head_with_markov': expected false when markov_rank is 0"),
    ("dspark", "confidence_shape", r"confidence_head.proj.weight: expected \(1, 64\), got \(1, 72\) \(shaped by "
                                   r"dflash_config.confidence_head_with_markov=False, dflash_config.markov_rank=8\)"),
])
def test_family_defects_name_the_declaring_field(tiny_target, tmp_path, kind, defect, match):
    """A family drafter whose config.json and tensors disagree: one error naming the file and the
    dflash_config field that declares (or shapes) the module, before any drafter is built."""
    from conftest import make_tiny_family

    d = save_drafter(make_tiny_family(tiny_target, kind), tmp_path / "ck")
    (d / "SHA256SUMS").unlink()  # edited on purpose below
    cfg, tensors = json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))
    fam = cfg["dflash_config"]
    if defect == "selector_tensors_missing":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("candidate_selector.")}
    elif defect == "conv_undeclared":
        del fam["conv_kernel_size"]
    elif defect == "top_k_over_vocab":
        fam["selector_top_k"] = 500
    elif defect == "group_not_dividing":
        fam["conv_group_size"] = 24
    elif defect == "gated_without_gate":
        fam["markov_head_type"] = "gated"
    elif defect == "markov_rank_0":
        fam["markov_rank"] = 0
    elif defect == "confidence_shape":
        fam["confidence_head_with_markov"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match) as e:
        load_drafter(d, tiny_target)
    assert str(d) in str(e.value) and "\n" not in str(e.value)
