"""`bench.batch.measure` (what `benchmarks/bench_batch.py` runs) keeps what it measured when a run
is cut short."""

from __future__ import annotations

import json

import pytest

from dflashkit.bench import batch
from dflashkit.checkpoint import load_drafter
from dflashkit.data.prompts import load_prompts
from dflashkit.decode.loop import make_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts
from dflashkit.vocab import stop_token_ids


def test_a_run_cut_short_keeps_its_finished_trials(smollm2, tmp_path, monkeypatch):
    """A command's time limit stops the run in its third timed pass (AR's second trial): the JSON
    already holds the two finished trials, their tokens as decoded; a whole run writes its rows."""
    drafter = load_drafter(bundled_drafter_dir(), smollm2, device=smollm2.device, dtype=smollm2.dtype)
    prompts = [pr.ids for pr in eval_prompts(load_prompts("humaneval", limit=2), smollm2.tokenizer)]
    stops = stop_token_ids(smollm2.tokenizer, getattr(smollm2.model, "generation_config", None))
    out = tmp_path / "b.json"

    def run() -> list[dict]:  # --batch-sizes 2 --methods ar,dflash --modes continuous --trials 2 --max-new-tokens 8
        return batch.measure(make_engine(smollm2, None), make_engine(smollm2, drafter), prompts, ["ar", "dflash"],
                             [2], ["continuous"], 8, stops, trials=2, json_path=str(out))

    timed, calls = batch.timed, []

    def stopped_in_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # (as a timeout's signal would stop it)
        return timed(*a, **k)

    monkeypatch.setattr(batch, "timed", stopped_in_third)
    with pytest.raises(KeyboardInterrupt):
        run()
    cut = json.loads(out.read_text())
    assert cut["rows"] == [] and (cut["unfinished"]["mode"], cut["unfinished"]["batch"]) == ("continuous", 2)
    trials = cut["unfinished"]["trials"]
    assert list(trials) == ["ar", "dflash"] and all(len(t) == 1 for t in trials.values())
    assert all(t[0]["seconds"] > 0 and 2 <= t[0]["tokens"] <= 16 for t in trials.values())

    monkeypatch.setattr(batch, "timed", timed)
    run()
    whole = json.loads(out.read_text())
    assert "unfinished" not in whole and [r["method"] for r in whole["rows"]] == ["ar", "dflash"]
    assert [len(r["trial_seconds"]) for r in whole["rows"]] == [2, 2]
    # the same prompts decode to the same tokens, cut short or not (greedy, float32)
    assert [r["tokens"] for r in whole["rows"]] == [trials["ar"][0]["tokens"], trials["dflash"][0]["tokens"]]
