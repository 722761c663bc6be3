"""`dflashkit doctor`: a compatible drafter passes; each seeded incompatibility gets its own message."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_target
from dflashkit.checkpoint import save_drafter
from dflashkit.cli import main
from dflashkit.config import DrafterSettings
from dflashkit.doctor import ERROR, OK, WARNING, doctor, errors, has_reasoning
from dflashkit.drafter import DFlashDrafter, new_drafter

QA = [("What is 2 + 2?", "2 + 2 = 4."), ("Name a prime number.", "7 is a prime number."),
      ("Say hello in French.", "Bonjour !")]
REASONING = "<think>\nThe user wants a short answer. Let me think it through.\n</think>\n\n"


def _conversations(path, *, think=False, extra=""):
    with open(path, "w") as f:
        for i, (q, a) in enumerate(QA):
            answer = (REASONING if think else "") + a + (extra if i == 0 else "")
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(smollm2, tmp_path_factory):
    """A compatible (untrained) 1-layer drafter for SmolLM2, saved."""
    torch.manual_seed(0)
    drafter = new_drafter(smollm2, DrafterSettings(num_layers=1, num_taps=2))
    return drafter, save_drafter(drafter, tmp_path_factory.mktemp("drafter") / "ok")


def _edited(base, tmp_path, **fields):
    """The base drafter with config.json fields changed (shapes unchanged)."""
    drafter, _ = base
    d = DFlashDrafter(replace(drafter.config, **fields))
    d.load_state_dict(drafter.state_dict())
    return save_drafter(d, tmp_path / "edited")


def _by_severity(findings, severity):
    return {f.check: f.message for f in findings if f.severity == severity}


@pytest.mark.slow
def test_compatible_drafter_passes(base, smollm2, tmp_path):
    findings = doctor(base[1], smollm2, data=_conversations(tmp_path / "regen.jsonl"))
    assert not errors(findings), [str(f) for f in findings]
    ok = _by_severity(findings, OK)
    for check in ("config", "weights", "hidden size", "vocabulary", "target layers", "layer ids", "mask token",
                  "tokenizer", "rope", "sliding window", "block size", "chat template", "thinking mode", "mask in data"):
        assert check in ok, check
    assert "576, the target's" in ok["hidden size"] and "<empty_output>" in ok["mask token"]
    assert all(str(f).startswith(("OK ", "WARNING ")) and "\n" not in str(f) for f in findings)


@pytest.mark.slow
def test_compatible_tokenized_data_passes(base, smollm2, tmp_path):
    from dflashkit.data.chat import tokenize_file

    tok_file = tmp_path / "tok.jsonl"
    tokenize_file(_conversations(tmp_path / "regen.jsonl"), smollm2.tokenizer, tok_file, max_length=128)
    findings = doctor(base[1], smollm2, data=tok_file)
    assert not errors(findings), [str(f) for f in findings]
    assert "tokens" in _by_severity(findings, OK)["chat template"]


@pytest.mark.slow
def test_seeded_incompatibilities_each_get_their_own_message(base, smollm2, tmp_path):
    tok = smollm2.tokenizer
    drafter, good = base
    seeds = {}
    # wrong hidden size: a drafter (consistent weights) built for a 64-wide target
    small = replace(drafter.config, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
    seeds["hidden size"] = doctor(save_drafter(DFlashDrafter(small), tmp_path / "h64"), smollm2)
    # layer id out of range: a drafter for a 40-layer sibling of the target
    seeds["layer ids"] = doctor(_edited(base, tmp_path / "l", num_target_layers=40, target_layer_ids=[1, 35]), smollm2)
    # mask token that is a real (text) token
    seeds["mask token"] = doctor(_edited(base, tmp_path / "m", mask_token_id=tok.convert_tokens_to_ids("the")), smollm2)
    # mismatched thinking mode: data regenerated with thinking on, evaluation with thinking off
    seeds["thinking mode"] = doctor(good, smollm2, data=_conversations(tmp_path / "think.jsonl", think=True))
    messages = {}
    for check, findings in seeds.items():
        errs = _by_severity(findings, ERROR)
        assert check in errs, (check, [str(f) for f in findings])
        messages[check] = errs[check]
    assert "hidden_size 64 != target hidden size 576" in messages["hidden size"]
    assert "target_layer_ids [35] out of range for a target with 30 layers" in messages["layer ids"]
    assert "ordinary text token" in messages["mask token"]
    assert "3 of 3 samples hold <think> reasoning" in messages["thinking mode"]
    assert "data.thinking=false" in messages["thinking mode"]
    assert len(set(messages.values())) == len(messages)
    # nothing else is wrong with the hidden-size, mask and thinking seeds
    for check in ("hidden size", "mask token", "thinking mode"):
        assert [f.check for f in errors(seeds[check])] == [check], [str(f) for f in errors(seeds[check])]


@pytest.mark.slow
def test_mask_token_checks(base, smollm2, tmp_path, monkeypatch):
    tok = smollm2.tokenizer
    eos = doctor(_edited(base, tmp_path / "eos", mask_token_id=tok.eos_token_id), smollm2)
    assert "BOS/EOS/PAD/stop token" in _by_severity(eos, ERROR)["mask token"]
    # the mask token written in the data (here as the literal special-token text)
    found = doctor(base[1], smollm2, data=_conversations(tmp_path / "d.jsonl", extra=" <empty_output>"))
    assert "occurs 1 times in 1 of 3 samples" in _by_severity(found, ERROR)["mask in data"]
    # a special token the chat template writes (vocab.mask_token_problems extension)
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{{ '<empty_output>' }}")
    templ = doctor(base[1], smollm2)
    assert "written by the chat template" in _by_severity(templ, ERROR)["mask token"]


@pytest.mark.slow
def test_thinking_mode_variants(base, smollm2, tmp_path, monkeypatch):
    plain = _conversations(tmp_path / "plain.jsonl")
    # SmolLM2's template ignores enable_thinking: asking for it is a warning, not silently accepted
    w = doctor(base[1], smollm2, data=plain, thinking=True, thinking_field="eval.thinking")
    assert "ignores enable_thinking" in _by_severity(w, WARNING)["thinking mode"] and not errors(w)
    # a template that supports it, data without reasoning, evaluation with thinking on
    monkeypatch.setattr("dflashkit.doctor._template_ignores_thinking", lambda tok: False)
    e = doctor(base[1], smollm2, data=plain, thinking=True)
    assert "only 0 of 3 samples hold <think> reasoning" in _by_severity(e, ERROR)["thinking mode"]
    assert has_reasoning("<think>cut short") and not has_reasoning("<think>\n\n</think>\n\nhi") and not has_reasoning("hi")


@pytest.mark.slow
def test_foreign_tokenized_data_and_broken_config(base, smollm2, tmp_path):
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"id": "x", "input_ids": [100, 200, 60000], "loss_mask": [0, 1, 1]}) + "\n")
    errs = _by_severity(doctor(base[1], smollm2, data=foreign), ERROR)
    assert "token id 60000" in errs["token ids"] and "none of the chat template's tokens" in errs["chat template"]
    broken = base[1].parent / "broken"
    broken.mkdir()
    cfg = json.loads((base[1] / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 30]
    (broken / "config.json").write_text(json.dumps(cfg))
    [f] = doctor(broken, smollm2)
    assert f.severity == ERROR and f.check == "config" and "target_layer_ids" in f.message


@pytest.mark.slow
def test_doctor_cli_exit_codes(base, tmp_path, capsys):
    """The CLI reads the target without its weights; exit code 1 exactly when there are errors."""
    assert main(["doctor", str(base[1]), "--data", str(_conversations(tmp_path / "r.jsonl"))]) == 0
    out = capsys.readouterr().out
    assert "OK      hidden size: 576" in out and "doctor: 0 error(s)" in out
    think = _conversations(tmp_path / "t.jsonl", think=True)
    assert main(["doctor", str(base[1]), "--data", str(think)]) == 1
    assert "ERROR   thinking mode" in capsys.readouterr().out
    assert main(["doctor", str(base[1]), "data.thinking=true", "--data", str(think)]) == 0


def test_an_unusable_weights_or_config_file_is_reported_with_its_real_cause(tmp_path):
    """A checksum mismatch, a missing model.safetensors and weights of another shape each get the
    cause and the remedy of their own, never a mismatch with config.json that is not there."""
    target = make_tiny_target()
    d = save_drafter(make_tiny_drafter(target), tmp_path / "d")
    weights, config = d / "model.safetensors", d / "config.json"
    data = weights.read_bytes()
    weights.write_bytes(data[:-4] + bytes(4))  # damaged at the same size
    msg = _by_severity(doctor(d, target), ERROR)["weights"]
    assert "differs from the SHA-256 recorded" in msg and "restore it" in msg and "do not match" not in msg, msg
    weights.unlink()
    msg = _by_severity(doctor(d, target), ERROR)["weights"]
    assert "no model.safetensors" in msg and "export the drafter again" in msg and "do not match" not in msg, msg
    weights.write_bytes(data)
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"extra": 1, "rms_norm_eps"'))
    [f] = doctor(d, target)  # an edited config.json is refused by its sum, not asked to be fixed
    assert f.check == "config" and "differs from the SHA-256 recorded" in f.message and "fix" not in f.message
    (d / "SHA256SUMS").unlink()  # a published drafter: no sums; config.json now wants wider layers
    raw = json.loads(config.read_text())
    raw["intermediate_size"] *= 2
    config.write_text(json.dumps(raw))
    msg = _by_severity(doctor(d, target), ERROR)["weights"]
    assert "tensors of the wrong shape for config.json" in msg, msg
