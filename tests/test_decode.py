"""Speculative decoding is lossless: greedy DFlash / DDTree outputs equal the target's own greedy
generation, sampled outputs follow the target's distribution, and multi-token acceptance and
tree compaction commit exactly what they should."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_drafter, make_tiny_target
from datahelpers import live_server, one_thread  # noqa: F401
from dflashkit import decode as decode_mod
from dflashkit.checkpoint import load_drafter
from dflashkit.decode import HFEngine, Sampling, Tree, build_tree, chat_ids, generate, generate_stream, target_tokens, walk
from dflashkit.drafter import DFlashDrafter, draft_block, drafter_config_for_target
from dflashkit.static_engine import StaticEngine
from dflashkit.target import Target

ENGINES = {"hf": HFEngine, "static": StaticEngine, "fused": lambda t, d=None: StaticEngine(t, d, fuse=True)}


pytestmark = pytest.mark.usefixtures("one_thread")  # 2 threads run 3-20x slower on the busy 2-core machine


def greedy_reference(target: Target, ids: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy generation (Transformers' `generate`), no stop tokens."""
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class Oracle:
    """An engine whose drafter proposals are replaced by `propose(length) -> logits [1, B-1, V]`
    (the real drafter still runs, so its cache stays in step with the target's)."""

    def __init__(self, engine, propose):
        self.engine, self.propose = engine, propose

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def draft(self, bonus):
        real = self.engine.draft(bonus)
        return self.propose(self.engine.length).to(real)


def oracle_proposals(seq: list[int], V: int, B: int, ranks: int):
    """Slot k (position n+k) proposes the reference token for k <= j(n) = n % B, a wrong one after.
    ranks=1: the right token is the argmax (a DFlash chain accepts j tokens). ranks=2: it is the
    runner-up behind a wrong token, so the accepted path runs through second children (DDTree
    compaction of non-contiguous nodes)."""
    def propose(n: int) -> torch.Tensor:
        logits = torch.zeros(1, B - 1, V)
        for k in range(1, B):
            right = seq[n + k] if n + k < len(seq) else 0
            j = n % B
            first, second = ((right, (right + 1) % V) if ranks == 1 else ((right + 1) % V, right)) if k <= j else \
                ((right + 1) % V, (right + 2) % V)
            logits[0, k - 1, first], logits[0, k - 1, second] = 5.0, 4.9
        return logits
    return propose


def expected_taus(prompt_len: int, max_new: int, B: int, depth_cap: int) -> list[int]:
    """τ per round under `oracle_proposals`: min(j, depth_cap) + 1, the last round clipped."""
    taus, n, made = [], prompt_len, 1
    while made < max_new:
        tau = min(min(n % B, depth_cap) + 1, max_new - made)
        taus.append(tau)
        n, made = n + tau, made + tau
    return taus


# ---- the tree ---------------------------------------------------------------------------------


def test_build_tree_is_best_first():
    torch.manual_seed(0)
    slots, K, budget = 4, 3, 17
    lp, ids = torch.log_softmax(torch.randn(slots, 50), -1).topk(K, dim=-1)
    tree = build_tree(lp, ids, budget)
    # Brute force: every prefix of top-K choices, scored by summed log-probs; the best `budget`.
    scored = []
    for d in range(1, slots + 1):
        for ranks in itertools.product(range(K), repeat=d):
            scored.append((sum(lp[i, r].item() for i, r in enumerate(ranks)), tuple(ids[i, r].item() for i, r in enumerate(ranks))))
    best = {p for _, p in sorted(scored, reverse=True)[:budget]}

    def prefix(i):  # tokens from the root to node i
        out = []
        while i:
            out.append(tree.tokens[i - 1])
            i = tree.parents[i - 1]
        return tuple(reversed(out))

    assert len(tree) == budget
    assert {prefix(i) for i in range(1, budget + 1)} == best
    assert all(p < i for i, p in enumerate(tree.parents, start=1))
    assert tree.depths == [len(prefix(i)) for i in range(1, budget + 1)]
    # top-1 with budget B-1 is the DFlash chain of argmax tokens
    chain = build_tree(lp[:, :1], ids[:, :1], slots)
    assert chain.is_chain() and chain.tokens == ids[:, 0].tolist()


