"""Evaluation: offline τ from cached features equals online greedy τ; the CLI validates per mode
(docs/conventions.md, mistakes 5 and 8); reports are written."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import product

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_drafter, make_tiny_target
from datahelpers import one_thread  # noqa: F401
from dflashkit.checkpoint import save_drafter
from dflashkit.cli import main
from dflashkit.data.features import FeatureSample
from dflashkit.decode.engine import Engine
from dflashkit.decode.loop import generate
from dflashkit.drafter import training_hidden
from dflashkit.data.prompts import Suite, load_suite
from dflashkit.evaluate import (Prompt, answer_spans, arbitrate_parting, bootstrap_intervals, check_partings, classify_parting, evaluate_offline, evaluate_online,
                                evaluate_suites, markdown, method_labels, offline_accepted, paired_differences, parting_summary, replay_rounds,
                                rounding_bound, summarize, tau_sim_vs_online, write_report)

LABELS = method_labels(["dflash", "ddtree"], [4, 12])


pytestmark = pytest.mark.usefixtures("one_thread")


def test_spans_rounds_and_summary():
    assert answer_spans(torch.tensor([0, 1, 1, 0, 0, 1, 1, 1])) == [(1, 3), (5, 8)]
    # answer [10, 20): accepted drafts per bonus position
    acc = {p: 0 for p in range(10, 19)} | {10: 3, 15: 9, 16: 1}
    rounds, per_pos = replay_rounds(acc, [(10, 20)])
    assert rounds == [4, 1, 4]  # 10 -> 14 -> 15 -> end (clipped: 19 - 15 = 4 tokens left)
    assert sum(rounds) == 20 - 10 - 1 and len(per_pos) == 9 and per_pos[4:7] == [1, 4, 2]
    s = summarize([1, 3, 3, 8], 8)
    assert s["tau"] == 3.75 and s["hist"] == [1, 0, 2, 0, 0, 0, 0, 1]
    assert s["slot_acceptance"][:3] == [0.75, 0.75, 0.25]


def _greedy_data(target, n: int, prompt_len: int = 12, new: int = 40, seed: int = 0):
    """Regenerated data: random prompts + the target's own greedy answers (loss mask on the answer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 120, (1, prompt_len), generator=g)
        ans = generate(Engine(target), ids, max_new_tokens=new, method="ar").tokens
        seq = torch.cat([ids[0], torch.tensor(ans)])
        out.append((f"s{i}", ids, seq, torch.cat([torch.zeros(prompt_len), torch.ones(len(ans))]).bool()))
    return out


def _train(drafter, target, data, steps: int = 100):
    """A few CE steps on the regenerated answers: enough for τ well above 1 on them."""
    B = drafter.config.block_size
    feats = [target.forward(seq[None], drafter.config.target_layer_ids).features for _, _, seq, _ in data]
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        _, ids, seq, _ = data[step % len(data)]
        T, a0 = len(seq), ids.shape[1] - 1
        anchors = torch.arange(a0, T - 1)[None]
        h = training_hidden(drafter, target.embed, seq[None], feats[step % len(data)], anchors)
        logits = target.lm_head(h).view(anchors.shape[1], B, -1)[:, 1:]
        labels = torch.stack([F.pad(seq[a + 1:a + B], (0, max(0, a + B - T)), value=-100) for a in anchors[0].tolist()])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


def test_offline_tau_equals_online_tiny_trained():
    """A drafter with real acceptance (τ well above 1, every value from 1 to B seen): the rounds
    replayed from cached features are exactly the online greedy rounds, DFlash and DDTree (with 3
    candidates per slot, and with the default: as many as the budget)."""
    target = make_tiny_target()
    data = _greedy_data(target, 4)
    drafter = _train(make_tiny_drafter(target), target, data)
    items = [FeatureSample(sid, seq, mask, target.forward(seq[None], drafter.config.target_layer_ids).features[0])
             for sid, _, seq, mask in data]
    seen = set()
    for ((sid, ids, seq, mask), item), top_k in product(zip(data, items), (3, None)):
        acc, spans = offline_accepted(drafter, target, item, LABELS, top_k=top_k)
        assert spans == [(12, 52)]
        for label, method, budget in LABELS:
            online = generate(Engine(target, drafter), ids, max_new_tokens=40, method=method, budget=budget, top_k=top_k)
            assert online.tokens == seq[12:].tolist()
            assert replay_rounds(acc[label], spans)[0] == online.accept_lengths, (sid, label, top_k)
            seen.update(online.accept_lengths)
    assert {1, 8} <= seen and len(seen) >= 4
    rep_off = evaluate_offline({"d": drafter}, target, items, methods=["dflash", "ddtree"], budgets=[4, 12], top_k=3)
    prompts = [Prompt(sid, ids) for sid, ids, _, _ in data]
    rep_on = evaluate_online(target, {"d": drafter}, prompts, methods=["dflash", "ddtree"], budgets=[4, 12], top_k=3,
                             max_new_tokens=40, engine="hf")
    for label, _, _ in LABELS:
        on, off = rep_on["drafters"]["d"]["methods"][label], rep_off["drafters"]["d"]["methods"][label]
        assert (on["tau"], on["rounds"], on["hist"]) == (off["tau"], off["rounds"], off["hist"])
        assert on["identical"] is True and on["tau"] > 2
    assert rep_on["baseline"]["tokens"] == 160


