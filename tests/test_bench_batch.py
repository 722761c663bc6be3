"""`benchmarks/bench_batch.py` keeps what it measured when a run is cut short."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_batch  # noqa: E402


def test_a_run_cut_short_keeps_its_finished_trials(smollm2, tmp_path, monkeypatch):
    """A command's time limit stops the run in its third timed pass (AR's second trial): the JSON
    already holds the two finished trials, their tokens as decoded; a whole run writes its rows."""
    monkeypatch.setattr(bench_batch, "load_target", lambda *a, **k: smollm2)
    out = tmp_path / "b.json"
    argv = ["bench_batch.py", "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "2", "--methods", "ar,dflash",
            "--modes", "continuous", "--trials", "2", "--json", str(out)]
    timed, calls = bench_batch.timed, []

    def stopped_in_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # (as a timeout's signal would stop it)
        return timed(*a, **k)

    monkeypatch.setattr(bench_batch, "timed", stopped_in_third)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        bench_batch.main()
    cut = json.loads(out.read_text())
    assert cut["rows"] == [] and (cut["unfinished"]["mode"], cut["unfinished"]["batch"]) == ("continuous", 2)
    trials = cut["unfinished"]["trials"]
    assert list(trials) == ["ar", "dflash"] and all(len(t) == 1 for t in trials.values())
    assert all(t[0]["seconds"] > 0 and 2 <= t[0]["tokens"] <= 16 for t in trials.values())

    monkeypatch.setattr(bench_batch, "timed", timed)
    bench_batch.main()
    whole = json.loads(out.read_text())
    assert "unfinished" not in whole and [r["method"] for r in whole["rows"]] == ["ar", "dflash"]
    assert [len(r["trial_seconds"]) for r in whole["rows"]] == [2, 2]
    # the same prompts decode to the same tokens, cut short or not (greedy, float32)
    assert [r["tokens"] for r in whole["rows"]] == [trials["ar"][0]["tokens"], trials["dflash"][0]["tokens"]]
