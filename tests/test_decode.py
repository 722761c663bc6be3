"""Speculative decoding is lossless: greedy DFlash / DDTree outputs equal the target's own greedy
generation, sampled outputs follow the target's distribution, and multi-token acceptance and
tree compaction commit exactly what they should."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from safetensors.torch import save_file

from conftest import children, make_tiny_drafter, make_tiny_target, node_paths, ragged_trees, read_late
from datahelpers import live_server, one_thread  # noqa: F401
from dflashkit.checkpoint import load_drafter
from dflashkit.decode import round as round_mod
from dflashkit.decode.engine import Draft, Engine
from dflashkit.decode.generation import Sampling, new_generator, target_tokens
from dflashkit.decode.loop import Request, decode_stream, generate, generate_batch
from dflashkit.decode.static import static_engine
from dflashkit.decode.tree import Trees, ancestors, best_first, chains, draft_trees, verification, walk
from dflashkit.drafter import DFlashDrafter, drafter_config_for_target
from dflashkit.generate import chat_ids
from dflashkit.target import Target

def padded_engine(target: Target, drafter: DFlashDrafter | None = None) -> Engine:
    """The static engine with every prefill and prompt-long first draft padded to a length bucket,
    as on a GPU where such passes replay CUDA graphs (`Engine.small_pass`); here they run eagerly
    at the padded length, so the padding's semantics are what is tested."""
    engine = static_engine(target, drafter, fuse=False)
    engine.small_pass = 4096
    return engine


ENGINES = {"hf": Engine, "static": lambda t, d=None: static_engine(t, d, fuse=False),
           "fused": lambda t, d=None: static_engine(t, d, fuse=True), "padded": padded_engine}
METHODS = [("ar", None), ("dflash", None), ("ddtree", 6), ("ddtree", 30)]


pytestmark = pytest.mark.usefixtures("one_thread")  # 2 threads run 3-20x slower on the busy 2-core machine


def greedy_reference(target: Target, ids: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy generation (Transformers' `generate`), no stop tokens."""
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class Oracle:
    """An engine whose drafter proposals are replaced, for the row of prompt i, by
    `proposers[i](length) -> logits [1, B-1, V]` (the real drafter still runs, so its cache
    stays in step with the target's)."""

    def __init__(self, engine, *proposers):
        self.engine, self.proposers, self.rows = engine, proposers, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, prompts, capacity):
        self.rows = list(range(len(prompts)))
        return self.engine.prefill(prompts, capacity)

    def keep_rows(self, rows):
        self.rows = [self.rows[r] for r in rows]
        self.engine.keep_rows(rows)

    def draft(self, bonus, budget=None, top_k=4, scored=False):
        real = self.engine.draft(bonus).logits
        logits = torch.cat([self.proposers[r](n) for r, n in zip(self.rows, self.engine.cache.lengths_t.tolist())]).to(real)
        assert logits.shape == real.shape, "the proposals must be as wide as the real drafter's draft"
        return Draft(logits, *draft_trees(logits, bonus, budget, top_k, scored))


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


@pytest.mark.parametrize("slots,K,budget", [(4, 3, 17), (3, 9, 7)])  # fewer candidates than nodes; more
def test_best_first_trees_hold_the_best_prefixes(slots, K, budget):
    torch.manual_seed(0)
    lp, ids = torch.log_softmax(torch.randn(3, slots, 50), -1).topk(K, dim=-1)
    lp[2, 1, 0] = 0.0  # a slot the drafter is sure of: a child scores as its parent (a tie)
    trees = best_first(lp, ids, budget)
    assert trees.size == budget
    for r in range(3):
        # Brute force: every prefix of top-K choices, scored by summed log-probs; the best `budget`.
        scored = []
        for d in range(1, slots + 1):
            for ranks in itertools.product(range(K), repeat=d):
                scored.append((sum(lp[r, i, k].item() for i, k in enumerate(ranks)), -d,
                               tuple(ids[r, i, k].item() for i, k in enumerate(ranks))))
        best = sorted(scored, reverse=True)[:budget]
        paths = node_paths(trees, r)
        assert paths == [p for _, _, p in best]  # in best-first order
        assert all(p < i for i, p in enumerate(trees.parents[r].tolist(), start=1))
        assert trees.depths[r].tolist() == [len(p) for p in paths]
        torch.testing.assert_close(trees.scores[r], torch.tensor([s for s, _, _ in best]))
    # top-1 with budget B-1 is the DFlash chain of argmax tokens
    chain = best_first(lp[:, :, :1], ids[:, :, :1], slots)
    assert all(torch.equal(a, b) for a, b in zip(chain[:3], chains(ids[:, :, 0])[:3]))


def test_ancestors_and_walk():
    # 1:5 2:6 3:7 (under 1) 4:8 (under 3), and a padding node 5 (its own parent)
    trees = Trees(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 0, 1, 3, 5]]), torch.tensor([[1, 1, 2, 3, 0]]),
                  torch.zeros(1, 5))
    anc = ancestors(trees.parents)
    assert anc[0, 4].tolist() == [True, True, False, True, True, False]
    assert anc[0, 2].tolist() == [True, False, True, False, False, False]
    assert anc[0, 5].tolist() == [False] * 5 + [True]

    def walked(picked):  # the target's token per node -> (accepted path, the next bonus)
        w = walk(trees, anc, torch.tensor([picked]))
        a = int(w.accepted[0])
        assert w.new[0, :a + 1].tolist() == [picked[j] for j in w.path[0, :a + 1].tolist()]
        return w.path[0, :a + 1].tolist(), int(w.bonus[0])

    # root says 5 -> node 1 says 7 -> node 3 says 8 -> node 4 says 9 (no child)
    assert walked([5, 7, 0, 8, 9, 9]) == ([0, 1, 3, 4], 9)
    assert walked([6, 0, 1, 0, 0, 9]) == ([0, 2], 1)
    assert walked([3, 0, 0, 0, 0, 9]) == ([0], 3)
    # a chain walks the same with or without its shortcut
    chain = chains(torch.tensor([[4, 5, 6], [4, 5, 6]]))
    picked = torch.tensor([[4, 5, 0, 1], [1, 2, 3, 4]])
    full, short = walk(chain, ancestors(chain.parents), picked), walk(chain, ancestors(chain.parents), picked, chain=True)
    assert full.accepted.tolist() == short.accepted.tolist() == [2, 0]
    assert full.bonus.tolist() == short.bonus.tolist() == [0, 1]
    assert torch.equal(ancestors(chain.parents), verification(torch.tensor([1, 2]), chain, chain=True)[2])