# ---- the real testbed, through the CLI --------------------------------------------------------


SMOL_NEW = 16  # answer tokens per HumanEval prompt: about 7 rounds of the trained drafter each


@pytest.fixture(scope="module")
def smol_eval_setup(smollm2, tmp_path_factory):
    """The bundled trained SmolLM2 drafter (reference format, bf16 on disk) and a float32 feature
    cache of 2 regenerated HumanEval answers (the target's own greedy tokens, stop token included)."""
    from dflashkit.checkpoint import load_config
    from dflashkit.data.chat import TokenizedSample, prompt_ids
    from dflashkit.data.features import extract_features
    from dflashkit.data.prompts import load_prompts
    from dflashkit.demo import bundled_drafter_dir
    from dflashkit.vocab import stop_token_ids

    root = tmp_path_factory.mktemp("eval")
    (root / "ref").symlink_to(bundled_drafter_dir())
    tok = smollm2.tokenizer
    stops = stop_token_ids(tok, smollm2.model.generation_config)
    samples = []
    for conv in load_prompts("humaneval", limit=2):
        ids = prompt_ids(tok, conv.messages)
        ans = generate(Engine(smollm2), torch.tensor([ids]), max_new_tokens=SMOL_NEW, method="ar", stop_ids=stops).tokens
        samples.append(TokenizedSample(conv.id, ids + ans, [0] * len(ids) + [1] * len(ans)))
    extract_features(smollm2, samples, load_config(root / "ref").target_layer_ids, root / "feats", dtype="float32")
    return root