def test_ancestors_and_walk():
    tree = Tree(tokens=[5, 6, 7, 8], parents=[0, 0, 1, 3], depths=[1, 1, 2, 3])  # 1:5 2:6 3:7(under 1) 4:8(under 3)
    anc = tree.ancestors()
    assert anc[4].tolist() == [True, True, False, True, True]
    assert anc[2].tolist() == [True, False, True, False, False]
    # target tokens per node: root says 5 -> node 1 says 7 -> node 3 says 8 -> node 4 says 9 (no child)
    assert walk(tree, [5, 7, 0, 8, 9]) == ([0, 1, 3, 4], 9)
    assert walk(tree, [6, 0, 1, 0, 0]) == ([0, 2], 1)
    assert walk(tree, [3, 0, 0, 0, 0]) == ([0], 3)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(target_tokens(logits, Sampling(1.0, 0.8), gen)[0]) for _ in range(300)}
    assert draws == {0, 1}


# ---- greedy identity, tiny targets (both engines, every method) --------------------------------


@pytest.mark.parametrize("engine", ["hf", "static", "fused"])
def test_greedy_identical_tiny(tiny_target, engine):
    drafter = make_tiny_drafter(tiny_target)
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (1, 20))
    ref = greedy_reference(tiny_target, ids, 40)
    for method, budget in [("ar", None), ("dflash", None), ("ddtree", 6), ("ddtree", 30)]:
        eng = ENGINES[engine](tiny_target, drafter if method != "ar" else None)
        g = generate(eng, ids, max_new_tokens=40, method=method, budget=budget)
        assert g.tokens == ref, (method, budget)
        assert g.finish_reason == "length" and 1 + sum(g.accept_lengths) == 40


