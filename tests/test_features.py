"""Target features: cache == recompute, fp8 ~ bf16, kill-and-resume, disjoint ranks, check-features."""

from __future__ import annotations

import json

import pytest
import torch

from datahelpers import one_thread, run_cli, save_tiny_target  # noqa: F401
from dflashkit.checkpoint import FAULT_ENV
from dflashkit.cli import main as cli_main
from dflashkit.data.chat import TokenizedSample, tokenize_conversation
from dflashkit.data.check import Comparison
from dflashkit.data.features import FeatureCache, extract_features, online_features, plan_shards, sha256_file
from dflashkit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 8, 15, 22, 27]  # SmolLM2 (30 layers), default taps for 5


def random_samples(n: int, seed: int = 0, lo: int = 8, hi: int = 48) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(TokenizedSample(f"s{i}", torch.randint(3, 49000, (T,), generator=g).tolist(),
                                   [0] * (T // 2) + [1] * (T - T // 2)))
    return out


@pytest.fixture(scope="module")
def chats(smollm2):
    qs = ["What is 2+2?", "Write a haiku about rain.", "def add(a, b):", "Explain recursion briefly.", "Hi!", "Name a prime."]
    answers = ["2+2 is 4.", "Soft rain on the roof,\nthe garden drinks slowly.", "    return a + b",
               "A function that calls itself on a smaller input.", "Hello! How can I help?", "7"]
    return [tokenize_conversation(smollm2.tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                  max_length=256, id=f"c{i}") for i, (q, a) in enumerate(zip(qs, answers))]


@pytest.fixture(scope="module")
def caches(smollm2, chats, tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return {name: (root / name, extract_features(smollm2, chats, LAYERS, root / name, dtype=dt, batch_size=bs, shard_size=120))
            for name, dt, bs in [("bf16_b1", "bfloat16", 1), ("bf16", "bfloat16", 3), ("fp8", "fp8", 3)]}


@pytest.mark.slow
def test_cache_equals_recompute(smollm2, chats, caches):
    path, manifest = caches["bf16_b1"]
    cache = FeatureCache(path)
    batched = FeatureCache(caches["bf16"][0])
    assert len(cache) == len(chats) == manifest["num_samples"] and manifest["num_shards"] > 1
    assert manifest["num_tokens"] == sum(len(s.input_ids) for s in chats)
    assert manifest["layer_ids"] == LAYERS and cache.layer_ids == LAYERS and cache.ids == [s.id for s in chats]
    assert all(sha256_file(path / s["file"]) == s["sha256"] for s in manifest["shards"])
    for i, s in enumerate(chats):
        ref = online_features(smollm2, torch.tensor([s.input_ids]), LAYERS)[0]  # [T, 5 * 576]
        got = cache[i]
        assert got.id == s.id and got.input_ids.tolist() == s.input_ids and got.loss_mask.int().tolist() == s.loss_mask
        assert got.features.dtype == torch.float32 and got.features.shape == (len(s.input_ids), 5 * 576)
        # Unbatched extraction is the very same computation, stored in bf16.
        assert torch.equal(got.features, ref.bfloat16().float())
        # Padded batches change fp32 rounding only: within bf16 precision.
        torch.testing.assert_close(batched[i].features, ref, rtol=2 ** -7, atol=1e-2)
    assert cache.target_problems(smollm2) == []


@pytest.mark.slow
def test_fp8_close_to_bf16_at_half_the_bytes(caches):
    bf16, fp8 = FeatureCache(caches["bf16"][0]), FeatureCache(caches["fp8"][0])
    cmp = Comparison(LAYERS)
    for i in range(len(bf16)):
        cmp.add(bf16[i].features, fp8[i].features)
    for row in cmp.report():
        assert row.cosine_mean > 0.999 and row.cosine_min > 0.999, row
    ratio = caches["fp8"][1]["bytes_per_token"] / caches["bf16"][1]["bytes_per_token"]
    assert 0.49 < ratio < 0.52
    assert FeatureCache(caches["fp8"][0], dtype=torch.bfloat16)[0].features.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "model", num_layers=6, hidden=64)


def test_extract_kill_and_resume(tiny_dir, tmp_path, capsys):
    """Killed (deterministically, by the process itself) between writing shard 2's JSON under its
    temporary name and renaming it: the resumed run removes the temp file and redoes shard 2.
    (The resumed run in this process: a CLI process costs seconds of imports.)"""
    samples = random_samples(120, lo=24, hi=64)
    tok_file = tmp_path / "tok.jsonl"
    tok_file.write_text("".join(json.dumps(s.__dict__) + "\n" for s in samples))
    target = load_target(tiny_dir)
    ref = extract_features(target, samples, [1, 3], tmp_path / "ref", batch_size=4, shard_size=200)

    out = tmp_path / "out"
    args = ["extract", "--input", str(tok_file), "--out", str(out), "--shard-size", "200", f"target.path={tiny_dir}",
            "drafter.target_layer_ids=[1,3]", "drafter.num_taps=2", "data.batch_size=4"]
    killed = run_cli(*args, env={FAULT_ENV: "replace shard-00002.json"})
    assert killed.returncode == 137, killed.stderr
    assert sorted(p.name for p in out.glob("shard-*.json")) == ["shard-00000.json", "shard-00001.json"]
    assert len(list(out.glob(".shard-00002.json.*.tmp"))) == 1  # what the kill left behind
    assert not (out / "manifest.json").exists() and ref["num_shards"] > 3
    with pytest.raises(FileNotFoundError, match="unfinished"):
        FeatureCache(out)
    assert cli_main(args) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    # Same shards, byte for byte, as the uninterrupted run; no stray temp files.
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert not list(out.glob(".*.tmp"))
    ids = FeatureCache(out).ids
    assert ids == [s.id for s in samples] and len(set(ids)) == len(ids)

    with pytest.raises(ValueError, match="other settings .*dtype"):
        extract_features(target, samples, [1, 3], out, dtype="fp8", batch_size=4, shard_size=200)
    # Same ids and lengths, other content (re-tokenised): the stale shards are not reused.
    changed = [TokenizedSample(s.id, [t + 1 for t in s.input_ids], s.loss_mask) for s in samples]
    with pytest.raises(ValueError, match=r"samples_sha256 differ \(the input samples' content changed\)"):
        extract_features(target, changed, [1, 3], out, batch_size=4, shard_size=200)


def test_a_full_disk_while_a_shard_is_written_is_one_line_and_the_same_command_resumes(tiny_dir, tmp_path, capsys,
                                                                                       monkeypatch):
    """The file-size limit (ulimit -f) reached while shard 1 is written: one line naming the shard
    and the cause (before: safetensors' `File too large (os error 27)`, no file named); the same
    command then keeps shard 0, writes the rest, and gives the uninterrupted run's shards."""
    import resource

    from dflashkit.data import features

    samples = random_samples(60, lo=24, hi=64)
    tok_file = tmp_path / "tok.jsonl"
    tok_file.write_text("".join(json.dumps(s.__dict__) + "\n" for s in samples))
    ref = extract_features(load_target(tiny_dir), samples, [1, 3], tmp_path / "ref", batch_size=4, shard_size=200)
    write_shard = features._write_shard

    def limited(*a):
        if a[3] != 1:  # the shard's number
            return write_shard(*a)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: a write past it is EFBIG
        try:
            return write_shard(*a)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(features, "_write_shard", limited)
    out = tmp_path / "out"
    args = ["extract", "--input", str(tok_file), "--out", str(out), "--shard-size", "200", f"target.path={tiny_dir}",
            "drafter.target_layer_ids=[1,3]", "drafter.num_taps=2", "data.batch_size=4"]
    assert cli_main(args) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflashkit")]
    assert err == [f"dflashkit extract: error: {out}/shard-00001.safetensors: cannot be written: the file-size limit "
                   "is reached (ulimit -f) (EFBIG); free space or raise the limit, then run the command again"], err
    assert (out / "shard-00000.json").is_file() and not (out / "shard-00001.json").exists()
    assert not list(out.glob(".shard-*.tmp"))
    monkeypatch.undo()
    assert cli_main(args) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in ref["shards"]]


def test_extract_refuses_token_ids_outside_the_vocabulary(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "input_ids": [5, 1000000, 7], "loss_mask": [0, 1, 1]}) + "\n")
    args = ["extract", "--input", str(bad), "--out", str(tmp_path / "f"), f"target.path={tiny_dir}", "drafter.num_taps=2"]
    rc = cli_main(args)
    err = capsys.readouterr().err
    assert rc == 1 and "sample 'a': token id 1000000 is outside the target's vocabulary" in err, err
    assert not (tmp_path / "f" / "settings.json").exists()
    bad.write_text(json.dumps({"id": "a", "input_ids": [5, -3, 7], "loss_mask": [0, 1, 1]}) + "\n")
    rc = cli_main(args)  # not a token id of any vocabulary: the file itself is refused
    err = capsys.readouterr().err
    assert rc == 1 and f"{bad}:1: field 'input_ids': expected a non-empty list of token ids" in err, err