@pytest.mark.slow
def test_eval_cli_offline_needs_no_online_arguments_and_no_target_layers(smollm2, smol_eval_setup, monkeypatch, capsys):
    """Mistake 5: offline mode runs with only --features and --drafter (a reference-format dir);
    online-only options are ignored with a warning, never required. Mistake 8: the target's
    decoder layers are never built with weights (they stay on the meta device)."""
    import dflashkit.target as target_mod

    real = target_mod.load_target

    def guarded(*a, **k):
        assert k.get("weights") is False, "offline evaluation must not load the target's layers"
        return real(*a, **k)

    monkeypatch.setattr(target_mod, "load_target", guarded)
    root = smol_eval_setup
    out = root / "off"
    rc = main(["eval", "--features", str(root / "feats"), "--drafter", f"mine={root / 'ref'}", "--budgets", "4",
               "--out", str(out), "--temperature", "0.7", "target.device=cpu"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["mode"] == "offline" and rep["samples"] == 2
    assert set(rep["drafters"]["mine"]["methods"]) == {"dflash", "ddtree-4"}
    assert all((out / f).is_file() and (out / f).stat().st_size > 0 for f in ("report.md", "tau_hist.png", "slot_acceptance.png"))


@pytest.mark.slow
def test_eval_cli_online_matches_offline(smollm2, smol_eval_setup, capsys):
    """Online on the same prompts (real verification by SmolLM2, the bundled trained drafter):
    greedy outputs identical to autoregressive, and τ / rounds / histogram equal the offline
    replay of the cached regenerated answers (previous test)."""
    root = smol_eval_setup
    rc = main(["eval", "--drafter", f"mine={root / 'ref'}", "--prompts", "humaneval", "--limit", "2",
               "--max-new-tokens", str(SMOL_NEW), "--budgets", "4", "--engine", "hf", "--out", str(root / "on"),
               "target.device=cpu"])
    assert rc == 0, capsys.readouterr().err
    on = json.loads((root / "on" / "report.json").read_text())
    off_dir = root / "off"
    if not (off_dir / "report.json").exists():
        main(["eval", "--features", str(root / "feats"), "--drafter", f"mine={root / 'ref'}", "--budgets", "4",
              "--out", str(off_dir), "target.device=cpu"])
    off = json.loads((off_dir / "report.json").read_text())
    assert on["prompts"] == 2 and on["baseline"]["tokens"] > 0
    for label in ("dflash", "ddtree-4"):
        m_on, m_off = on["drafters"]["mine"]["methods"][label], off["drafters"]["mine"]["methods"][label]
        assert m_on["identical"] is True and m_on["speedup"] > 0
        assert (m_on["tau"], m_on["rounds"], m_on["hist"]) == (m_off["tau"], m_off["rounds"], m_off["hist"])
        assert m_on["tau"] > 1.3  # a trained drafter: multi-token rounds, not the trivial τ = 1
    assert "| mine | DFlash | dflash |" in (root / "on" / "report.md").read_text()


@pytest.mark.slow
def test_eval_cli_suites_side_by_side(smollm2, smol_eval_setup, capsys, monkeypatch):
    """By default the CLI evaluates suites, each at its own answer length, on the default engine
    (on a CPU in float32: the static runner with packed weights, the drafter in bf16 where the
    CPU has bf16 matrix units); every greedy output identical
    to autoregressive decoding (no parting to explain)."""
    import dflashkit.data.prompts as prompts_mod

    # Shorter answers than the suites' 128 tokens, and unequal ones, so that each suite's own shows.
    lengths = {"math": 24, "multiturn": 16}
    suites = tuple(replace(s, max_new_tokens=lengths.get(s.name, s.max_new_tokens)) for s in prompts_mod.EVAL_SUITES)
    monkeypatch.setattr(prompts_mod, "EVAL_SUITES", suites)
    root = smol_eval_setup
    rc = main(["eval", "--drafter", f"mine={root / 'ref'}", "--suites", "math,multiturn", "--limit", "1",
               "--methods", "dflash", "--out", str(root / "suites"), "target.device=cpu",
               "target.dtype=float32"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((root / "suites" / "report.json").read_text())
    assert list(rep["suites"]) == ["math", "multiturn"] and rep["prompts"] == 2
    assert [r["id"] for r in rep["per_prompt"]] == ["math-01", "multiturn-01"]
    assert {name: s["max_new_tokens"] for name, s in rep["suites"].items()} == lengths
    assert all(r["ar_tokens"] <= lengths[r["suite"]] for r in rep["per_prompt"])
    h = rep["headline"]["mine"]["dflash"]
    assert h["mean_tau"] > 1.3 and h["worst_suite"] in ("math", "multiturn")
    assert rep["drafters"]["mine"]["methods"]["dflash"]["identical"] is True
    md = (root / "suites" / "report.md").read_text()
    assert "| mine | DFlash | dflash | " in md
    # Each suite keeps its own per-slot acceptance (pooled, they weigh by rounds), shown side by side.
    per = {s: rep["suites"][s]["drafters"]["mine"]["dflash"] for s in lengths}
    pooled = rep["drafters"]["mine"]["methods"]["dflash"]
    assert pooled["slot_acceptance"] == pytest.approx([sum(m["slot_acceptance"][k] * m["rounds"] for m in per.values())
                                                       / pooled["rounds"] for k in range(len(pooled["slot_acceptance"]))])
    assert per["math"]["slot_acceptance"] != per["multiturn"]["slot_acceptance"] and per["math"]["slot_acceptance"][0] > 0
    assert "Per-slot acceptance per suite" in md
    assert all(" / ".join(f"{p:.2f}" for p in m["slot_acceptance"][:3]) in md for m in per.values())
    # each prompt keeps its request (a conversation's last user message), by which the report names
    # each suite's lowest- and highest-τ prompt
    follow_up = [m["content"] for m in prompts_mod.load_suite("multiturn", 1)[0].messages if m["role"] == "user"][-1]
    assert rep["per_prompt"][1]["request"] == " ".join(follow_up.split())[:90]
    for r in rep["per_prompt"]:
        assert f"| {r['suite']} | {r['tau']['mine/dflash']:.2f} {r['id']}: {r['request']} |" in md
    # Fewer draft tokens: another decoding setting, so --resume evaluates both suites again.
    rc = main(["eval", "--drafter", f"mine={root / 'ref'}", "--suites", "math,multiturn", "--limit", "1",
               "--methods", "dflash", "--out", str(root / "suites"), "target.device=cpu",
               "target.dtype=float32", "--draft-tokens", "3", "--resume"])
    assert rc == 0, capsys.readouterr().err
    short = json.loads((root / "suites" / "report.json").read_text())
    assert "reused_suites" not in short and short["settings"]["draft_tokens"] == 3
    d = short["drafters"]["mine"]
    assert d["block_size"] == 4 and len(d["methods"]["dflash"]["hist"]) == 4 and d["methods"]["dflash"]["identical"]


def test_eval_cli_argument_errors(tmp_path, capsys):
    """Clear errors, each before any model is loaded."""
    assert main(["eval"]) == 1
    assert "--drafter DIR" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(tmp_path / "nope")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    assert main(["eval", "--drafter", str(tmp_path / "d")]) == 1
    assert "config.json" in capsys.readouterr().err
    target = make_tiny_target()
    save_drafter(make_tiny_drafter(target), tmp_path / "ok")
    assert main(["eval", "--drafter", str(tmp_path / "ok"), "--methods", "medusa"]) == 1
    assert "--methods" in capsys.readouterr().err
    for bad in ("0", "8,x"):  # a usage error: one line, exit status 1
        with pytest.raises(SystemExit, match="1"):
            main(["eval", "--drafter", str(tmp_path / "ok"), "--budgets", bad])
        assert "argument --budgets: " in capsys.readouterr().err
    with pytest.raises(SystemExit, match="1"):
        main(["eval", "--drafter", str(tmp_path / "ok"), "--draft-tokens", "0"])
    assert "argument --draft-tokens: expected an integer >= 1" in capsys.readouterr().err
    for bad in ("0", "-1"):  # no suite left with a prompt (or counted from its end): refused before any work
        with pytest.raises(SystemExit, match="1"):
            main(["eval", "--drafter", str(tmp_path / "ok"), "--limit", bad])
        assert "argument --limit: expected an integer >= 1" in capsys.readouterr().err
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            load_suite("code", int(bad))
    assert main(["eval", "--drafter", str(tmp_path / "ok"), "--features", str(tmp_path / "nofeats")]) == 1
    assert "manifest.json" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(tmp_path / "ok"), "--suites", "code,poetry"]) == 1
    assert "unknown evaluation suite 'poetry'" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(tmp_path / "ok"), "--heldout"]) == 1
    assert "--heldout" in capsys.readouterr().err


