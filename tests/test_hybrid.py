"""Hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3-Next: Gated DeltaNet layers beside gated full attention):
the delta rule over a draft tree, extraction, rollback after any commits, and lossless decoding
(greedy identical to the target's own generation, sampling by chi-square) on tiny random
hybrids in fp32."""

from __future__ import annotations

import json
from collections.abc import Collection

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_hybrid
from datahelpers import one_thread  # noqa: F401
from dflashkit.data.features import online_features
from dflashkit.decode import delta
from dflashkit.decode.engine import Engine
from dflashkit.decode.loop import generate, generate_batch, make_engine
from dflashkit.decode.static import runner_features, static_engine
from test_cache import _random_round
from test_decode import (Oracle, check_joins, expected_taus, greedy_reference, oracle_proposals, ragged_prompts, read_late,
                         sampling_pvalues)

pytestmark = pytest.mark.usefixtures("one_thread")
METHODS = [("ar", None), ("dflash", None), ("ddtree", 6), ("ddtree", 30)]


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def hybrid(request):
    """Qwen3.5-style (a gated MLP per layer), Qwen3.5-MoE-style (routed experts + shared expert) and
    Qwen3-Next (fused linear projections, experts and one dense layer)."""
    return make_tiny_hybrid(moe=request.param == "moe", qwen3_next=request.param == "next")


def _path_closure(parents: list[int]) -> torch.Tensor:
    incl = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for j in range(len(parents)):
        i = j
        while i >= 0:
            incl[j, i], i = True, parents[i]
    return incl


def test_delta_block_over_a_tree_equals_each_path_alone():
    """Every node's output, and the state folded at every node, equal Transformers' token-by-token
    recurrence over that node's root path alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as recurrent

    torch.manual_seed(0)
    b, h, dk, dv = 2, 3, 8, 5
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    t = len(parents)
    q, k = torch.randn(b, t, h, dk), torch.randn(b, t, h, dk)
    v, g, beta, S0 = torch.randn(b, t, h, dv), -torch.rand(b, t, h), torch.rand(b, t, h), torch.randn(b, h, dk, dv)
    incl = _path_closure(parents).expand(b, -1, -1)
    qn, kn = delta._l2(q.transpose(1, 2)) * dk ** -0.5, delta._l2(k.transpose(1, 2))
    O, D, G = delta.block(qn, kn, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), S0, incl)
    for j in range(t):
        path = incl[0, j].nonzero()[:, 0].tolist()
        o, S = recurrent(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], initial_state=S0,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(O[:, :, j], o[:, -1], atol=1e-5, rtol=1e-5)
        folded = delta.fold(S0, kn, D, G, incl[:, j:j + 1], torch.full((b, h, 1), j))
        torch.testing.assert_close(folded, S, atol=1e-5, rtol=1e-5)


def test_extraction_equals_plain_forward(hybrid):
    """The features of extraction (hooks on Transformers' forward) and of the decoding runner's
    prefill (a ragged batch, one prompt longer than a delta-rule sub-block) are the model's own
    hidden states."""
    taps = [0, 1, 3, 5]
    prompts = [torch.randint(3, 120, (n,)) for n in (150, 37, 70)]
    batch = static_engine(hybrid, None, layer_ids=taps)
    batch.prefill(prompts, capacity=8)
    for i, p in enumerate(prompts):
        hs = hybrid.model(p[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[j + 1] for j in taps], dim=-1)[0]  # hidden_states[0] is the embedding
        torch.testing.assert_close(online_features(hybrid, p[None], taps)[0], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner_features(hybrid, p, taps), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.pending[i, :len(p)], want, atol=1e-4, rtol=1e-4)


def test_qwen3_next_projections_map_onto_qwen3_5_layout():
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba (rows grouped per key head) become Qwen3.5's
    [qkv; z; b; a] once per module (a second engine reuses the copy), equal to what Transformers'
    `fix_query_key_value_ordering` derives; fused-row and separate projections prefill alike."""
    target = make_tiny_hybrid(qwen3_next=True)
    la = target.layers[0].linear_attn
    x = torch.randn(2, 5, target.hidden_size)
    q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
    engines = [static_engine(target, None, fuse=fuse, cuda_graphs=False, layer_ids=[0, 3, 5]) for fuse in (False, True)]
    m = engines[0].run.tw[0].mix
    want = torch.cat([t.reshape(2, 5, -1) for t in (q, k, v)], dim=-1)
    for got, ref in ((m.qkv, want), (m.z, z.reshape(2, 5, -1)), (m.b, b), (m.a, a)):
        torch.testing.assert_close(torch.nn.functional.linear(x, got), ref)
    assert engines[1].run.tw[0].mix.proj.data_ptr() == m.qkv.data_ptr()  # one copy for both engines
    prompts = [torch.randint(3, 120, (n,)) for n in (70, 9)]
    for eng in engines:
        eng.prefill(prompts, capacity=8)
    torch.testing.assert_close(engines[1].pending, engines[0].pending, atol=1e-5, rtol=1e-5)


def _prefilled(hybrid, seed: int):
    """An engine with three ragged prompts prefilled, its random stream and the committed tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 120, (n,), generator=gen) for n in (9, 4, 13)]
    eng = static_engine(hybrid, make_tiny_drafter(hybrid))
    eng.prefill(prompts, capacity=16)
    return eng, gen, [p.tolist() for p in prompts]


def _assert_fresh_prefill(eng, committed: list[list[int]], linear_rows: list[int]) -> None:
    """Every row's lengths and keys/values, and the linear state of `linear_rows`, equal a fresh
    prefill of what each row committed."""
    fresh = static_engine(eng.target, eng.drafter)
    fresh.prefill([torch.tensor(c) for c in committed], capacity=64)
    assert eng.lengths == [len(c) for c in committed]
    for i, n in enumerate(eng.lengths):
        torch.testing.assert_close(eng.cache.k[:, i, :, :n], fresh.cache.k[:, i, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(eng.cache.v[:, i, :, :n], fresh.cache.v[:, i, :, :n], atol=1e-4, rtol=1e-4)
    lin, want = eng.cache.linear, fresh.cache.linear
    torch.testing.assert_close(lin.conv[:, linear_rows], want.conv[:, linear_rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin.rec[:, linear_rows], want.rec[:, linear_rows], atol=1e-4, rtol=1e-4)


def test_cache_after_commits_equals_fresh_prefill(hybrid):
    """After random chain and tree commits, every row's keys/values, conv windows and recurrent
    states equal a fresh prefill of what the row committed; the next logits equal the target's."""
    eng, gen, committed = _prefilled(hybrid, 7)
    for _ in range(6):
        for row, new in zip(committed, _random_round(eng, gen, hybrid.vocab_size)):
            row += new
    _assert_fresh_prefill(eng, committed, [0, 1, 2])
    bonus = torch.tensor([5, 6, 7])
    logits = eng.verify(bonus[:, None], torch.zeros(3, 1, dtype=torch.long))[:, 0]
    for i, c in enumerate(committed):
        want = hybrid.model(torch.tensor([c + [int(bonus[i])]])).logits[0, -1]
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)


