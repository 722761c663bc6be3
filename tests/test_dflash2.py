"""DFlash 2 decoding: the selector's lattice, its greedy walk and best-first tree, lossless greedy
decoding over it on every engine, and offline evaluation that agrees with online decoding."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_tiny_family, make_tiny_target, node_paths, rows_decode_as_alone
from datahelpers import one_thread  # noqa: F401
from test_decode import ENGINES, Oracle, expected_taus, greedy_reference, ragged_prompts
from test_evaluate import LABELS, _greedy_data, _train
from dflashkit.data.features import FeatureSample
from dflashkit.decode.engine import Draft, Engine
from dflashkit.decode.loop import generate, generate_batch
from dflashkit.decode.tree import Lattice, draft_trees, drafted, lattice_tree, lattice_walk
from dflashkit.evaluate import draft_spans, drafted_blocks, offline_accepted, replay_rounds

pytestmark = pytest.mark.usefixtures("one_thread")


def random_lattice(b: int, S: int, K: int, V: int = 50, seed: int = 0) -> Lattice:
    """b lattices of S slots of K distinct candidates, slot 0's rows alike (they follow the bonus)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(b * S)]).view(b, S, K)
    logprobs = torch.log_softmax(2 * torch.randn(b, S, K, K, generator=g), -1)
    logprobs[:, 0] = logprobs[:, 0, :1]
    return Lattice(tokens, logprobs)


def test_the_walk_is_the_greedy_path_through_the_lattice():
    """`lattice_walk` against a plain loop: from the bonus (row 0), each slot's most likely
    candidate in the row of the candidate chosen before; scored by its cumulative log-probs. The
    tree of one candidate per row and a budget of S nodes is the same chain."""
    lat = random_lattice(4, 6, 5)
    walked = lattice_walk(lat)
    for r in range(4):
        row, tokens, score, scores = 0, [], 0.0, []
        for s in range(6):
            k = int(lat.logprobs[r, s, row].argmax())
            score += float(lat.logprobs[r, s, row, k])
            tokens.append(int(lat.tokens[r, s, k]))
            scores.append(score)
            row = k
        assert walked.tokens[r].tolist() == tokens
        torch.testing.assert_close(walked.scores[r], torch.tensor(scores))
    assert walked.parents[0].tolist() == list(range(6)) and walked.depths[0].tolist() == list(range(1, 7))
    tree = lattice_tree(lat, 6, 1)
    assert all(torch.equal(a, b) for a, b in zip(tree[:3], walked[:3]))
    torch.testing.assert_close(tree.scores, walked.scores)
    assert torch.equal(drafted(torch.zeros(4, 6, 50), None, None, True, lat).tokens, walked.tokens)


@pytest.mark.parametrize("S,K,budget,top_k", [(4, 3, 17, None), (3, 4, 9, 2), (5, 2, 40, None)])
def test_lattice_tree_holds_the_best_paths(S, K, budget, top_k):
    """`lattice_tree`'s nodes are the best `budget` paths through the lattice by summed
    log-probability (each choice from the row of the choice before, among that row's top_k),
    in best-first order, ties to the shallower: brute force over every path."""
    lat = random_lattice(3, S, K, seed=S * K)
    lat.logprobs[1, 1, :, 0] = 0.0  # a slot the selector is sure of: a child scores as its parent (a tie)
    trees = lattice_tree(lat, budget, top_k)
    keep = K if top_k is None else min(top_k, K)
    for r in range(3):
        scored = []
        for d in range(1, S + 1):
            for ranks in itertools.product(range(K), repeat=d):
                rows = (0,) + ranks[:-1]
                lp = [lat.logprobs[r, s, rows[s]] for s in range(d)]
                if any(int((lp[s] > lp[s][k]).sum()) >= keep for s, k in enumerate(ranks)):
                    continue  # not among its row's top_k
                scored.append((sum(float(lp[s][k]) for s, k in enumerate(ranks)), -d,
                               tuple(int(lat.tokens[r, s, k]) for s, k in enumerate(ranks))))
        best = sorted(scored, reverse=True)[:budget]
        assert node_paths(trees, r) == [p for _, _, p in best]
        assert all(p < i for i, p in enumerate(trees.parents[r].tolist(), start=1))
        torch.testing.assert_close(trees.scores[r], torch.tensor([s for s, _, _ in best]))