def test_write_report_files(tmp_path):
    m = {**summarize([1, 2, 4], 4), "tau_per_position": 2.0}
    rep = {"mode": "offline", "samples": 1, "answer_tokens": 9, "drafters": {"a": {"block_size": 4, "methods": {"dflash": m}}}}
    files = write_report(rep, tmp_path)
    assert sorted(f.name for f in files) == ["report.json", "report.md", "slot_acceptance.png", "tau_hist.png"]
    assert "| a | DFlash | dflash | 2.333 | 3 | 2.000 |" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / ".plots").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files)  # no temp folder left


# ---- suites side by side, partings classified ------------------------------------------------------


def _tiny_prompts(n: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(f"p{seed}-{i}", torch.randint(3, 120, (1, 6 + i), generator=g)) for i in range(n)]


def test_evaluate_suites_side_by_side_mean_and_worst(tmp_path):
    """Each suite decodes to its own answer length; the headline is the unweighted mean over suites
    and the worst suite; the pooled report sums rounds and tokens. float32: no parting at all."""
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    suites = [(Suite("a", 2, 12, ""), _tiny_prompts(2, 0)), (Suite("b", 3, 20, ""), _tiny_prompts(3, 1))]
    rep = evaluate_suites(target, {"d": drafter}, suites, methods=["dflash", "ddtree"], budgets=[4], top_k=2, engine="hf")
    assert list(rep["suites"]) == ["a", "b"] and rep["prompts"] == 5
    assert [r["suite"] for r in rep["per_prompt"]] == ["a", "a", "b", "b", "b"]
    assert all(r["ar_tokens"] == (12 if r["suite"] == "a" else 20) for r in rep["per_prompt"])  # no stop ids: full length
    for lab in ("dflash", "ddtree-4"):
        per = {s: rep["suites"][s]["drafters"]["d"][lab] for s in "ab"}
        h = rep["headline"]["d"][lab]
        assert h["mean_tau"] == pytest.approx((per["a"]["tau"] + per["b"]["tau"]) / 2)
        assert h["worst_tau"] == min(m["tau"] for m in per.values()) and per[h["worst_suite"]]["tau"] == h["worst_tau"]
        assert h["best_tau"] == max(m["tau"] for m in per.values()) and h["worst_to_best"] == h["worst_tau"] / h["best_tau"]
        pooled = rep["drafters"]["d"]["methods"][lab]
        assert pooled["rounds"] == per["a"]["rounds"] + per["b"]["rounds"] and sum(pooled["hist"]) == pooled["rounds"]
        assert pooled["identical"] is True and pooled["unexplained_partings"] == []
    files = [f.name for f in write_report(rep, tmp_path)]
    assert "suites.png" in files and (tmp_path / "suites.png").stat().st_size > 0
    assert rep["baseline"]["tokens"] == 2 * 12 + 3 * 20
    for lab in ("dflash", "ddtree-4"):  # each suite's spread over its prompts, from the per-prompt rounds
        for s in "ab":
            lo, hi = rep["suites"][s]["drafters"]["d"][lab]["tau_interval"]
            assert 1 <= lo <= hi <= 4
        assert rep["headline"]["d"][lab]["worst_to_best_interval"][1] <= 1
    assert all(set(r["rounds"]) == set(r["tau"]) and min(r["rounds"].values()) >= 1 for r in rep["per_prompt"])
    md = markdown(rep)
    assert "| d | dflash | " in md and "**mean**" in md and "a (2×12)" in md and "worst/best" in md
    assert "90 % intervals over prompts" in md
    for s in "ab":  # each suite's speed-up with its spread over the suite's prompts
        m = rep["suites"][s]["drafters"]["d"]["dflash"]
        lo, hi = m["speedup_interval"]
        assert lo <= m["speedup"] <= hi and f"{m['speedup']:.2f}x{'!' * m['above_tau']}{'~' * m['spread_wide']} (" in md
    # on a GPU, a report says that its τ compare only with the same command's (docs/recipe.md)
    assert "On a GPU" not in md and "On a GPU, where the near-ties fall" in markdown({**rep, "device": "cuda"})
    # each suite's lowest-τ prompt (the first drafter and method), named by id where no request is known
    lows = {s: min((r for r in rep["per_prompt"] if r["suite"] == s), key=lambda r: r["tau"]["d/dflash"]) for s in "ab"}
    assert "Lowest and highest τ per suite (d, dflash" in md
    assert all(f"| {s} | {r['tau']['d/dflash']:.2f} {r['id']} |" in md for s, r in lows.items())
    # a second drafter, its τ a token ahead on every prompt: paired, it is ahead by exactly that
    rep["drafters"]["e"] = rep["drafters"]["d"]
    rep["headline"]["e"] = {lab: {**h, "mean_tau": h["mean_tau"] + 1} for lab, h in rep["headline"]["d"].items()}
    for s in "ab":
        rep["suites"][s]["drafters"]["e"] = {lab: {**m, "tau": m["tau"] + 1}
                                             for lab, m in rep["suites"][s]["drafters"]["d"].items()}
    for r in rep["per_prompt"]:
        for lab in ("dflash", "ddtree-4"):
            r["tau"][f"e/{lab}"], r["rounds"][f"e/{lab}"] = r["tau"][f"d/{lab}"] + 1, r["rounds"][f"d/{lab}"]
    rep["differences"] = paired_differences(rep, ["a", "b"])
    for lab in ("dflash", "ddtree-4"):
        d = rep["differences"]["d - e"][lab]  # the first named against each later one
        assert all(d[k]["diff"] == pytest.approx(-1) and d[k]["interval"] == pytest.approx((-1, -1), abs=0.01)
                   for k in ("a", "b", "mean"))
    assert "| d - e | dflash | -1.00 (-1.00 to -1.00)" in markdown(rep)
    check_partings(rep)  # nothing to explain
    assert parting_summary(rep) == {}
    # τ_sim of a training category beside online DFlash τ of the suite of the same name only
    rep["tau_sim"] = {"d": {"a": 2.0, "writing": 3.0}}
    tau_a = rep["suites"]["a"]["drafters"]["d"]["dflash"]["tau"]
    assert tau_sim_vs_online(rep) == {"d": {"a": {"tau_sim": 2.0, "tau": tau_a, "rel_diff": pytest.approx(2.0 / tau_a - 1)}}}