def test_hf_engine_sliding_window_target():
    """Sliding layers: full-length cache layers (rollback by position) + the window in the mask."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2,
                      sliding_window=5, use_sliding_window=True, max_window_layers=0, initializer_range=0.3)
    target = Target(Qwen3ForCausalLM(cfg).float(), None)
    drafter = make_tiny_drafter(target)
    ids = torch.randint(3, 120, (1, 12))
    ref = greedy_reference(target, ids, 30)
    for method, budget in [("dflash", None), ("ddtree", 20)]:
        assert generate(HFEngine(target, drafter), ids, max_new_tokens=30, method=method, budget=budget).tokens == ref


def test_static_engine_matches_draft_block_and_target(tiny_target):
    """One round by hand: the static engine's drafter step equals `draft_block` (the
    parity-tested inference path), its tree verification equals the target's own forward with a
    4-D mask, and after compaction to a non-contiguous path both agree again."""
    drafter = make_tiny_drafter(tiny_target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    torch.manual_seed(2)
    ids = torch.randint(3, 120, (1, 30))
    st, hf = StaticEngine(tiny_target, drafter), HFEngine(tiny_target, drafter)
    for eng in (st, hf):
        eng.prefill(ids[:, :25], capacity=80)
    torch.testing.assert_close(st.draft(ids[:, 25]), hf.draft(ids[:, 25]), atol=1e-5, rtol=1e-5)
    tree = build_tree(*torch.log_softmax(torch.randn(7, 128), -1).topk(3, dim=-1), budget=12)
    tokens, depths = torch.tensor([[ids[0, 25].item(), *tree.tokens]]), torch.tensor([0, *tree.depths])
    torch.testing.assert_close(st.verify(tokens, depths, tree.ancestors()), hf.verify(tokens, depths, tree.ancestors()),
                               atol=1e-5, rtol=1e-5)
    kids = tree.children()
    second = list(kids[0].values())[1]
    path = [0, second, *list(kids[second].values())[:1]]
    assert path != list(range(len(path)))
    for eng in (st, hf):
        eng.commit(path)
    bonus = torch.tensor([7])
    d_st = st.draft(bonus)
    torch.testing.assert_close(d_st, hf.draft(bonus), atol=1e-5, rtol=1e-5)
    feats = torch.cat([tiny_target.forward(ids[:, :25], drafter.config.target_layer_ids).features, hf.pending], dim=1)
    h = draft_block(drafter, tiny_target.embed, drafter.new_cache(), feats, bonus)
    torch.testing.assert_close(tiny_target.lm_head(h[:, 1:]), d_st, atol=1e-4, rtol=1e-4)
    # the compacted target cache equals a cache that saw only the accepted tokens
    committed = torch.cat([ids[:, :26], tokens[:, path[1:]]], dim=1)
    ref_logits = tiny_target.forward(torch.cat([committed, bonus[None]], 1), drafter.config.target_layer_ids).logits[:, -1]
    torch.testing.assert_close(st.verify(bonus[None], torch.zeros(1, dtype=torch.long), None)[:, 0], ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", ["hf", "static"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_multi_token_acceptance_commits_correctly_tiny(tiny_target, engine, method):
    """Drafts that are right for the first j slots: τ must be exactly j+1 (DDTree: the right token
    is the runner-up, so the path runs through non-contiguous nodes) and the output unchanged."""
    drafter = make_tiny_drafter(tiny_target)
    B, V, max_new = drafter.config.block_size, tiny_target.vocab_size, 40
    torch.manual_seed(3)
    ids = torch.randint(3, 120, (1, 17))
    seq = ids[0].tolist() + greedy_reference(tiny_target, ids, max_new + B)
    ranks, budget, cap = (1, None, B - 1) if method == "dflash" else (2, 30, 4)  # 30 nodes = full binary tree to depth 4
    eng = Oracle(ENGINES[engine](tiny_target, drafter), oracle_proposals(seq, V, B, ranks))
    g = generate(eng, ids, max_new_tokens=max_new, method=method, budget=budget, top_k=2)
    assert g.tokens == seq[17:17 + max_new]
    assert g.accept_lengths == expected_taus(17, max_new, B, cap)
    assert max(g.accept_lengths) > 3


def test_stop_token_and_final_round_clipping(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    B, V = drafter.config.block_size, tiny_target.vocab_size
    torch.manual_seed(4)
    ids = torch.randint(3, 120, (1, 16))
    ref = greedy_reference(tiny_target, ids, 40)
    stop = ref[9]
    first = ref.index(stop)
    eng = Oracle(HFEngine(tiny_target, drafter), oracle_proposals(ids[0].tolist() + ref, V, B, 1))
    streamed: list[int] = []
    for new, g in generate_stream(eng, ids, max_new_tokens=40, method="dflash", stop_ids={stop}):
        streamed += new
    assert g.finish_reason == "stop" and g.tokens == ref[:first + 1] == streamed
    assert 1 + sum(g.accept_lengths) == len(g.tokens)  # the last round counts only tokens up to the stop
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(HFEngine(tiny_target), ids, max_new_tokens=4, method="dflash")
    with pytest.raises(ValueError, match="batch size 1"):
        generate(HFEngine(tiny_target, drafter), ids.repeat(2, 1), max_new_tokens=4)


# ---- sampling is lossless (statistical) -------------------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expected < 5 are pooled."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _exact_joint(target: Target, ids: torch.Tensor, steps: int, sampling: Sampling) -> torch.Tensor:
    """P(x1..x_steps) under the target's own sampler, by enumerating every continuation."""
    V = target.vocab_size
    seqs, probs = ids, torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        logits = target.model(seqs).logits[:, -1].double() / sampling.temperature
        p = torch.softmax(logits, -1)
        probs = (probs[:, None] * p).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return probs


def _lossy_target_tokens(logits, sampling, generator):
    """A classic bug: accept a draft when it is the target's argmax (not its sample)."""
    out = target_tokens(logits, sampling, generator)
    out[1:] = logits[1:].argmax(-1)
    return out