def test_ranks_write_disjoint_shards(tiny_dir, tmp_path):
    samples = random_samples(12)
    target = load_target(tiny_dir)
    single = extract_features(target, samples, [0, 2, 5], tmp_path / "one", shard_size=60)
    assert single["num_shards"] >= 4
    out = tmp_path / "two"
    assert extract_features(target, samples, [0, 2, 5], out, shard_size=60, rank=0, world=2) is None
    assert sorted(p.name for p in out.glob("shard-*.json")) == \
        [f"shard-{k:05d}.json" for k in range(0, single["num_shards"], 2)]
    both = extract_features(target, samples, [0, 2, 5], out, shard_size=60, rank=1, world=2)
    assert both["shards"] == single["shards"]


def test_rank_from_torchrun_env(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    samples = random_samples(12)
    assert extract_features(load_target(tiny_dir), samples, [1], tmp_path, shard_size=60) is None
    n = len(plan_shards([len(s.input_ids) for s in samples], 60))
    assert n >= 4 and sorted(p.name for p in tmp_path.glob("shard-*.json")) == \
        [f"shard-{k:05d}.json" for k in range(1, n, 3)]


def test_check_features_cli(tiny_dir, tmp_path):
    samples = random_samples(4)
    a, b = tmp_path / "a", tmp_path / "b"
    extract_features(load_target(tiny_dir), samples, [1, 3], a, shard_size=64)
    report = tmp_path / "report.json"
    assert cli_main(["check-features", str(a), "target", f"target.path={tiny_dir}", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["layers"]
    assert [r["layer"] for r in rows] == [1, 3] and all(r["cosine_min"] > 0.9999 for r in rows)
    # Features of another model (a back-end that computes something else) are caught.
    other = save_tiny_target(tmp_path / "other", num_layers=6, hidden=64, seed=1)
    extract_features(load_target(other), samples, [1, 3], b, shard_size=64)
    assert cli_main(["check-features", str(a), str(b)]) == 1