def test_a_stopped_suite_evaluation_resumes_from_its_finished_suites(tmp_path, monkeypatch):
    """Each finished suite is saved; a rerun with reuse evaluates only the suites not finished and
    reports the same τ as an uninterrupted run. A saved suite whose drafter weights or settings
    differ is evaluated again."""
    import dflashkit.evaluate.suites as ev

    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    suites = [(Suite("a", 2, 12, ""), _tiny_prompts(2, 0)), (Suite("b", 3, 20, ""), _tiny_prompts(3, 1))]
    kw = dict(methods=["dflash", "ddtree"], budgets=[4], top_k=2, engine="hf")
    whole = evaluate_suites(target, {"d": drafter}, suites, **kw)

    real, calls = ev.evaluate_online, []

    def counted(target, drafters, prompts, **kw):
        calls.append(len(prompts))
        if stop_at == len(calls):
            raise KeyboardInterrupt
        return real(target, drafters, prompts, **kw)

    monkeypatch.setattr(ev, "evaluate_online", counted)
    keep = tmp_path / "suites"
    stop_at = 2  # stopped in suite b
    with pytest.raises(KeyboardInterrupt):
        evaluate_suites(target, {"d": drafter}, suites, keep=keep, **kw)
    assert sorted(f.name for f in keep.iterdir()) == ["a.json"]
    stop_at, calls = 0, []
    resumed = evaluate_suites(target, {"d": drafter}, suites, keep=keep, reuse=True, **kw)
    assert calls == [3] and resumed["reused_suites"] == ["a"]  # suite b only
    assert "reused_suites" not in whole
    assert list(resumed["drafters"]["d"]["methods"]) == ["dflash", "ddtree-4"]  # the order given, not sorted
    for lab in ("dflash", "ddtree-4"):
        assert resumed["headline"]["d"][lab]["mean_tau"] == whole["headline"]["d"][lab]["mean_tau"]
        assert resumed["drafters"]["d"]["methods"][lab]["hist"] == whole["drafters"]["d"]["methods"][lab]["hist"]
    assert [r["tau"] for r in resumed["per_prompt"]] == [r["tau"] for r in whole["per_prompt"]]

    calls = []
    evaluate_suites(target, {"d": drafter}, suites, keep=keep, reuse=True, **{**kw, "budgets": [3]})
    assert calls == [2, 3]  # other settings
    with torch.no_grad():
        next(drafter.parameters()).add_(1e-3)
    calls = []
    evaluate_suites(target, {"d": drafter}, suites, keep=keep, reuse=True, **{**kw, "budgets": [3]})
    assert calls == [2, 3]  # other weights
    calls = []
    evaluate_suites(target, {"d": drafter}, suites, keep=keep, **{**kw, "budgets": [3]})
    assert calls == [2, 3]  # not asked to reuse


def test_bootstrap_intervals_measure_the_spread_over_prompts():
    """A suite whose prompts all reach the same τ has no spread; one whose prompts differ has an
    interval around its pooled τ (tokens / rounds), wider with fewer prompts; the worst/best ratio
    gets its own interval; the same seed draws the same intervals."""
    even = [(2.0, 30)] * 12
    mixed = [(1.5, 40), (3.0, 20), (2.0, 30), (2.5, 24)] * 3
    few = mixed[:4]
    iv = bootstrap_intervals({"even": even, "mixed": mixed, "few": few})
    assert iv["even"] == (2.0, 2.0)
    pooled = sum(t * r for t, r in mixed) / sum(r for _, r in mixed)
    lo, hi = iv["mixed"]
    assert lo < pooled < hi and 1.5 < lo and hi < 3.0
    assert iv["few"][1] - iv["few"][0] > hi - lo
    w_lo, w_hi = iv["worst_to_best"]
    assert 0 < w_lo < w_hi <= 1
    assert bootstrap_intervals({"even": even, "mixed": mixed, "few": few}) == iv
    # paired: a drafter one token of τ ahead on every prompt is ahead by exactly that in every draw,
    # though either τ alone spreads; on the same prompts as itself, by nothing
    ahead = {"mixed": [(t + 1, r) for t, r in mixed]}
    diff = bootstrap_intervals(ahead, against={"mixed": mixed})
    assert diff["mixed"] == pytest.approx((1.0, 1.0)) and diff["mean"] == pytest.approx((1.0, 1.0))
    assert bootstrap_intervals({"mixed": mixed}, against={"mixed": mixed})["mixed"] == (0.0, 0.0)