def test_a_seed_names_one_stream_modulo_2_64():
    draw = lambda seed: new_generator(Sampling(1.0, seed=seed)).random()  # noqa: E731
    assert draw(-1) == draw(2**64 - 1) != draw(1) == draw(1) != draw(2)
    assert new_generator(Sampling()) is None  # greedy draws nothing


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = random.Random(0)
    draws = {int(target_tokens(logits, Sampling(1.0, 0.8), torch.tensor([gen.random()], dtype=torch.float64))[0])
             for _ in range(300)}
    assert draws == {0, 1}


# ---- greedy identity, tiny targets (every engine, every method, batch 1 and ragged) ------------


def ragged_prompts(seed: int, lengths=(20, 7, 33, 12)) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randint(3, 120, (1, n)) for n in lengths]


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("engine", ["hf", "static", "fused", "padded"])
def test_greedy_identical_tiny(tiny_target, engine, late, monkeypatch):
    if late:
        read_late(monkeypatch)
    drafter = make_tiny_drafter(tiny_target)
    prompts = ragged_prompts(1)
    refs = [greedy_reference(tiny_target, p, 30) for p in prompts]
    for method, budget in METHODS:
        make = lambda: ENGINES[engine](tiny_target, drafter if method != "ar" else None)  # noqa: E731
        g = generate(make(), prompts[0], max_new_tokens=30, method=method, budget=budget)
        assert g.tokens == refs[0], (method, budget)
        assert g.finish_reason == "length" and 1 + sum(g.accept_lengths) == 30
        for i, g in enumerate(generate_batch(make(), prompts, max_new_tokens=30, method=method, budget=budget)):
            assert g.tokens == refs[i], (method, budget, i)


@pytest.mark.parametrize("engine", ["hf", "static", "padded"])
def test_fewer_draft_tokens_greedy_identical_and_rounds_as_long_as_the_shorter_block(tiny_target, engine):
    """draft_tokens=4 with a drafter of block 8: every method stays token-identical to the
    target's greedy output (batch 1 and ragged), and a drafter that is always right (the oracle)
    has each round accept exactly the shorter block's tokens: the draft holds 4 tokens, not 7."""
    drafter = make_tiny_drafter(tiny_target)
    assert drafter.config.block_size == 8
    prompts = ragged_prompts(2)
    refs = [greedy_reference(tiny_target, p, 30) for p in prompts]

    def make(d):
        if engine == "hf":
            return Engine(tiny_target, d, draft_tokens=4)
        e = static_engine(tiny_target, d, fuse=False, draft_tokens=4)
        e.small_pass = 4096 if engine == "padded" else 0  # (as `padded_engine`)
        return e

    for method, budget in METHODS[1:]:
        g = generate(make(drafter), prompts[0], max_new_tokens=30, method=method, budget=budget)
        assert g.tokens == refs[0], (method, budget)
        assert max(g.accept_lengths) <= 5
        for i, g in enumerate(generate_batch(make(drafter), prompts, max_new_tokens=30, method=method, budget=budget)):
            assert g.tokens == refs[i], (method, budget, i)
    T = prompts[0].shape[1]
    oracle = Oracle(make(drafter), oracle_proposals(prompts[0][0].tolist() + refs[0], tiny_target.vocab_size, 5, 1))
    g = generate(oracle, prompts[0], max_new_tokens=30, method="dflash")
    assert g.tokens == refs[0]
    assert g.accept_lengths == expected_taus(T, 30, 5, 4)


def test_draft_tokens_out_of_range_is_a_clear_error(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    for bad in (0, 8, 2.5, True):
        with pytest.raises(ValueError, match=r"draft_tokens \(--draft-tokens\): expected an int from 1 to 7"):
            Engine(tiny_target, drafter, draft_tokens=bad)
    with pytest.raises(ValueError, match="without a drafter"):
        static_engine(tiny_target, None, draft_tokens=4)
    assert Engine(tiny_target, drafter).block == 8 and Engine(tiny_target, drafter, draft_tokens=7).block == 8


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_ragged_prompts_prefilled_in_chunks(tiny_target, engine, monkeypatch):
    """Ragged prompts longer than a prefill chunk (8 tokens here), prefilled together: each row's
    first token comes from the chunk that holds its last prompt token, and decoding is the
    target's own."""
    from dflashkit.decode import engine as engine_mod

    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 8)
    drafter = make_tiny_drafter(tiny_target)
    prompts = ragged_prompts(1)  # 20, 7, 33, 12 tokens: last tokens in chunks 2, 0, 4, 1
    for g, p in zip(generate_batch(ENGINES[engine](tiny_target, drafter), prompts, max_new_tokens=10), prompts):
        assert g.tokens == greedy_reference(tiny_target, p, 10)

