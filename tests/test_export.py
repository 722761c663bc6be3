"""Export round trips: reference format (+ the trust_remote_code model file) and vLLM speculators."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_drafter
from dflashkit.checkpoint import CheckpointError, load_drafter
from dflashkit.cli import main
from dflashkit.decode.cache import drafter_cache
from dflashkit.drafter import block_token_ids, draft_block, training_hidden
from dflashkit.export import (AUTO_MAP, export_reference, export_speculators, from_speculators_layer_ids,
                              load_speculators, remote_code_source, to_speculators_layer_ids)

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return make_tiny_drafter(tiny_target, **SLIDING)


def _logits(drafter, target, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(3, 120, (2, 40))
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    with torch.no_grad():
        return target.lm_head(training_hidden(drafter, target.embed, ids, feats, torch.tensor([[4, 17], [9, 25]])))


def _assert_same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_reference_round_trip(drafter, tiny_target, tmp_path):
    out = export_reference(drafter, tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "dflash.py", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == AUTO_MAP == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert (out / "dflash.py").read_bytes() == remote_code_source()
    back = load_drafter(out)
    assert back.config == drafter.config
    _assert_same_tensors(drafter, back)
    assert torch.equal(_logits(drafter, tiny_target), _logits(back, tiny_target))
    # exporting an exported drafter again is stable (auto_map is not carried into our config)
    again = json.loads((export_reference(back, tmp_path / "again") / "config.json").read_text())
    assert again == cfg


def test_remote_code_model_matches_drafter(drafter, tiny_target, tmp_path):
    """The exported dflash.py, loaded the way Transformers users load published drafters, computes
    the same hidden states as our drafter's inference path (sliding layer included)."""
    from transformers import AutoModel

    from dflashkit.assets.dflash_model import extract_context_feature

    out = export_reference(drafter, tmp_path / "ref")
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True)
    assert type(remote).__name__ == "DFlashDraftModel" and remote.target_layer_ids == [1, 2, 3]
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (2, 30))
    c, B = 17, drafter.config.block_size  # context longer than the sliding window (6)
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids).features
    # the model file's tap helper agrees with ours: tap k = output_hidden_states[k + 1]
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(extract_context_feature(hs, remote.target_layer_ids), feats, atol=1e-6, rtol=0)
    with torch.no_grad():
        ours = draft_block(drafter, tiny_target.embed, drafter_cache(drafter), feats[:, :c], ids[:, c])
        emb = tiny_target.embed(block_token_ids(ids[:, c:c + 1], B, remote.mask_token_id))
        theirs = remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1))
        torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-5)
        remote.sliding_window = 1000  # control: without the window the sliding layer sees more context
        assert (remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1)) - ours).abs().max() > 1e-4


def test_speculators_layer_ids_are_hidden_state_indices(tiny_target):
    """speculators' aux ids index output_hidden_states (ours + 1). Known cases, and the semantic check."""
    assert to_speculators_layer_ids([1, 9, 17, 25, 33], 36) == [2, 10, 18, 26, 34]  # Qwen3-8B, 5 taps
    assert from_speculators_layer_ids([2, 10, 18, 26, 34]) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="last layer"):
        to_speculators_layer_ids([1, 35], 36)
    ids = torch.randint(3, 120, (1, 12))
    ours = [0, 2, 4]
    feats = tiny_target.forward(ids, ours).features
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    aux = to_speculators_layer_ids(ours, tiny_target.num_layers)
    torch.testing.assert_close(torch.cat([hs[i] for i in aux], -1), feats, atol=1e-6, rtol=0)


def test_speculators_round_trip(drafter, tiny_target, tmp_path):
    out = export_speculators(drafter, tmp_path / "spec", verifier="org/tiny-llama", verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4]  # taps [1, 2, 3] shifted by one
    assert cfg["mask_token_id"] == 127 and cfg["block_size"] == 8 and cfg["draft_vocab_size"] == 128
    assert cfg["sliding_window_non_causal"] is True
    assert cfg["layer_types"] == SLIDING["layer_types"] and cfg["sliding_window"] == 6
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == 64
    assert not {"dflash_config", "block_size", "auto_map"} & layer.keys()
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"][0]["speculative_tokens"] == 7
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    assert set(load_file(str(out / "model.safetensors"))) == set(drafter.state_dict())
    back = load_speculators(out)
    assert back.config == drafter.config
    _assert_same_tensors(drafter, back)
    assert torch.equal(_logits(drafter, tiny_target), _logits(back, tiny_target))


def test_speculators_own_classes_read_the_export(drafter, tiny_target, tmp_path):
    """The `speculators` package's own DFlash config and model (the format vLLM serves) read an
    export: the config validates to the drafter's settings, and the model it builds holds exactly
    the exported tensors, names and shapes, besides the verifier-owned ones it never saves."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    verifier = tmp_path / "verifier"  # a local verifier: speculators reads its config, no hub
    tiny_target.model.config.save_pretrained(verifier)
    out = export_speculators(drafter, tmp_path / "spec", verifier=str(verifier), verifier_architectures=["LlamaForCausalLM"])
    cfg = DFlashSpeculatorConfig.from_pretrained(str(out))
    c = drafter.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.draft_vocab_size) == (c.block_size, c.mask_token_id, c.vocab_size)
    assert cfg.aux_hidden_state_layer_ids == to_speculators_layer_ids(c.target_layer_ids, c.num_target_layers)
    assert cfg.transformer_layer_config.num_hidden_layers == c.num_hidden_layers and cfg.sliding_window_non_causal
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention would compile
    model = DFlashDraftModel(cfg)
    assert model.sliding_window_indices == [0] and model.sliding_window == SLIDING["sliding_window"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in model._keys_to_ignore_on_save}
    ours = {k: tuple(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
    assert ours == theirs


def test_load_speculators_foreign_checkpoint(drafter, tmp_path):
    """A checkpoint as speculators writes it: no num_target_layers, verifier tensors beside ours."""
    out = export_speculators(drafter, tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["transformer_layer_config"]["num_target_layers"]
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "embed_tokens.weight": torch.zeros(128, 64)}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="pass num_target_layers"):
        load_speculators(out)
    assert load_speculators(out, num_target_layers=6).config.target_layer_ids == [1, 2, 3]
    cfg["speculators_model_type"] = "eagle3"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="expected 'dflash'"):
        load_speculators(out)
    cfg.update(speculators_model_type="dflash", draft_vocab_size=32)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="reduced draft vocabularies"):
        load_speculators(out, num_target_layers=6)


def test_export_cli(drafter, tmp_path, capsys):
    from dflashkit.checkpoint import save_drafter

    src = save_drafter(drafter, tmp_path / "trained")
    assert main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "s"), "--verifier", "v",
                 "--dtype", "bfloat16"]) == 0
    assert load_speculators(tmp_path / "s").fc.weight.dtype == torch.bfloat16
    assert main(["export", str(src), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "dflash.py").is_file() and "num_speculative_tokens = 7" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 1
