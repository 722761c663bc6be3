"""`bench.batch` (what `benchmarks/bench_batch.py` runs): its method labels, the engines they
decode on, and `measure` keeping what it measured when a run is cut short."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_family
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
        return batch.measure(make_engine(smollm2, None), {True: make_engine(smollm2, drafter)}, prompts,
                             ["ar", "dflash"], [2], ["continuous"], 8, stops, trials=2, json_path=str(out))

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


def test_method_labels():
    """'+cost' decodes cost-aware on the drafter's probabilities (an engine built with
    confidence=False), '+conf' on its confidence head, plain labels on the default engine."""
    Label = batch.Label
    assert batch.parse_method("ar") == Label("ar", None, False, True)
    assert batch.parse_method("dflash") == Label("dflash", None, False, True)
    assert batch.parse_method("dflash+cost") == Label("dflash", None, True, False)
    assert batch.parse_method("dflash+conf") == Label("dflash", None, True, True)
    assert batch.parse_method("ddtree-16+cost") == Label("ddtree", 16, True, False)
    assert batch.parse_method("ddtree-16+conf") == Label("ddtree", 16, True, True)
    for bad in ("ar+cost", "ar+conf", "ddtree", "dflash-4", "ddtree-x+conf", "dflash+cost+conf", "dflash+conf+cost",
                "dflash+", "ddtree-16+foo", "dflash+cost,ar", "DFlash"):
        with pytest.raises(SystemExit, match="--methods: expected"):
            batch.parse_method(bad)


def test_conf_needs_a_confidence_head(tiny_target):
    """'+conf' with a drafter without a confidence head (DFlash) is refused in one line that names
    --methods and the drafter; '+cost' is not, nor '+conf' with a DSpark drafter's head."""
    dflash, dspark = make_tiny_drafter(tiny_target), make_tiny_family(tiny_target, "dspark")
    with pytest.raises(SystemExit) as refused:
        batch.check_confidence(["ar", "dflash+cost", "dflash+conf", "ddtree-8+conf"], dflash, "runs/x/best")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--methods: dflash+conf,ddtree-8+conf")
    assert "runs/x/best (dflash)" in message and "confidence head" in message
    batch.check_confidence(["ar", "dflash", "dflash+cost", "ddtree-8+cost"], dflash, "runs/x/best")
    batch.check_confidence(["ar", "dflash+cost", "dflash+conf"], dspark, "runs/y/best")


def test_drafter_engines_by_scoring(tiny_target):
    """An engine per scoring that a label needs: a DSpark drafter's '+cost' on one built with
    confidence=False, '+conf' and plain labels on the default; without a head, one serves both."""
    dflash, dspark = make_tiny_drafter(tiny_target), make_tiny_family(tiny_target, "dspark")
    both = batch.drafter_engines(tiny_target, dspark, ["ar", "dflash", "dflash+cost", "ddtree-8+conf"], "hf", None)
    assert {c: e.confidence for c, e in both.items()} == {True: True, False: False}
    assert set(batch.drafter_engines(tiny_target, dspark, ["ar", "ddtree-8+cost"], "hf", None)) == {False}
    assert batch.drafter_engines(tiny_target, dspark, ["ar"], "hf", None) == {}
    shared = batch.drafter_engines(tiny_target, dflash, ["ar", "dflash", "dflash+cost"], "hf", None)
    assert set(shared) == {True, False} and shared[True] is shared[False]


def test_measure_decodes_each_label_on_its_engine(tiny_target):
    """A DSpark drafter's '+cost' and '+conf' side by side in one run: each cost-aware label
    decodes (and measures its cost curve, `Engine.cost_state`) on its scoring's engine, every row
    the target's greedy tokens."""
    drafter = make_tiny_family(tiny_target, "dspark")
    methods = ["ar", "dflash+cost", "ddtree-8+conf", "dflash"]
    spec = batch.drafter_engines(tiny_target, drafter, methods, "hf", None)
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 8, 2, 4, 6])]
    rows = batch.measure(make_engine(tiny_target, None, "hf"), spec, prompts, methods, [2], ["groups"], 12, {2})
    assert [r["method"] for r in rows] == methods and all(r["identical"] == 2 for r in rows)
    assert [k[0] for k in spec[False].cost_state] == ["dflash"] and [k[0] for k in spec[True].cost_state] == ["ddtree"]