def test_parting_summary_counts_every_parting_by_class():
    rep = {"per_prompt": [
        {"id": "p1", "suite": "code", "partings": {"d/dflash": {"numerical": True}, "d/ddtree-64": {"numerical": False}}},
        {"id": "p2", "suite": "math", "partings": {"d/dflash": {"numerical": True}}},
        {"id": "p3", "suite": "math"}]}
    assert parting_summary(rep) == {"d/dflash": {"partings": 2, "numerical": 2, "unexplained": []},
                                    "d/ddtree-64": {"partings": 1, "numerical": 0, "unexplained": ["code/p1"]}}


def test_rounding_bound_is_ulps_at_the_magnitude():
    assert rounding_bound(20.0, torch.bfloat16, 4) == 4 * 2 ** -7 * 16  # bf16 spacing at 16..32 is 1/8
    assert rounding_bound(-3.0, torch.bfloat16, 1) == 2 ** -7 * 2
    assert rounding_bound(20.0, torch.float32, 4) == 4 * 2 ** -23 * 16


def test_classify_parting_near_tie_and_real_error():
    # (top ids, their logits) as a pass records them; tokens 3 and 7 one bf16 step (1/8) apart at 16..32
    ar = ([3, 7, 1, 0], [20.0, 19.875, 12.0, 0.0])
    ver = ([7, 3, 1, 0], [20.125, 20.0, 12.0, 0.0])  # the verification pass rounds the other way
    tie = classify_parting(ar, ver, ar_token=3, spec_token=7, dtype=torch.bfloat16)
    assert tie["numerical"] and tie["bound"] == 0.5
    assert tie["passes"]["ar"]["top2_margin"] == 0.125 and tie["passes"]["verify"]["ar_token_gap"] == 0.125
    wrong = classify_parting(ar, ar, ar_token=3, spec_token=1, dtype=torch.bfloat16)  # 8 logits below the top
    assert not wrong["numerical"] and wrong["passes"]["ar"]["spec_token_gap"] == 8.0
    outside = classify_parting(([3, 7], [20.0, 19.875]), ver, ar_token=3, spec_token=9, dtype=torch.bfloat16)
    assert not outside["numerical"] and not outside["passes"]["ar"]["in_top_k"]  # not recorded: not a tie
    # the same near-tie is no excuse in float32, where both passes agree to ~1e-6
    assert not classify_parting(ar, ver, ar_token=3, spec_token=7, dtype=torch.float32)["numerical"]


def test_where_parted_finds_the_first_differing_token():
    from types import SimpleNamespace as G

    from dflashkit.evaluate import where_parted

    ids = torch.tensor([[5, 6]])
    tie = ([3, 7], [20.0, 19.875])  # one bf16 step apart: a near-tie in both passes
    ar = G(tokens=[1, 3, 4], top=[([1], [9.0]), tie, ([4], [9.0])])
    spec = G(tokens=[1, 7, 4], top=[([1], [9.0]), ([7, 3], [20.0, 19.875]), ([4], [9.0])])
    asked = []
    got = where_parted(ar, spec, ids, torch.bfloat16, lambda x: asked.append(x))
    assert got["position"] == 1 and got["numerical"] and asked == []  # a tie needs no float32 arbiter
    far = G(tokens=[1, 7, 4], top=[([1], [9.0]), ([7, 3], [20.0, 12.0]), ([4], [9.0])])
    got = where_parted(ar, far, ids, torch.bfloat16, lambda x: asked.append(x))
    assert got["position"] == 1 and not got["numerical"] and asked == [[5, 6, 1]]  # float32 asked at the parting
    short = G(tokens=[1, 3], top=ar.top[:2])
    assert where_parted(ar, short, ids, torch.bfloat16, lambda x: None) == {
        "position": 2, "numerical": False, "reason": "one output is a prefix of the other"}