def _ar_round(engine, gen: torch.Generator, V: int, idle: Collection[int]) -> list[list[int]]:
    """One autoregressive step: every running row keeps its token, idle rows nothing."""
    bonus = torch.randint(3, V, (engine.batch,), generator=gen)
    engine.draft(bonus)
    engine.verify(bonus[:, None], torch.zeros(engine.batch, 1, dtype=torch.long))
    engine.commit([[] if i in idle else [0] for i in range(engine.batch)])
    return [[] if i in idle else [int(bonus[i])] for i in range(engine.batch)]


def test_cache_after_ar_steps_among_commits_equals_fresh_prefill(hybrid):
    """AR steps mixed with chain and tree commits, with a row idle from the fourth round on: every
    row's keys/values equal a fresh prefill of what it committed, the running rows' conv windows
    and recurrent states too, and a commit leaves the idle row's linear state as it was."""
    eng, gen, committed = _prefilled(hybrid, 11)
    lin = eng.cache.linear
    for r, ar in enumerate([True, False, True, True, False, True, False, True]):
        idle = {1} if r >= 3 else set()
        before = [lin.conv[:, 1].clone(), lin.rec[:, 1].clone()]
        new = (_ar_round if ar else _random_round)(eng, gen, hybrid.vocab_size, idle)
        if idle:
            assert torch.equal(lin.conv[:, 1], before[0]) and torch.equal(lin.rec[:, 1], before[1])
        for row, n in zip(committed, new):
            row += n
    _assert_fresh_prefill(eng, committed, [0, 2])  # row 1 went idle: its state is checked above
    with pytest.raises(RuntimeError, match="no verification pass"):  # the last pass was committed once
        eng.commit([[0], [], [0]])