def test_the_selector_builds_the_lattice_training_scores(tiny_target):
    """`CandidateSelector.lattice`: each slot's candidates are the unary top-K; row p of slot s is
    the K-way distribution over them that training's scores give with candidate p of slot s-1 as
    the token before (the bonus for slot 0, every row alike)."""
    drafter = make_tiny_family(tiny_target, "dflash2")
    sel, K = drafter.selector(), drafter.config.selector_top_k
    g = torch.Generator().manual_seed(0)
    hidden, unary, bonus = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 128, generator=g), torch.tensor([7, 9])
    cand, logprobs = sel.lattice(hidden, unary, bonus)
    assert torch.equal(cand, unary.topk(K, -1).indices) and logprobs.shape == (2, 5, K, K)
    for r, s, p in itertools.product(range(2), range(5), range(K)):
        pred = bonus[r] if s == 0 else cand[r, s - 1, p]
        want = torch.log_softmax(sel.scores(unary[r, s, cand[r, s]], hidden[r, s], pred[None], cand[r, s])[0], -1)
        torch.testing.assert_close(logprobs[r, s, p], want)


DFLASH2_METHODS = [("dflash", None), ("ddtree", 6), ("ddtree", 30)]


@pytest.mark.parametrize("engine", ["hf", "static", "padded"])
def test_dflash2_greedy_equals_autoregressive(tiny_target, engine):
    """A DFlash 2 drafter (every module random) decodes its walk and its lattice trees: the
    tokens are the target's own greedy tokens, alone and in a ragged batch cost-aware (which
    reads the walk's and the trees' scores)."""
    drafter = make_tiny_family(tiny_target, "dflash2")
    prompts = ragged_prompts(1, (20, 7, 33))
    refs = [greedy_reference(tiny_target, p, 20) for p in prompts]
    for method, budget in DFLASH2_METHODS:
        g = generate(ENGINES[engine](tiny_target, drafter), prompts[0], max_new_tokens=20, method=method, budget=budget)
        assert g.tokens == refs[0], (method, budget)
        gens = generate_batch(ENGINES[engine](tiny_target, drafter), prompts, max_new_tokens=20, method=method,
                              budget=budget, cost_aware=True)
        assert [g.tokens for g in gens] == refs, (method, budget)


@pytest.mark.parametrize("engine", ["hf", "static"])
@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 6)])
def test_dflash2_rejection_rows_decode_as_alone(engine, method, budget):
    """The rejection rule through the engine with a DFlash 2 drafter (`Rejection.draft` over the
    lattice, `Steps.sample_lattice`): in a batch of a greedy row and a sampled row, each row's
    tokens and τ per round equal its own decoded alone, and the greedy row's are the target's."""
    target = make_tiny_target(num_layers=2, hidden=32, vocab=64, seed=4)
    drafter = make_tiny_family(target, "dflash2", num_layers=1, num_taps=1, block_size=4)
    batch = rows_decode_as_alone(lambda: ENGINES[engine](target, drafter), method, budget)
    assert batch[0].tokens == greedy_reference(target, torch.tensor([[5, 9, 11, 3]]), 12)


def oracle_lattice(seq: list[int], V: int, B: int, runner_up: bool):
    """`Oracle`'s proposals as a lattice of 4 candidates per slot: at position n, slots k <= j
    (j = n % B) hold the reference token (candidate 1, behind a wrong one in the unary order),
    and the row of the reference token before (slot 1: the bonus's) ranks it first, or
    (runner_up) second; every other row ranks it below two wrong ones. Past j no candidate is
    right. A walk or tree that took its rows from the unary order, or from the wrong
    predecessor, would accept nothing."""
    right_row = torch.tensor([4.9, 5.0, 0.0, 0.0]) if not runner_up else torch.tensor([5.0, 4.9, 0.0, 0.0])
    wrong_row = torch.tensor([5.0, 0.0, 4.9, 0.0])

    def propose(n: int) -> Lattice:
        tokens, rows = torch.zeros(1, B - 1, 4, dtype=torch.long), torch.zeros(1, B - 1, 4, 4)
        for k in range(1, B):
            right = seq[n + k] if n + k < len(seq) else 0
            ok = k <= n % B
            tokens[0, k - 1] = torch.tensor([right + 1, right if ok else right + 4, right + 2, right + 3]) % V
            rows[0, k - 1] = wrong_row if ok else right_row
            rows[0, k - 1, 1 if k > 1 else slice(None)] = right_row
        return Lattice(tokens, torch.log_softmax(rows, -1))
    return propose