def sliding_targets() -> dict[str, Target]:
    """Sliding windows named per layer (Qwen3 `layer_types`) and a window without layer types
    (Mistral-7B-v0.1 / Phi-3-mini-4k style: every layer slides)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, initializer_range=0.3)
    qwen = Qwen3Config(**small, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=5,
                       use_sliding_window=True, max_window_layers=0)
    mistral = MistralConfig(**small, sliding_window=6)
    return {"layer_types": Target(Qwen3ForCausalLM(qwen).float(), None),
            "window_only": Target(MistralForCausalLM(mistral).float(), None)}


@pytest.mark.parametrize("kind", ["layer_types", "window_only"])
def test_sliding_window_targets(kind):
    """Past the window, rolled-back drafts must not linger in any layer: batch 1 and ragged."""
    target = sliding_targets()[kind]
    assert set(target.layer_kinds) == ({"sliding_attention", "full_attention"} if kind == "layer_types" else {"sliding_attention"})
    drafter = make_tiny_drafter(target)
    prompts = ragged_prompts(2, (12, 5, 9))
    refs = [greedy_reference(target, p, 30) for p in prompts]
    engines = ["hf", "static"] if kind == "layer_types" else ["hf"]  # the static runner has no Mistral layers
    for engine in engines:
        for method, budget in [("dflash", None), ("ddtree", 20)]:
            alone = generate(ENGINES[engine](target, drafter), prompts[0], max_new_tokens=30, method=method, budget=budget)
            gens = generate_batch(ENGINES[engine](target, drafter), prompts, max_new_tokens=30, method=method, budget=budget)
            assert alone.tokens == refs[0] and [g.tokens for g in gens] == refs, (engine, method)


def test_static_and_hf_runners_agree_on_a_tree_round(tiny_target):
    """One round by hand, ragged rows with different trees: the static runner's drafter step
    and tree verification equal the Transformers runner's, and after committing non-contiguous
    paths both agree again."""
    drafter = make_tiny_drafter(tiny_target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    prompts = [p[0] for p in ragged_prompts(2, (25, 14))]
    st, hf = ENGINES["static"](tiny_target, drafter), Engine(tiny_target, drafter)
    for eng in (st, hf):
        eng.prefill(prompts, capacity=80)
    bonus = torch.tensor([5, 9])
    torch.testing.assert_close(st.draft(bonus).logits, hf.draft(bonus).logits, atol=1e-5, rtol=1e-5)
    trees = ragged_trees([12, 8], 128, torch.Generator().manual_seed(3), slots=7)
    tokens, depths, anc = verification(bonus, trees)
    torch.testing.assert_close(st.verify(tokens, depths, anc), hf.verify(tokens, depths, anc), atol=1e-5, rtol=1e-5)
    paths = []
    for r in range(2):
        kids = children(trees, r)
        second = list(kids[0].values())[1]
        paths.append([0, second, *list(kids[second].values())[:1]])
    for eng in (st, hf):
        eng.commit(paths)
    torch.testing.assert_close(st.draft(bonus).logits, hf.draft(bonus).logits, atol=1e-5, rtol=1e-5)


def test_padded_passes_leave_the_drafter_its_context(tiny_target):
    """Prefill and first draft padded to a length bucket (what CUDA graphs replay): the drafter's
    logits in that draft and in the next round equal those of passes at the prompts' own lengths,
    so the padding positions are never seen as context."""
    drafter = make_tiny_drafter(tiny_target)
    prompts = [p[0] for p in ragged_prompts(1)]
    padded, plain = ENGINES["padded"](tiny_target, drafter), ENGINES["static"](tiny_target, drafter)
    for eng in (padded, plain):
        eng.prefill(prompts, capacity=100)
    assert padded.pending.shape[1] == 64 > plain.pending.shape[1] == 33
    bonus = torch.tensor([5, 9, 3, 7])
    first = [eng.draft(bonus).logits for eng in (padded, plain)]
    torch.testing.assert_close(*first, atol=1e-5, rtol=1e-5)
    for eng in (padded, plain):
        eng.verify(*verification(bonus, chains(torch.full((4, 3), 11))))
        eng.commit([range(3), range(1), range(2), range(3)])
    torch.testing.assert_close(padded.draft(bonus).logits, plain.draft(bonus).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_a_draft_writes_no_slot_twice(tiny_target, engine):
    """Rows share one context width, so a row's context may hold padding rows; they go past the
    row's block, and each layer's one store of a draft (context and block) writes no slot twice
    (a scatter that did would keep either write). Ragged prompts, then ragged commits."""
    drafter = make_tiny_drafter(tiny_target)
    eng = ENGINES[engine](tiny_target, drafter)
    prompts = [p[0] for p in ragged_prompts(1)]
    eng.prefill(prompts, capacity=100)
    stores = []
    real = eng.dcache.store
    eng.dcache.store = lambda layer, k, v, slots: (stores.append(slots.clone()), real(layer, k, v, slots))[1]
    bonus = torch.tensor([5, 9, 3, 7])
    eng.draft(bonus)
    eng.verify(*verification(bonus, chains(torch.full((4, 3), 11))))
    eng.commit([range(3), range(1), range(2), range(3)])
    eng.draft(bonus)
    assert len(stores) == 2 * drafter.config.num_hidden_layers
    assert all(len(set(row.tolist())) == len(row) for slots in stores for row in slots)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("engine", ["hf", "static", "padded"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_multi_token_acceptance_commits_correctly_tiny(tiny_target, engine, method, late, monkeypatch):
    """Drafts that are right for the first j slots: τ must be exactly j+1 (DDTree: the right token
    is the runner-up, so the path runs through non-contiguous nodes) and the output unchanged,
    for each row of a ragged batch, also when every round is read a round late (committed from
    the walk on the device); the top logits recorded per output token are those of the node that
    chose it (its top-1 id is the token; recording reads every round at once)."""
    if late:
        read_late(monkeypatch)
    drafter = make_tiny_drafter(tiny_target)
    B, V, max_new = drafter.config.block_size, tiny_target.vocab_size, 40
    prompts = ragged_prompts(3, (17, 9, 22))
    seqs = [p[0].tolist() + greedy_reference(tiny_target, p, max_new + B) for p in prompts]
    ranks, budget, cap = (1, None, B - 1) if method == "dflash" else (2, 30, 4)  # 30 nodes = full binary tree to depth 4
    eng = Oracle(ENGINES[engine](tiny_target, drafter), *[oracle_proposals(s, V, B, ranks) for s in seqs])
    gens = generate_batch(eng, prompts, max_new_tokens=max_new, method=method, budget=budget, top_k=2,
                          record_top=0 if late else 3)
    for p, s, g in zip(prompts, seqs, gens):
        T = p.shape[1]
        assert g.tokens == s[T:T + max_new]
        if not late:
            assert [ids[0] for ids, _ in g.top] == g.tokens and all(v[0] >= v[1] >= v[2] for _, v in g.top)
        assert g.accept_lengths == expected_taus(T, max_new, B, cap)
        assert max(g.accept_lengths) > 3


@pytest.mark.parametrize("late", [False, True])
def test_stop_token_limits_and_streaming(tiny_target, late, monkeypatch):
    """Ragged rows with per-row limits (one of 1) and a stop token that ends a row early: every
    row equals its batch-1 generation, the final round counts only tokens up to the stop, and
    the stream yields exactly the rows still running (also when rounds are read a round late)."""
    if late:
        read_late(monkeypatch)
    drafter = make_tiny_drafter(tiny_target)
    B, V = drafter.config.block_size, tiny_target.vocab_size
    prompts = ragged_prompts(4, (16, 7, 20))
    ref = greedy_reference(tiny_target, prompts[0], 40)
    stop = ref[9]
    first = ref.index(stop)
    seqs = [p[0].tolist() + greedy_reference(tiny_target, p, 60) for p in prompts]
    limits = [40, 1, 25]
    eng = Oracle(Engine(tiny_target, drafter), *[oracle_proposals(s, V, B, 1) for s in seqs])
    seen: dict[int, list[int]] = {i: [] for i in range(3)}
    done: set[int] = set()
    for step in decode_stream(eng, prompts, max_new_tokens=limits, method="dflash", stop_ids={stop}):
        assert not done & {i for i, _, _ in step}, "a finished row was stepped again"
        for i, new, g in step:
            seen[i] += new
            assert g.tokens == seen[i]
            done |= {i} if g.finish_reason else set()
    assert done == {0, 1, 2}
    gens = generate_batch(Engine(tiny_target, drafter), prompts, max_new_tokens=limits, method="dflash", stop_ids={stop})
    assert gens[0].finish_reason == "stop" and gens[0].tokens == ref[:first + 1] == seen[0]
    assert gens[1].tokens == seqs[1][7:8] and gens[1].finish_reason == "length"
    for i, g in enumerate(gens):
        alone = generate(Engine(tiny_target, drafter), prompts[i], max_new_tokens=limits[i], method="dflash", stop_ids={stop})
        assert g.tokens == alone.tokens == seen[i]
        assert 1 + sum(g.accept_lengths) == len(g.tokens)  # the last round counts only what it kept


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_finished_rows_can_stay_idle(tiny_target, engine):
    """With fixed rows (the CUDA-graph setting: no new batch shapes), rows that finished or were
    cancelled stay in the batch committing nothing; every other row is unchanged. AR rounds are
    read a round late there (the host reads a round while the next runs): a row's tokens stop at
    its end all the same."""
    drafter = make_tiny_drafter(tiny_target)
    prompts = ragged_prompts(5, (16, 7, 20))
    limits = [30, 3, 12]
    for method, budget in [("ar", None), ("dflash", None), ("ddtree", 10)]:
        eng = ENGINES[engine](tiny_target, drafter if method != "ar" else None)
        eng.fixed_rows = True
        asked = []

        def cancelled(i: int) -> bool:  # row 2's client leaves after its second round
            asked.append(i)
            return i == 2 and asked.count(2) > 2

        gens = generate_batch(eng, prompts, max_new_tokens=limits, method=method, budget=budget, cancelled=cancelled)
        assert eng.batch == 3  # nobody left the batch
        for i in (0, 1):
            assert gens[i].tokens == greedy_reference(tiny_target, prompts[i], limits[i]), (method, i)
        assert not gens[2].finish_reason and 0 < len(gens[2].tokens) < limits[2]


@pytest.mark.parametrize("engine,fixed,late", [("hf", False, False), ("static", True, False), ("static", True, True)])
def test_requests_join_a_running_batch(tiny_target, engine, fixed, late, monkeypatch):
    """Continuous batching: requests admitted between rounds decode exactly as alone (greedy and
    a seeded sample), whatever the round they arrive in; a finished or cancelled row is free for
    the next request at once. With fixed rows the joining requests take the idle rows (the batch
    never grows past 3 rows for 5 requests); otherwise finished rows leave and new ones append.
    late: rounds read a round late, so requests join while the round after a row's end runs."""
    if late:
        read_late(monkeypatch)
    check_joins(tiny_target, ENGINES[engine], fixed)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_generate_batch_refills_rows(tiny_target, engine):
    """`generate_batch(rows=2)` over 6 prompts: finished rows are refilled with the next prompts
    (the batch never exceeds 2 rows), and every prompt decodes exactly as in one whole batch
    (greedy and seeded samples; per-prompt limits and settings follow their prompt)."""
    drafter = make_tiny_drafter(tiny_target)
    prompts = [p[0] for p in ragged_prompts(7, (16, 7, 20, 11, 25, 9))]
    limits = [14, 3, 30, 9, 12, 5]
    samplings = [Sampling(), Sampling(1.0, 0.9, seed=3), Sampling(), Sampling(0.8, 1.0, seed=4), Sampling(),
                 Sampling(1.0, 1.0, seed=5)]
    for method in ("ar", "dflash"):
        eng = ENGINES[engine](tiny_target, drafter if method != "ar" else None)
        batches = []
        join = eng.join
        eng.join = lambda *a, **kw: (batches.append(eng.batch), join(*a, **kw))[1]
        refilled = generate_batch(eng, prompts, rows=2, refill=0.5, max_new_tokens=limits, method=method,
                                  sampling=samplings)
        assert batches and max(batches) <= 2 and eng.batch <= 2, (method, batches)
        whole = generate_batch(ENGINES[engine](tiny_target, drafter if method != "ar" else None), prompts,
                               max_new_tokens=limits, method=method, sampling=samplings)
        assert [g.tokens for g in refilled] == [g.tokens for g in whole], method
        assert [len(g.tokens) for g in refilled] == limits, method