def test_cost_aware_drafting_on_a_hybrid_is_lossless(hybrid):
    """The cost model's timing passes (never committed) leave the state as it was: greedy outputs
    equal the target's own."""
    drafter = make_tiny_drafter(hybrid)
    prompts = ragged_prompts(2, (15, 9))
    refs = [greedy_reference(hybrid, p, 12) for p in prompts]
    gens = generate_batch(static_engine(hybrid, drafter), prompts, max_new_tokens=12, method="dflash",
                          cost_aware=True)
    assert [g.tokens for g in gens] == refs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_advance_the_state_once(monkeypatch):
    """Graph capture (its warm-up runs the step twice) must not advance the recurrent state: AR and
    DFlash equal the target's greedy generation, and a prefill whose last chunk runs in a graph
    equals an eager one."""
    from dflashkit.decode import engine as engine_module

    target = make_tiny_hybrid()
    target.model.cuda()
    drafter = make_tiny_drafter(target).cuda()
    prompt = ragged_prompts(4, (20,))[0].cuda()
    ref = greedy_reference(target, prompt, 16)
    for method in ("ar", "dflash"):
        eng = static_engine(target, drafter if method != "ar" else None, cuda_graphs=True)
        assert generate(eng, prompt, max_new_tokens=16, method=method).tokens == ref, method
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 16)  # 20 tokens: the second chunk runs in a graph
    graphed, eager = static_engine(target, None, cuda_graphs=True), static_engine(target, None, cuda_graphs=False)
    for eng in (graphed, eager):
        eng.prefill([prompt[0]], capacity=32)
    torch.testing.assert_close(graphed.cache.linear.rec, eager.cache.linear.rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graphed.cache.linear.conv, eager.cache.linear.conv, atol=1e-5, rtol=1e-5)