class LatticeOracle(Oracle):
    """An engine whose DFlash 2 lattice is replaced, for the row of prompt i, by
    `proposers[i](length)` (the real drafter still runs, its cache in step with the target's)."""

    def draft(self, bonus, budget=None, top_k=4, scored=False):
        real = self.engine.draft(bonus)
        lats = [self.proposers[r](n) for r, n in zip(self.rows, self.engine.cache.lengths_t.tolist())]
        lat = Lattice(*(torch.cat(x) for x in zip(*lats)))
        return Draft(real.logits, *draft_trees(real.logits, bonus, budget, top_k, scored, lat), lat)


@pytest.mark.parametrize("engine", ["hf", "static"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_dflash2_multi_token_acceptance_through_the_lattice(tiny_target, engine, method):
    """Lattices right for the first j slots along their rows only (`oracle_lattice`): the walk
    accepts exactly j tokens a round; the tree (the reference token second in its row, top-2 per
    row, 30 nodes: every path to depth 4) accepts min(j, 4) through non-contiguous nodes; the
    output is the target's, for each row of a ragged batch."""
    drafter = make_tiny_family(tiny_target, "dflash2")
    B, V, max_new = drafter.config.block_size, tiny_target.vocab_size, 40
    prompts = ragged_prompts(3, (17, 9, 22))
    seqs = [p[0].tolist() + greedy_reference(tiny_target, p, max_new + B) for p in prompts]
    runner_up, budget, cap = (False, None, B - 1) if method == "dflash" else (True, 30, 4)
    eng = LatticeOracle(ENGINES[engine](tiny_target, drafter), *[oracle_lattice(s, V, B, runner_up) for s in seqs])
    gens = generate_batch(eng, prompts, max_new_tokens=max_new, method=method, budget=budget, top_k=2)
    for p, s, g in zip(prompts, seqs, gens):
        T = p.shape[1]
        assert g.tokens == s[T:T + max_new]
        assert g.accept_lengths == expected_taus(T, max_new, B, cap)


def test_offline_tau_equals_online_for_dflash2():
    """A trained DFlash 2 drafter (its selector's transitions scaled up so that its walk leaves the
    unary argmax): the rounds replayed from cached features are exactly the online greedy rounds,
    for its walk and its lattice trees (offline evaluation builds the same lattice from the
    training path's hidden states)."""
    target = make_tiny_target()
    data = _greedy_data(target, 2)
    drafter = make_tiny_family(target, "dflash2")
    with torch.no_grad():
        for p in drafter.selector().parameters():
            p.mul_(3.0)
    drafter = _train(drafter, target, data, steps=60)
    items = [FeatureSample(sid, seq, mask, target.forward(seq[None], drafter.config.target_layer_ids).features[0])
             for sid, _, seq, mask in data]
    taus = []
    for (sid, ids, seq, mask), item in zip(data, items):
        acc, spans = offline_accepted(drafter, target, item, LABELS, top_k=None)
        for label, method, budget in LABELS:
            online = generate(Engine(target, drafter), ids, max_new_tokens=40, method=method, budget=budget)
            assert online.tokens == seq[12:].tolist()
            assert replay_rounds(acc[label], spans)[0] == online.accept_lengths, (sid, label)
            taus.append(online.tau)
    assert max(taus) > 2
    _, logits, lattice, _, _ = next(drafted_blocks(drafter, target, items[0], draft_spans(items[0].loss_mask)))
    assert (lattice_walk(lattice).tokens != logits.argmax(-1)).any()  # the selector decides some tokens