def check_joins(tiny_target: Target, make_engine, fixed: bool) -> None:
    drafter = make_tiny_drafter(tiny_target)
    prompts = [p[0] for p in ragged_prompts(6, (16, 7, 20, 11, 25))]
    limits = [14, 3, 40, 9, 12]
    samplings = [Sampling(), Sampling(), Sampling(), Sampling(1.0, 0.9, seed=3), Sampling()]
    arrivals = {1: [1, 2], 3: [3], 4: [4]}  # admit call -> prompts that arrive then (stream index = order)
    for method, budget in [("ar", None), ("dflash", None), ("ddtree", 10)]:
        make = lambda: make_engine(tiny_target, drafter if method != "ar" else None)  # noqa: E731
        eng = make()
        eng.fixed_rows = fixed
        calls, sizes, order = [0], [], [0]

        def admit(running: int) -> list[Request]:
            calls[0] += 1
            sizes.append(eng.batch)
            order.extend(arrivals.get(calls[0], []))
            return [Request(prompts[i], limits[i], samplings[i]) for i in arrivals.get(calls[0], [])]

        def cancelled(i: int) -> bool:  # prompt 2's client leaves before the fourth admission
            return order[i] == 2 and calls[0] >= 3

        out, seen = {}, {i: [] for i in range(5)}
        # (4 candidates per slot: the rows' ends, and so the batch sizes asserted below, follow the trees)
        for step in decode_stream(eng, [prompts[0]], max_new_tokens=limits[0], method=method, budget=budget, top_k=4,
                                  admit=admit, cancelled=cancelled):
            for i, new, g in step:
                out[order[i]] = g
                seen[order[i]] += new
        assert sorted(out) == [0, 1, 2, 3, 4] and sizes[:4] == [1, 3, 3, 3], (method, sizes)
        if fixed:
            assert eng.batch == 3 and max(sizes) == 3, method  # rows 1 and 2 were taken again
        for i in (0, 1, 3, 4):
            alone = generate(make(), prompts[i], max_new_tokens=limits[i], method=method, budget=budget, top_k=4,
                             sampling=samplings[i])
            assert out[i].tokens == seen[i] == alone.tokens and out[i].finish_reason == "length", (method, i)
            assert out[i].accept_lengths == alone.accept_lengths, (method, i)  # the drafter saw the same context
        assert out[0].tokens == greedy_reference(tiny_target, prompts[0][None], limits[0])
        assert not out[2].finish_reason and 0 < len(out[2].tokens) < limits[2]
    # A request that ends at its first token, joining when nothing else runs: the stream still ends.
    arriving = [[Request(prompts[1], 1)]]
    eng = make()
    eng.fixed_rows = fixed  # into the idle row, or into an empty batch
    steps = list(decode_stream(eng, [prompts[0]], max_new_tokens=1, method="ar",
                               admit=lambda running: arriving.pop() if arriving else []))
    assert [[(i, len(new)) for i, new, _ in s] for s in steps] == [[(0, 1)], [(1, 1)]] and eng.batch == 1