def test_greedy_identical(hybrid):
    """AR, DFlash and DDTree, batch 1 and a ragged batch (one prompt past a sub-block), equal
    Transformers' own greedy generation."""
    drafter = make_tiny_drafter(hybrid)
    prompts = ragged_prompts(1, (20, 7, 90, 12))
    refs = [greedy_reference(hybrid, p, 30) for p in prompts]
    for method, budget in METHODS:
        make = lambda: make_engine(hybrid, drafter if method != "ar" else None)  # noqa: E731
        g = generate(make(), prompts[0], max_new_tokens=30, method=method, budget=budget)
        assert g.tokens == refs[0], (method, budget)
        for i, g in enumerate(generate_batch(make(), prompts, max_new_tokens=30, method=method, budget=budget)):
            assert g.tokens == refs[i], (method, budget, i)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_multi_token_acceptance(hybrid, method, late, monkeypatch):
    """Drafts right for the first j slots (DDTree: through runner-up children): τ is exactly j+1
    and the output unchanged, so the states after accepted paths are the right ones; also when
    rounds are read a round late (the fold's plan made on the device from the walk)."""
    if late:
        read_late(monkeypatch)
    _check_multi_token_acceptance(hybrid, make_tiny_drafter(hybrid), method, cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_multi_token_acceptance_with_graphed_commits(method):
    """The same with the commit in CUDA graphs (`static.graphed_commit`): chains of every length
    and tree paths through runner-up children are folded and moved as the eager commit does."""
    target = make_tiny_hybrid()
    target.model.cuda()
    _check_multi_token_acceptance(target, make_tiny_drafter(target).cuda(), method, cuda_graphs=True)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_multi_token_acceptance_with_fewer_draft_tokens(hybrid, method):
    """The same with 4 of the drafter's 7 draft tokens (`draft_tokens`): verification blocks are
    5 wide, and the recurrent states after every accepted path are still the right ones."""
    _check_multi_token_acceptance(hybrid, make_tiny_drafter(hybrid), method, cuda_graphs=False, draft_tokens=4)


def _check_multi_token_acceptance(target, drafter, method: str, cuda_graphs: bool, draft_tokens: int | None = None) -> None:
    B, V, max_new = (draft_tokens or drafter.config.block_size - 1) + 1, target.vocab_size, 40
    prompts = [p.to(target.device) for p in ragged_prompts(3, (17, 9, 22))]
    seqs = [p[0].tolist() + greedy_reference(target, p, max_new + B) for p in prompts]
    ranks, budget, cap = (1, None, B - 1) if method == "dflash" else (2, 30, 4)
    eng = Oracle(static_engine(target, drafter, cuda_graphs=cuda_graphs, draft_tokens=draft_tokens),
                 *[oracle_proposals(s, V, B, ranks) for s in seqs])
    gens = generate_batch(eng, prompts, max_new_tokens=max_new, method=method, budget=budget, top_k=2)
    for p, s, g in zip(prompts, seqs, gens):
        T = p.shape[1]
        assert g.tokens == s[T:T + max_new]
        assert g.accept_lengths == expected_taus(T, max_new, B, cap)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampling_follows_target_distribution(method):
    target = make_tiny_hybrid(vocab=8, seed=5, layers="LA")
    assert min(sampling_pvalues(target, static_engine, method, peak=40.0)) > 1e-3


@pytest.mark.parametrize("fixed", [False, True])
def test_requests_join_a_running_batch(hybrid, fixed):
    """Continuous batching on a hybrid: joining rows bring their conv and recurrent states."""
    check_joins(hybrid, static_engine, fixed)


def test_transformers_engine_refuses_hybrids(hybrid):
    with pytest.raises(ValueError, match="engine 'static'"):
        Engine(hybrid)


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_every_stage_on_a_hybrid_target(tmp_path, capsys, kind):
    """regenerate -> tokenize -> extract -> train (online and from the feature cache) -> eval ->
    generate -> export -> doctor -> check-features -> serve, on a tiny Qwen3.5-style hybrid (its
    mixture-of-experts variant, a Qwen3-Next) saved with SmolLM2's tokenizer. The server decodes on
    the engine that eval and generate ran on each kind (`make_engine`, 'auto'), so it is started for
    the Qwen3-Next only (each start costs a process's imports, about 10 s)."""
    from datahelpers import live_server, save_tiny_target
    from dflashkit.cli import main

    model = save_tiny_target(tmp_path / "hybrid", hybrid=True, moe=kind == "moe", qwen3_next=kind == "next")
    cpu = [f"target.path={model}", "target.device=cpu"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": q}) + "\n" for i, q in
                               enumerate(["Say hi.", "Name a fruit.", "Count to three.", "Write a haiku."])))
    assert main(["regenerate", "--out", str(tmp_path / "r.jsonl"), f"data.prompts={prompts}", "data.max_new_tokens=12", *cpu]) == 0
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 4
    # A random model's answers may decode to nothing: train on written ones.
    conv = tmp_path / "c.jsonl"
    conv.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for i, (q, a) in enumerate([("Say hi.", "Hi there, how are you today?"),
                                                               ("Name a fruit.", "An apple, or perhaps a pear."),
                                                               ("Count to three.", "One, two, three. Done!")])))
    assert main(["tokenize", "--input", str(conv), "--out", str(tmp_path / "t.jsonl"), *cpu]) == 0
    small = ["drafter.num_layers=1", "drafter.num_taps=2", "drafter.block_size=4"]
    assert main(["extract", "--input", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "f"), *small, *cpu]) == 0
    train = ["train.max_steps=2", "train.batch_size=2", "train.anchors_per_seq=4", "train.eval_samples=1",
             "train.eval_every=1", "train.tensorboard=false", f"data.tokenized={tmp_path / 't.jsonl'}", *small, *cpu]
    assert main(["train", f"train.output_dir={tmp_path / 'on'}", *train]) == 0
    assert main(["train", f"train.output_dir={tmp_path / 'off'}", f"data.features={tmp_path / 'f'}", *train]) == 0
    drafter = tmp_path / "on" / "final"
    # the MLP width: the target's, or 3x hidden for Qwen3.5-MoE (no dense width in its config; Qwen3-Next's
    # names its mlp_only_layers' width)
    assert json.loads((drafter / "config.json").read_text())["intermediate_size"] == (96 if kind == "moe" else 64)
    if kind == "moe":  # a width set in the settings replaces the derived one, whatever the target's kind
        assert main(["train", f"train.output_dir={tmp_path / 'wide'}", "drafter.intermediate_size=40", *train]) == 0
        assert json.loads((tmp_path / "wide" / "final" / "config.json").read_text())["intermediate_size"] == 40
    capsys.readouterr()
    assert main(["eval", "--drafter", f"mine={drafter}", "--prompts", str(prompts), "--limit", "2", "--max-new-tokens",
                 "10", "--budgets", "4", "--out", str(tmp_path / "ev"), *cpu]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    methods = report["drafters"]["mine"]["methods"]
    assert methods["dflash"]["identical"] is True and methods["ddtree-4"]["identical"] is True, methods
    assert main(["generate", "--prompt", "Say hi.", "--drafter", str(drafter), "--method", "ddtree", "--budget", "4",
                 "--max-new-tokens", "6", *cpu]) == 0
    assert main(["export", str(drafter), "--out", str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    assert main(["doctor", str(drafter), *cpu]) == 0
    out = capsys.readouterr().out
    assert "2 linear attention (Gated DeltaNet)" in out and "static runner" in out and "kernels" in out, out
    assert ("mixture of experts" in out) == (kind != "dense"), out
    assert main(["check-features", "target:runner=static", "target", "--input", str(tmp_path / "t.jsonl"),
                 "--min-cosine", "0.99999", "drafter.num_taps=2", *cpu]) == 0
    if kind == "next":
        with live_server("--drafter", str(drafter), *cpu) as url:
            import httpx

            r = httpx.post(f"{url}/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