def test_float32_arbitrates_partings_beyond_the_ulp_bound():
    """Both passes a few tenths from float32 on every recorded token: a parting whose two tokens
    float32 puts 0.25 apart is numerical though 9 bf16 steps separate them in one pass; a
    verification pass far from float32 (wrong context) or a pair far more off than the other
    tokens is not."""
    exact = torch.tensor([15.0, 12.5, 12.25, 11.0, 10.5, 10.0, 9.0, 8.0, 0.0, 0.0])
    ids = list(range(8))

    def top(values: list[float]) -> tuple[list[int], list[float]]:
        order = sorted(ids, key=lambda i: -values[i])
        return order, [values[i] for i in order]

    ar = top([15.3, 12.8, 12.25, 11.2, 10.25, 10.3, 8.8, 8.1])  # AR: 1 over 2 by 0.55 (bf16: 9 steps at 8..16)
    ver = top([15.2, 12.2, 12.45, 10.8, 10.7, 9.8, 9.2, 7.9])  # verification: 2 over 1 by 0.25
    parting = {"ar_token": 1, "spec_token": 2, "bound": 0.25}
    ok = arbitrate_parting(parting, ar, ver, exact)
    assert ok["numerical"] and ok["exact_gap"] == 0.25
    # AR's deviations less their median (0.2): others at most |-0.25 - 0.2|; the pair's 0.3 - 0.0
    assert ok["passes"]["ar"]["error"] == pytest.approx(0.45) and ok["passes"]["ar"]["pair_error"] == pytest.approx(0.3)
    wrong_context = top([13.0, 14.1, 14.5, 9.0, 12.7, 7.0, 11.2, 5.0])  # 2 on top, others 2-3 off
    assert not arbitrate_parting(parting, ar, wrong_context, exact)["numerical"]
    tight = top([15.0, 12.0, 12.5, 11.0, 10.5, 10.0, 9.0, 8.0])  # exact on all but the pair, which is 0.75 off
    assert not arbitrate_parting(parting, ar, tight, exact)["numerical"]
    # float32 puts the pair 0.05 apart, closer than either pass's error (about 0.45 and 0.3): a tie
    # that rounding decides, however far one pass's gap is from float32's (AR's 0.85: 0.8 off)
    near = exact.clone()
    near[2] = 12.45
    wide = top([15.3, 13.3, 12.45, 11.2, 10.25, 10.3, 8.8, 8.1])
    assert arbitrate_parting(parting, wide, ver, near)["numerical"]
    assert arbitrate_parting(parting, wide, ver, near)["passes"]["ar"]["pair_error"] > 1.5 * 0.45
    assert not arbitrate_parting(parting, wide, tight, near)["numerical"]  # tight's error ~0: it can order them
    assert not arbitrate_parting(parting, ar, ([2, 0], [12.5, 15.0]), exact)["numerical"]  # token 1 not recorded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unexplained_parting_fails_the_evaluation(monkeypatch, dtype):
    """A speculative output that takes a token the target ranks far below its top one (a decoding
    bug, simulated by corrupting one token) is classified unexplained and fails loudly; in bf16
    after float32 arithmetic at that position was consulted too."""
    import dflashkit.evaluate.online as ev

    real = ev.generate

    def corrupt(engine, ids, *, method, **kw):
        g = real(engine, ids, method=method, **kw)
        if method != "ar":
            g.tokens[5] = (g.tokens[5] + 1) % 128
        return g

    monkeypatch.setattr(ev, "generate", corrupt)
    target = make_tiny_target()
    target.model.to(dtype)
    rep = evaluate_online(target, {"d": make_tiny_drafter(target).to(dtype)}, _tiny_prompts(1, 2), methods=["dflash"],
                          max_new_tokens=12, engine="hf")
    (parting,) = rep["per_prompt"][0]["partings"].values()
    assert parting["position"] == 5 and not parting["numerical"]
    assert ("float32" in parting) == (dtype == torch.bfloat16)
    assert parting["passes"]["ar"]["spec_token_gap"] > parting["bound"]
    assert rep["drafters"]["d"]["methods"]["dflash"]["unexplained_partings"] == ["p2-0"]
    with pytest.raises(RuntimeError, match="p2-0 d/dflash at output position 5"):
        check_partings(rep)
    assert "NO, unexplained: p2-0" in markdown(rep)


def test_a_load_change_between_methods_does_not_skew_the_speedup(monkeypatch):
    """A synthetic clock: an autoregressive step costs 1 unit and a DFlash round 2, times the
    machine's load. A load that rises 4x between the two methods of one prompt (and stays) leaves
    the speed-up exactly where it is without any change of load, though a sum of seconds over
    prompts moves; the spread is marked too wide to trust. A speed-up above τ (the autoregressive
    runs alone slowed) is flagged as not credible."""
    import dflashkit.evaluate.online as ev

    real, calls = ev.generate, []

    def clocked(load):
        def timed(engine, ids, *, method, **kw):
            g = real(engine, ids, method=method, **kw)
            calls.append(method)
            steps = len(g.tokens) - 1 if method == "ar" else 2 * g.rounds
            g.prefill_seconds, g.decode_seconds = 0.0, steps * load(len(calls), method)
            return g
        return timed

    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    prompts = _tiny_prompts(5, 3)

    def evaluate(load, repeats=1):
        calls.clear()
        monkeypatch.setattr(ev, "generate", clocked(load))
        rep = evaluate_online(target, {"d": drafter}, prompts, methods=["dflash"], max_new_tokens=12, engine="hf",
                              repeats=repeats)
        return rep, rep["drafters"]["d"]["methods"]["dflash"]

    _, steady = evaluate(lambda n, method: 1.0)
    assert calls == ["ar", "dflash", "dflash", "ar"] * 2 + ["ar", "dflash"]  # the order rotates per prompt
    assert steady["speedup"] == pytest.approx(steady["tau"] / 2) and steady["round_cost"] == pytest.approx(2)
    assert not steady["spread_wide"] and not steady["above_tau"]
    rep, step = evaluate(lambda n, method: 1.0 if n <= 5 else 4.0)  # rises between AR and DFlash of prompt 3
    assert step["speedup"] == pytest.approx(steady["speedup"])
    summed = step["tokens_per_s"] / rep["baseline"]["tokens_per_s"]  # seconds summed over prompts
    assert summed < 0.8 * step["speedup"]
    assert step["spread_wide"] and not step["above_tau"]
    assert f"| d | DFlash | dflash | {step['tau']:.3f} | {step['rounds']} | " in markdown(rep)
    assert f"| {step['speedup']:.2f}x~ (" in markdown(rep) and "too wide to trust" in markdown(rep)
    rep, fast = evaluate(lambda n, method: 5.0 if method == "ar" else 1.0)
    assert fast["speedup"] == pytest.approx(2.5 * fast["tau"]) and fast["above_tau"] and not fast["spread_wide"]
    assert f"| {fast['speedup']:.2f}x! (" in markdown(rep)
    # Repeated turns: each job keeps its fastest time, so a burst of load on single runs (the 1st,
    # 5th, 11th and 19th: AR of prompt 1, DFlash of prompts 2, 3 and 5) leaves the speed-up and its
    # spread as without it.
    burst = {1, 5, 11, 19}
    _, again = evaluate(lambda n, method: 5.0 if n in burst else 1.0, repeats=2)
    assert calls[:8] == ["ar", "dflash", "dflash", "ar", "dflash", "ar", "ar", "dflash"]
    assert again["speedup"] == pytest.approx(steady["speedup"]) and not again["spread_wide"]
    _, once = evaluate(lambda n, method: 5.0 if n in burst else 1.0)
    assert once["spread_wide"]  # without repeats the same bursts are seen