def test_request_errors(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    ids = torch.randint(3, 120, (1, 8))
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(Engine(tiny_target), ids, max_new_tokens=4, method="dflash")
    with pytest.raises(ValueError, match="generate_batch"):
        generate(Engine(tiny_target, drafter), ids.repeat(2, 1), max_new_tokens=4)
    with pytest.raises(ValueError, match="node budget"):
        generate(Engine(tiny_target, drafter), ids, max_new_tokens=4, method="ddtree")
    with pytest.raises(ValueError, match=r"top_k \(DDTree's candidates per slot\).*got 0"):  # (it drafted nothing)
        generate(Engine(tiny_target, drafter), ids, max_new_tokens=4, method="ddtree", budget=8, top_k=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(Engine(tiny_target, drafter), [ids, torch.tensor([], dtype=torch.long)], max_new_tokens=4)
    limit = tiny_target.max_positions
    with pytest.raises(ValueError, match=f"prompt 0 has {limit} tokens.*{limit} positions"):
        generate(Engine(tiny_target, drafter), torch.randint(3, 120, (1, limit)), max_new_tokens=4)
    g = generate(Engine(tiny_target), torch.randint(3, 120, (1, limit - 3)), max_new_tokens=10, method="ar")
    assert len(g.tokens) == 3 and g.finish_reason == "length"  # the answer ends where the positions do


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


def _lossy_target_tokens(logits, sampling, u):
    """A classic bug: accept a draft when it is the target's argmax (not its sample)."""
    out = target_tokens(logits, sampling, u)
    out[1:] = logits[1:].argmax(-1)
    return out


@pytest.mark.parametrize("method,lossy,cost_aware,acceptance", [
    ("dflash", False, False, "match"), ("ddtree", False, False, "match"), ("dflash", True, False, "match"),
    ("dflash", False, False, "rejection"), ("ddtree", False, False, "rejection"), ("ddtree", False, True, "rejection")])
def test_sampling_follows_target_distribution(method, lossy, cost_aware, acceptance, monkeypatch):
    """600 3-token samples from speculative decoding (with proposals that are often accepted)
    against the exact distribution of the target's own sampling: chi-square on the joint of the
    2nd and 3rd tokens (decided by tree walks) and on each token's marginal, under either
    acceptance rule. The lossy variant proves that the test can fail."""
    if lossy:
        monkeypatch.setattr(round_mod, "target_tokens", _lossy_target_tokens)
    if cost_aware:  # the verified prefix chosen per round; every round drafts (skipping is plain sampling)
        from dflashkit.decode import cost

        monkeypatch.setattr(cost.Drafting, "choose", lambda self: True)
    target = make_tiny_target(num_layers=2, hidden=32, vocab=8, seed=5)
    pvalues = sampling_pvalues(target, Engine, method, cost_aware, acceptance=acceptance)
    if lossy:
        assert min(pvalues) < 1e-6
    else:
        assert min(pvalues) > 1e-3


def sampling_pvalues(target: Target, make_engine, method: str, cost_aware: bool = False, peak: float = 4.0,
                     acceptance: str = "rejection") -> list[float]:
    """Chi-square p-values of 600 sampled 3-token answers against the exact distribution (see
    test_sampling_follows_target_distribution); `target` has a vocabulary of 8, its LM head is
    scaled by `peak` (a distribution peaked but far from deterministic)."""
    V, steps, n = target.vocab_size, 3, 600
    with torch.no_grad():
        target.model.lm_head.weight.mul_(peak)
    drafter = make_tiny_drafter(target, num_layers=1, num_taps=1, block_size=4)
    ids = torch.tensor([[1, 3, 5]])
    sampling = Sampling(temperature=1.0)
    # Proposals: the target's own next-token distribution along its most likely path.
    mode = torch.tensor([ids[0].tolist() + greedy_reference(target, ids, 6)])
    table = torch.cat([torch.zeros(1, 1, V), target.model(mode).logits], dim=1)  # row p: distribution of token p
    eng = Oracle(make_engine(target, drafter), lambda n: table[:, n + 1:n + 4])
    counts = torch.zeros(V ** steps)
    accepted = 0
    for s in range(n):
        g = generate(eng, ids, max_new_tokens=steps, method=method, budget=6, top_k=2, sampling=Sampling(1.0, 1.0, seed=s),
                     cost_aware=cost_aware, acceptance=acceptance)
        counts[(g.tokens[0] * V + g.tokens[1]) * V + g.tokens[2]] += 1
        accepted += sum(t - 1 for t in g.accept_lengths)
    assert accepted > n // 3, "the test needs drafts to be accepted often"
    exact = _exact_joint(target, ids, steps, sampling)
    c3, p3 = counts.view(V, V, V), exact.view(V, V, V)
    return [_chi2_pvalue(c3.sum(0).flatten(), p3.sum(0).flatten().float()),
            _chi2_pvalue(c3.sum((0, 2)), p3.sum((0, 2)).float()),
            _chi2_pvalue(c3.sum((0, 1)), p3.sum((0, 1)).float())]


# ---- the real testbed (SmolLM2) ------------------------------------------------------------------

N_NEW = 24
BATCH_NEW = 16  # 3 to 8 rounds per row with the trained drafter, τ up to 7


@pytest.fixture(scope="module")
def smol_case(smollm2):
    from dflashkit.data.prompts import load_prompts

    conv = load_prompts("humaneval", limit=1)[0]
    ids = chat_ids(smollm2.tokenizer, conv.messages[0]["content"])
    return ids, greedy_reference(smollm2, ids, N_NEW)


@pytest.fixture(scope="module")
def smol_batch(smollm2):
    from dflashkit.data.prompts import load_prompts
    from dflashkit.demo import bundled_drafter_dir

    drafter = load_drafter(bundled_drafter_dir(), smollm2, dtype=torch.float32)
    prompts = [chat_ids(smollm2.tokenizer, c.messages[0]["content"]) for c in load_prompts("humaneval", limit=4)]
    assert len({p.shape[1] for p in prompts}) == 4  # ragged
    return drafter, prompts, [greedy_reference(smollm2, p, BATCH_NEW) for p in prompts]


def _smol_drafter(smollm2, layers=1):
    from dflashkit.vocab import default_mask_token_id

    torch.manual_seed(0)
    cfg = drafter_config_for_target(smollm2.config, default_mask_token_id(smollm2.tokenizer, smollm2.vocab_size), num_layers=layers)
    return DFlashDrafter(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "static", "padded"])
def test_smollm2_greedy_identical(smollm2, smol_batch, engine):
    """The bundled trained drafter (real multi-token acceptance): every method, batch 1 and a
    ragged batch of 4 HumanEval prompts, equals the target's own greedy tokens, with the same τ
    per round in the batch as alone."""
    drafter, prompts, refs = smol_batch
    for method, budget in [("ar", None), ("dflash", None), ("ddtree", 16)]:
        d = drafter if method != "ar" else None
        alone = generate(ENGINES[engine](smollm2, d), prompts[0], max_new_tokens=BATCH_NEW, method=method, budget=budget)
        batch = generate_batch(ENGINES[engine](smollm2, d), prompts, max_new_tokens=BATCH_NEW, method=method,
                               budget=budget)
        assert alone.tokens == refs[0], method
        assert [g.tokens for g in batch] == refs, method
        assert batch[0].accept_lengths == alone.accept_lengths
        if method != "ar":
            assert min(g.tau for g in batch) > 1.5, method


@pytest.mark.slow
def test_smollm2_fewer_draft_tokens_greedy_identical(smollm2, smol_batch):
    """The bundled drafter drafting 7 tokens a round instead of 15 (`draft_tokens`): a ragged
    batch of 4 equals the target's greedy tokens, rounds accept at most 8 tokens, and the drafter
    still drafts well (τ > 1.5)."""
    drafter, prompts, refs = smol_batch
    for method, budget in [("dflash", None), ("ddtree", 16)]:
        batch = generate_batch(static_engine(smollm2, drafter, draft_tokens=7), prompts, max_new_tokens=BATCH_NEW,
                               method=method, budget=budget)
        assert [g.tokens for g in batch] == refs, method
        assert max(max(g.accept_lengths) for g in batch) <= 8, method
        assert min(g.tau for g in batch) > 1.5, method


@pytest.mark.slow
def test_smollm2_batch_sampling_per_row_seeded(smollm2, smol_batch):
    """temperature 0.7, top_p 0.8: a row's draws equal its batch-1 draws with the same seed (so
    they follow the target's own distribution), another batch reproduces the seeded rows, and
    every emitted token lies in the target's top-p nucleus at its position."""
    drafter, prompts, _ = smol_batch
    prompts, n, temp, top_p = [prompts[0], prompts[2]], 12, 0.7, 0.8
    samp = [Sampling(temp, top_p, seed=s) for s in (11, 13)]
    a = generate_batch(Engine(smollm2, drafter), prompts, method="dflash", max_new_tokens=n, sampling=samp)
    for p, s, g in zip(prompts, samp, a):
        assert g.tokens == generate(Engine(smollm2, drafter), p, method="dflash", max_new_tokens=n, sampling=s).tokens
    # the second row's prompt and seed, now in the first row
    b = generate_batch(Engine(smollm2, drafter), [prompts[1], prompts[0]], method="ddtree", budget=8, max_new_tokens=n,
                       sampling=[samp[1], Sampling(temp, top_p, seed=2)])
    assert b[0].tokens == a[1].tokens and b[1].tokens != a[0].tokens  # DDTree draws what DFlash draws: the target's
    assert sum(sum(g.accept_lengths) - g.rounds for g in a) > 0, "drafts must be accepted under sampling too"
    for p, g in zip(prompts, a):
        seq = torch.cat([p, torch.tensor([g.tokens])], 1)
        probs = torch.softmax(smollm2.model(seq).logits[0, p.shape[1] - 1:-1] / temp, -1)  # [n, V]
        sp, order = probs.sort(-1, descending=True)
        rank = (order == torch.tensor(g.tokens)[:, None]).float().argmax(-1)
        mass_before = (sp.cumsum(-1) - sp).gather(1, rank[:, None])[:, 0]
        assert (mass_before < top_p + 1e-4).all(), "a token outside the top-p nucleus"


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
    g = generate(Engine(smollm2, drafter), ids, max_new_tokens=8, method="dflash")  # (untrained: about a round a token)
    assert g.tokens == ref[:8] and g.rounds >= 1


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
    rc = main(["generate", "--prompt", "Say hi.", "--drafter", str(tmp_path / "d"), "--draft-tokens", "3",
               "--max-new-tokens", "6", "target.device=cpu"])
    assert rc == 0 and "[dflash, 3 draft tokens a round] 6 tokens in" in capsys.readouterr().out
    assert main(["generate", "--prompt", "x", "--drafter", str(tmp_path / "d"), "--draft-tokens", "16"]) == 1
    assert "expected an int from 1 to 15" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--method", "ar", "--draft-tokens", "3"]) == 1
    assert "--draft-tokens needs a speculative --method" in capsys.readouterr().err


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


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_a_bf16_drafter_over_an_fp32_target_is_lossless(tiny_target, engine):
    """A drafter that runs in bf16 over an fp32 target (what `make_engine` sets up on a CPU with
    bf16 matrix units, from a copy: the caller's drafter stays fp32): greedy outputs equal the
    target's own, ragged batch, both methods; its drafts are the fp32 drafter's to bf16 rounding."""
    import copy

    from dflashkit.decode.loop import bf16_drafting, make_engine

    drafter = make_tiny_drafter(tiny_target)
    half = copy.deepcopy(drafter).to(torch.bfloat16)
    prompts = ragged_prompts(8, (15, 9, 21))
    refs = [greedy_reference(tiny_target, p, 20) for p in prompts]
    for method, budget in [("dflash", None), ("ddtree", 12)]:
        gens = generate_batch(ENGINES[engine](tiny_target, half), prompts, max_new_tokens=20, method=method, budget=budget)
        assert [g.tokens for g in gens] == refs, method
    full, low = ENGINES[engine](tiny_target, drafter), ENGINES[engine](tiny_target, half)
    drafts = [e.draft(e.prefill([p[0] for p in prompts], capacity=64).argmax(-1)).logits for e in (full, low)]
    assert drafts[1].dtype == torch.float32 and low.draft_dtype == torch.bfloat16
    assert (drafts[0] - drafts[1]).abs().max() < 0.02 * drafts[0].abs().max()
    auto = make_engine(tiny_target, drafter)
    assert auto.draft_dtype == (torch.bfloat16 if bf16_drafting(tiny_target) else torch.float32)
    assert next(drafter.parameters()).dtype == torch.float32


# ---- cost-aware drafting ---------------------------------------------------------------------------


def test_cost_curve_picks_the_best_prefix():
    from dflashkit.decode.cost import TRUST, CostCurve, tree_expectation

    conf = torch.tensor([[0.9, 0.8, 0.1, 0.1]])  # one row: slots 1-2 likely accepted, 3-4 not
    exp = tree_expectation(conf.log().cumsum(1))  # a chain's scores: running sums of its slots' log-probabilities
    torch.testing.assert_close(exp, torch.tensor([1.0, 1.9, 2.62, 2.692, 2.6992]))
    flat = CostCurve([1, 5], [1.0, 1.0])  # memory-bound: verifying more is free
    steep = CostCurve([1, 5], [1.0, 5.0])  # compute-bound: each token costs a step
    assert flat.best_width(exp) == 5 and steep.best_width(exp) == 1
    assert CostCurve([1, 3, 5], [1.0, 1.4, 1.8]).best_width(exp) == 3  # slots 1-2 pay, 3-4 do not
    assert CostCurve([1, 5], [1.0, 1.8]).best_width(exp) == 5  # only measured widths: 3 is not one
    steep.observe(12.0, 1, chosen=True)  # a round of width 1 took 12 s: 11 s of it were not verification
    assert steep.overhead_seconds == 11.0 and steep.best_width(exp) == 5  # the fixed cost makes width pay
    # a width is a candidate only if its round saves >= 10 % of a full one (else: decide nothing, as fixed)
    assert CostCurve([1, 2, 4, 8], [0.95, 0.96, 0.98, 1.0]).candidates() == [8]
    assert CostCurve([1, 2, 4, 8], [0.5, 0.6, 0.95, 1.0]).candidates() == [1, 2, 8]
    # ... with the stall of reading the confidences before verifying
    assert CostCurve([1, 2, 4, 8], [0.5, 0.6, 0.95, 1.0], stall_seconds=0.35).candidates() == [1, 8]
    # ... and the round's other costs, as learnt: a pass 20 % cheaper saves 8 % of such a round
    gpu = CostCurve([1, 16], [1.25, 1.53], stall_seconds=0.09)
    assert gpu.candidates() == [1, 16]
    gpu.observe(2.36, 16, chosen=False)
    assert gpu.candidates() == [16] and gpu.best_width(torch.ones(16)) == 16
    # ... and what choosing rounds of each width cost once run: here a read that stalls more than
    # measured, learnt from rounds of any width until a width has its own
    gpu = CostCurve([1, 16], [1.25, 1.70], stall_seconds=0.1)
    gpu.observe(2.7, 16, chosen=False)
    assert gpu.candidates() == [1, 16]  # 1.0 + 0.1 + 1.25 <= 0.9 * 2.7
    for _ in range(TRUST):
        gpu.observe(3.1, 16, chosen=True)
    assert gpu.chosen_seconds(1) == pytest.approx(1.0 + 0.4 + 1.25) and gpu.candidates() == [16]
    for _ in range(30):  # contexts grew: every round costs 1 ms more, and so do choosing rounds
        gpu.observe(3.7, 16, chosen=False)
    assert gpu.chosen_seconds(1) == pytest.approx(2.0 + 0.4 + 1.25, abs=0.01) and gpu.candidates() == [16]
    # A CPU runs no round unread: the first choosing round sets the overhead, later ones correct
    # each width's cost, up or down, on their own (a short pass runs slower in a round than back to back).
    cpu = CostCurve([1, 4, 16], [50.0, 53.0, 80.0])
    cpu.observe(53.0 + 50.0, 4, chosen=True)  # a first round slower than the next ones: overhead 50
    for _ in range(TRUST):
        cpu.observe(53.0 + 10.0 + 20.0, 4, chosen=True)  # 10 more than measured, and 20 of overhead
        cpu.observe(50.0 + 20.0, 1, chosen=True)  # as measured
    assert cpu.chosen_seconds(4) == pytest.approx(83.0) and cpu.chosen_seconds(1) == pytest.approx(70.0)
    assert cpu.chosen_seconds(16) == pytest.approx(50.0 + 80.0 - 30.0 + 5.0)  # (the median of the pooled corrections)
    chain = tree_expectation(torch.tensor([[0.9, 0.8, 0.5] + [0.1] * 12]).log().cumsum(1))
    assert cpu.best_width(chain) == 4  # 2.98 tokens in 83 s, against 1 in 70 and 3.02 in 105
    # a tree's expectation: the sum of its first m nodes' path probabilities, plus the target's token
    torch.testing.assert_close(tree_expectation(torch.tensor([[0.0, -0.693147, -1e9]])), torch.tensor([1.0, 2.0, 2.5, 2.5]))
    # summed over rows
    torch.testing.assert_close(tree_expectation(torch.tensor([[0.0, -1e9], [-0.693147, -0.693147]])),
                               torch.tensor([2.0, 3.5, 4.0]))


def test_a_narrow_pass_timed_slower_than_a_wider_one_takes_the_wider_ones_time(monkeypatch):
    """The measured curve never makes a narrow pass dearer than a wider one: a machine's slow
    moment during the 1-token passes must not price them above 8-token passes."""
    from types import SimpleNamespace

    from dflashkit.decode import cost

    clock = [0.0]
    pass_seconds = {1: 0.171, 2: 0.090, 4: 0.095, 8: 0.123}  # 1 token met a slow moment

    def verify(tokens, depths):
        clock[0] += pass_seconds[tokens.shape[1]]
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock[0])
    engine = SimpleNamespace(batch=1, target=SimpleNamespace(device=torch.device("cpu")), verify=verify)
    curve = cost.measure(engine, [1, 2, 4, 8])
    assert curve.seconds == pytest.approx([0.090, 0.090, 0.095, 0.123])


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_cost_aware_drafting_is_lossless(tiny_target, engine):
    """Whatever prefix the cost model keeps, greedy outputs equal the target's own, for ragged
    rows and both methods; the sizes it chose are recorded per round."""
    drafter = make_tiny_drafter(tiny_target)
    prompts = ragged_prompts(6, (15, 9, 21))
    refs = [greedy_reference(tiny_target, p, 24) for p in prompts]
    for method, budget in [("dflash", None), ("ddtree", 12)]:
        gens = generate_batch(ENGINES[engine](tiny_target, drafter), prompts, max_new_tokens=24, method=method,
                              budget=budget, cost_aware=True)
        assert [g.tokens for g in gens] == refs, method
        top = drafter.config.block_size - 1 if method == "dflash" else budget
        assert all(len(g.draft_sizes) == g.rounds and all(0 <= s <= top for s in g.draft_sizes) for g in gens)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_rounds_without_a_draft_leave_the_drafter_its_whole_context(tiny_target, engine):
    """Cost-aware decoding may run autoregressive rounds on an engine with a drafter: the drafter's
    next draft (after more rounds than a block) equals the draft of an engine prefilled with
    every committed token, for ragged rows and an idle one."""
    drafter = make_tiny_drafter(tiny_target)
    prompts = [p[0] for p in ragged_prompts(3, (11, 6, 9))]
    eng = ENGINES[engine](tiny_target, drafter)
    bonus = eng.prefill(prompts, capacity=64).argmax(-1)
    eng.draft(bonus)  # a draft round first: its features, then those of the rounds without one
    out = [[] for _ in prompts]
    k = drafter.config.block_size + 3
    for i in range(k):
        run = [True, i < 4, True]  # row 1 goes idle after 4 rounds
        logits = eng.verify(bonus[:, None], torch.zeros(len(prompts), 1, dtype=torch.long))
        eng.commit([range(1) if r else range(0) for r in run])
        for j, r in enumerate(run):
            if r:
                out[j].append(int(bonus[j]))
        bonus = torch.where(torch.tensor(run), logits[:, 0].argmax(-1), bonus)
    got = eng.draft(bonus).logits
    ref_eng = ENGINES[engine](tiny_target, drafter)
    full = [torch.cat([p, torch.tensor(o, dtype=torch.long)]) for p, o in zip(prompts, out)]
    ref_bonus = ref_eng.prefill(full, capacity=64).argmax(-1)
    assert ref_bonus.tolist() == bonus.tolist()
    torch.testing.assert_close(got, ref_eng.draft(ref_bonus).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_an_autoregressive_stream_keeps_no_growing_draft_context(tiny_target, engine):
    """An AR stream on an engine that holds a drafter (a server's engine): no draft reads its
    rounds' features, so the drafter's context must not grow by a position per step (each step
    copied all of it: time and memory growing with the answer)."""
    prompts = ragged_prompts(5)
    eng = ENGINES[engine](tiny_target, make_tiny_drafter(tiny_target))
    gens = generate_batch(eng, prompts, max_new_tokens=30, method="ar")
    assert [g.tokens for g in gens] == [greedy_reference(tiny_target, p, 30) for p in prompts]
    assert eng.pending.shape[1] == 1


@pytest.mark.parametrize("engine,full_only", [("hf", False), ("static", False), ("static", True)])
def test_cost_aware_rounds_without_a_draft_are_lossless(tiny_target, engine, full_only, monkeypatch):
    """Rounds that skip the draft, mixed with rounds that draft (here: drafting every third
    round), give the target's own greedy outputs; the skipped drafts are recorded as size 0.
    full_only: where only the full width pays (a GPU), rounds may be read a round late, as
    without cost-awareness."""
    from dflashkit.decode import cost

    calls = itertools.count()  # a draft every third round
    monkeypatch.setattr(cost.Drafting, "choose", lambda self: next(calls) % 3 == 0)
    if full_only:
        monkeypatch.setattr(cost.CostCurve, "candidates", lambda c: c.widths[-1:])
    drafter = make_tiny_drafter(tiny_target)
    prompts = ragged_prompts(7, (15, 9, 21))
    refs = [greedy_reference(tiny_target, p, 40) for p in prompts]
    for method, budget in [("dflash", None), ("ddtree", 12)]:
        calls = itertools.count()  # the pattern starts again for each method
        eng, drafts = ENGINES[engine](tiny_target, drafter), []
        draft = eng.draft
        eng.draft = lambda bonus, *a: drafts.append(1) or draft(bonus, *a)
        gens = generate_batch(eng, prompts, max_new_tokens=40, method=method, budget=budget, cost_aware=True)
        assert [g.tokens for g in gens] == refs, method
        rounds = max(g.rounds for g in gens)
        assert len(drafts) == (rounds + 2) // 3 and all(0 in g.draft_sizes for g in gens)


def test_drafting_pays_or_steps_aside():
    """Drafting goes on while τ · t_ar / t_draft >= 0.85, τ taken one standard error above its
    16-round mean; below, rounds skip the draft but the last four of every interval (16 rounds,
    doubling while drafting does not pay, up to 128), and drafting resumes by the same rule, judged
    on those four; a draft that took a long context first is not timed."""
    from dflashkit.decode.cost import Drafting

    def run(d: Drafting, n: int, tau: float, t_draft: float = 2.0) -> list[bool]:
        picks = []
        for _ in range(n):
            picks.append(d.choose())
            d.observe(picks[-1], t_draft if picks[-1] else 1.0, tau if picks[-1] else None)
        return picks

    d = Drafting()
    assert d.choose()  # nothing known: draft first
    d.observe(True, 60.0, 1.8, timed=False)  # the prompt's context (or a first graph capture)
    assert d.choose()
    d.observe(True, 2.0, 1.8)
    for _ in range(3):  # then measure rounds without a draft
        assert not d.choose()
        d.observe(False, 1.0, None)
    assert all(run(d, 20, 1.8))  # 0.9: below 1, but within the margin: drafting goes on
    for k in range(32):  # τ 1.0 and 2.3 in turn: a mean of 1.65 (0.825), but 1.82 (0.91) within its error
        assert d.choose()
        d.observe(True, 2.0, (1.0, 2.3)[k % 2])
    first = run(d, 48, 1.0)
    assert first[:3] == [True, True, True] and first[3:].count(True) <= 8  # τ fell: drafting stopped
    later = run(d, 400, 1.0)
    assert 8 <= later.count(True) <= 20 and d.interval == 128  # re-tries ever rarer
    assert all(run(d, 150, 3.0)[-20:])  # τ rose: the next re-try saw it, drafting resumed
    fresh = Drafting()  # τ 1.0 from the start: judged only once 16 draft rounds are known
    fresh.observe(fresh.choose(), 2.0, 1.0)
    run(fresh, 3, 1.0)  # the AR rounds
    picks = run(fresh, 20, 1.0)
    assert picks[:15] == [True] * 15 and not any(picks[15:])