@pytest.mark.parametrize("method,lossy", [("dflash", False), ("ddtree", False), ("dflash", True)])
def test_sampling_follows_target_distribution(method, lossy, monkeypatch):
    """600 3-token samples from speculative decoding (with proposals that are often accepted)
    against the exact distribution of the target's own sampling: chi-square on the joint of the
    2nd and 3rd tokens (decided by tree walks) and on each token's marginal. The lossy variant
    proves that the test can fail."""
    if lossy:
        monkeypatch.setattr(decode_mod, "target_tokens", _lossy_target_tokens)
    V, steps, n = 8, 3, 600
    target = make_tiny_target(num_layers=2, hidden=32, vocab=V, seed=5)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(4.0)  # peaked but far from deterministic
    drafter = make_tiny_drafter(target, num_layers=1, num_taps=1, block_size=4)
    ids = torch.tensor([[1, 3, 5]])
    sampling = Sampling(temperature=1.0)
    # Proposals: the target's own next-token distribution along its most likely path.
    mode = torch.tensor([ids[0].tolist() + greedy_reference(target, ids, 6)])
    table = torch.cat([torch.zeros(1, 1, V), target.model(mode).logits], dim=1)  # row p: distribution of token p
    eng = Oracle(HFEngine(target, drafter), lambda n: table[:, n + 1:n + 4])
    counts = torch.zeros(V ** steps)
    accepted = 0
    for s in range(n):
        g = generate(eng, ids, max_new_tokens=steps, method=method, budget=6, top_k=2, sampling=Sampling(1.0, 1.0, seed=s))
        counts[(g.tokens[0] * V + g.tokens[1]) * V + g.tokens[2]] += 1
        accepted += sum(t - 1 for t in g.accept_lengths)
    assert accepted > n // 3, "the test needs drafts to be accepted often"
    exact = _exact_joint(target, ids, steps, sampling)
    c3, p3 = counts.view(V, V, V), exact.view(V, V, V)
    pvalues = [_chi2_pvalue(c3.sum(0).flatten(), p3.sum(0).flatten().float()),
               _chi2_pvalue(c3.sum((0, 2)), p3.sum((0, 2)).float()),
               _chi2_pvalue(c3.sum((0, 1)), p3.sum((0, 1)).float())]
    if lossy:
        assert min(pvalues) < 1e-6
    else:
        assert min(pvalues) > 1e-3


# ---- the real testbed (SmolLM2) ------------------------------------------------------------------

N_NEW = 24


@pytest.fixture(scope="module")
def smol_case(smollm2):
    from dflashkit.data.prompts import load_prompts

    conv = load_prompts("humaneval", limit=1)[0]
    ids = chat_ids(smollm2.tokenizer, conv.messages[0]["content"])
    return ids, greedy_reference(smollm2, ids, N_NEW)


def _smol_drafter(smollm2, layers=1):
    from dflashkit.vocab import default_mask_token_id

    torch.manual_seed(0)
    cfg = drafter_config_for_target(smollm2.config, default_mask_token_id(smollm2.tokenizer, smollm2.vocab_size), num_layers=layers)
    return DFlashDrafter(cfg)


@pytest.mark.slow
def test_smollm2_greedy_identical(smollm2, smol_case):
    """The bundled trained drafter (real multi-token acceptance): DFlash and DDTree, both
    engines, equal the target's own greedy tokens (untrained drafters: the tests below)."""
    from dflashkit.demo import bundled_drafter_dir

    ids, ref = smol_case
    trained = load_drafter(bundled_drafter_dir(), smollm2, dtype=torch.float32)
    taus = []
    for engine, method, budget in [("hf", "dflash", None), ("hf", "ddtree", 16), ("static", "ddtree", 32)]:
        g = generate(ENGINES[engine](smollm2, trained), ids, max_new_tokens=N_NEW, method=method, budget=budget)
        assert g.tokens == ref[:N_NEW], (engine, method)
        taus.append(g.tau)
    assert min(taus) > 1.5