# ---- the command's output directory and its progress off a terminal ----------------------------


@pytest.fixture(scope="module")
def tiny_eval_files(tmp_path_factory):
    """A tiny random target on disk (SmolLM2's tokenizer), a drafter for it and three prompts."""
    from datahelpers import save_tiny_target
    from dflashkit.drafter import DFlashDrafter, drafter_config_for_target
    from dflashkit.target import load_target
    from dflashkit.vocab import default_mask_token_id

    root = tmp_path_factory.mktemp("tiny_eval")
    target = load_target(str(save_tiny_target(root / "model")))
    cfg = drafter_config_for_target(target.config, mask_token_id=default_mask_token_id(target.tokenizer, target.vocab_size),
                                    num_layers=1, num_taps=2, block_size=4)
    save_drafter(DFlashDrafter(cfg).float(), root / "drafter")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}"}) + "\n"
                                                for i in range(3)))
    return root


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_eval_into_a_log_file_writes_progress_lines_while_it_runs(tiny_eval_files, tmp_path):
    """`dflashkit eval ... > log 2>&1`: off a terminal, progress lines at a steady interval, in
    order, before the report; temp folders that a killed evaluation left in --out are removed."""
    import re

    from datahelpers import run_cli_logged
    from dflashkit.progress import INTERVAL_ENV

    root, out = tiny_eval_files, tmp_path / "out"
    stale = [out / f".plots.{_dead_pid()}.0badcafe.tmp", out / "suites" / f".code.json.{_dead_pid()}.0badcafe.tmp"]
    stale[0].mkdir(parents=True)
    (stale[0] / "tau_hist.png").write_bytes(b"left by a killed run")
    stale[1].parent.mkdir()
    stale[1].write_text("{")
    log = tmp_path / "log"
    rc = run_cli_logged(log, "eval", "--drafter", str(root / "drafter"), "--prompts", str(root / "prompts.jsonl"),
                        "--max-new-tokens", "4", "--methods", "dflash", "--engine", "hf", "--out", str(out),
                        f"target.path={root / 'model'}", "target.device=cpu", env={INTERVAL_ENV: "0.001"})
    text = log.read_text()
    assert rc == 0, text
    counts = [int(m) for m in re.findall(r"^online eval: (\d+)/3 prompt \(\d+%\), [\d.]+ prompt/s", text, re.M)]
    assert counts[-1] == 3 and counts == sorted(counts) and min(counts) < 3, text
    assert re.search(r"^online eval: \d+/3 .*, ETA \d\d:\d\d$", text, re.M), text
    assert text.index("online eval: 1/3") < text.index("wrote "), text
    assert not any(p.exists() for p in stale)
    assert (out / "report.json").is_file() and not list(out.glob(".*.tmp"))


def test_a_second_eval_into_the_same_out_is_refused_at_once(tiny_eval_files, tmp_path, monkeypatch, capsys):
    """Two `eval --resume` into one --out: the second is refused with one line naming the holder,
    before it loads any model (not after all its work)."""
    import dflashkit.target as target_mod
    from dflashkit.rundir import output_directory

    def no_model(*a, **k):
        raise AssertionError("a refused evaluation must load no model")

    monkeypatch.setattr(target_mod, "load_target", no_model)
    out = tmp_path / "out"
    with output_directory(out, "eval"):  # the first evaluation, still running
        rc = main(["eval", "--drafter", str(tiny_eval_files / "drafter"), "--suites", "code", "--limit", "1",
                   "--resume", "--out", str(out), f"target.path={tiny_eval_files / 'model'}", "target.device=cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"{out} is in use by `dflashkit eval` (pid " in err and "write elsewhere" in err