@pytest.mark.slow
@pytest.mark.parametrize("engine,method", [("hf", "ddtree"), ("static", "dflash")])
def test_smollm2_multi_token_acceptance(smollm2, smol_case, engine, method):
    ids, ref = smol_case
    drafter = _smol_drafter(smollm2)
    B, T = drafter.config.block_size, ids.shape[1]
    ranks, budget, cap = (1, None, B - 1) if method == "dflash" else (2, 30, 4)
    eng = Oracle(ENGINES[engine](smollm2, drafter), oracle_proposals(ids[0].tolist() + ref, smollm2.vocab_size, B, ranks))
    g = generate(eng, ids, max_new_tokens=N_NEW, method=method, budget=budget, top_k=2)
    assert g.tokens == ref[:N_NEW]
    assert g.accept_lengths == expected_taus(T, N_NEW, B, cap)


@pytest.mark.slow
def test_reference_format_drafter_loads_and_runs(smollm2, smol_case, tmp_path):
    """A directory as published drafters ship it (bf16 safetensors, Qwen3 config with auto_map,
    transformers_version, bos/eos ids...) loads against the target and decodes losslessly."""
    ids, ref = smol_case
    src = _smol_drafter(smollm2, layers=2)
    c = src.config
    config = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": 16, "bos_token_id": 1, "eos_token_id": 2,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids},
        "dtype": "bfloat16", "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size,
        "initializer_range": 0.02, "intermediate_size": c.intermediate_size, "layer_types": ["full_attention"] * 2,
        "max_position_embeddings": 8192, "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 9,
        "num_hidden_layers": 2, "num_key_value_heads": 3, "num_target_layers": 30, "rms_norm_eps": 1e-5,
        "rope_scaling": None, "rope_theta": c.rope_theta, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    drafter = load_drafter(tmp_path, smollm2, dtype=torch.float32)
    assert drafter.config.target_layer_ids == c.target_layer_ids and drafter.config.num_hidden_layers == 2
    g = generate(HFEngine(smollm2, drafter), ids, max_new_tokens=16, method="dflash")
    assert g.tokens == ref[:16] and g.rounds >= 1


@pytest.mark.slow
def test_generate_command(smollm2, tmp_path, capsys):
    from dflashkit.checkpoint import save_drafter
    from dflashkit.cli import main

    save_drafter(_smol_drafter(smollm2), tmp_path / "d")
    rc = main(["generate", "--prompt", "Say hi.", "--drafter", str(tmp_path / "d"), "--method", "ddtree", "--budget", "8",
               "--max-new-tokens", "6", "target.device=cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens in" in out and "tau" in out and "ddtree (budget 8" in out
    assert main(["generate", "--prompt", "x", "--method", "dflash"]) == 1
    assert "needs --drafter" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_speculative_with_openai_client(smollm2, tmp_path):
    """`dflashkit serve --drafter DIR --ddtree-budget 8`: the official client gets the target's
    greedy answer (plain and streamed), acceptance statistics in `usage`, 4xx for bad requests."""
    import openai

    from dflashkit.checkpoint import save_drafter
    from dflashkit.data.chat import prompt_ids
    from dflashkit.vocab import stop_token_ids

    save_drafter(_smol_drafter(smollm2), tmp_path / "d")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([prompt_ids(smollm2.tokenizer, chat)])
    want = greedy_reference(smollm2, ids, 10)
    stops = stop_token_ids(smollm2.tokenizer, smollm2.model.generation_config)
    want = want[:next((i + 1 for i, t in enumerate(want) if t in stops), len(want))]
    with live_server("--drafter", str(tmp_path / "d"), "--ddtree-budget", "8") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=chat, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == smollm2.tokenizer.decode(want, skip_special_tokens=True)
        u = r.usage.model_dump()
        assert u["completion_tokens"] == len(want) and u["decoding"] == "ddtree-8"
        assert u["rounds"] == len(want) - 1 - u["accepted_draft_tokens"] and u["tau"] >= 1
        chunks = list(client.chat.completions.create(model=model, messages=chat, max_tokens=10, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        assert chunks[-1].usage.model_dump()["rounds"] == u["rounds"]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "x"}])
        sampled = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0.8, seed=3)
        assert sampled.choices[0].text and sampled.usage.model_dump()["rounds"] >= 1
