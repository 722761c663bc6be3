"""Batched decoding (`dflashkit.batch`) is lossless per row: each row of a ragged batch produces
exactly the tokens, τ per round and random draws of `decode.generate` of that prompt alone."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_drafter
from datahelpers import one_thread  # noqa: F401
from dflashkit import batch as batch_mod
from dflashkit.batch import BatchHFEngine, generate_batch, generate_batch_stream, pack
from dflashkit.decode import HFEngine, Sampling, chat_ids, generate
from test_decode import expected_taus, greedy_reference, oracle_proposals

pytestmark = pytest.mark.usefixtures("one_thread")


def one_by_one(target, drafter, prompts, method, **kw):
    return [generate(HFEngine(target, drafter if method != "ar" else None), p.reshape(1, -1), method=method, **kw)
            for p in prompts]


def test_pack_moves_each_rows_entries_to_its_length():
    x = torch.arange(2 * 7, dtype=torch.float).view(2, 1, 7, 1).clone()  # 5 held slots + 2 new per row
    out = pack(x, 5, torch.tensor([3, 5]), 7)  # row 0 keeps 1 new entry, row 1 both
    assert out.shape == (2, 1, 7, 1)
    assert out[0, 0, :4, 0].tolist() == [0, 1, 2, 5]  # row 0: its first new entry at slot 3
    assert out[1, 0, :, 0].tolist() == [7, 8, 9, 10, 11, 12, 13]  # the longest row stays in place


# ---- tiny random target: plumbing ---------------------------------------------------------------


def test_ragged_batch_equals_batch_one_tiny(tiny_target):
    """Ragged prompt lengths, per-row token limits (one of 1), a stop token that ends one row early:
    every row equals its batch-1 generation, and the stream yields exactly the rows still running."""
    drafter = make_tiny_drafter(tiny_target)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 120, (n,)) for n in (20, 7, 33, 12)]
    limits = [30, 1, 30, 25]
    ref0 = greedy_reference(tiny_target, prompts[0][None], 30)
    stop = next(t for i, t in enumerate(ref0) if 3 <= i and t not in ref0[:i])
    for method in ("ar", "dflash"):
        refs = [one_by_one(tiny_target, drafter, [p], method, max_new_tokens=n, stop_ids={stop})[0]
                for p, n in zip(prompts, limits)]
        seen: dict[int, list[int]] = {i: [] for i in range(4)}
        done: set[int] = set()
        for step in generate_batch_stream(tiny_target, drafter, prompts, method=method, max_new_tokens=limits,
                                          stop_ids={stop}):
            assert not done & {i for i, _, _ in step}, "a finished row was stepped again"
            for i, new, g in step:
                seen[i] += new
                assert g.tokens == seen[i]
                if g.finish_reason:
                    done.add(i)
        assert done == {0, 1, 2, 3}
        gens = generate_batch(tiny_target, drafter, prompts, method=method, max_new_tokens=limits, stop_ids={stop})
        for i, (g, r) in enumerate(zip(gens, refs)):
            assert g.tokens == r.tokens == seen[i], (method, i)
            assert g.accept_lengths == r.accept_lengths and g.finish_reason == r.finish_reason
        assert gens[0].finish_reason == "stop" and len(gens[0].tokens) < 30
        assert len(gens[1].tokens) == 1
        assert gens[2].finish_reason == "length" and len(gens[2].tokens) == 30


def sliding_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashkit.target import Target

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2,
                      sliding_window=5, use_sliding_window=True, max_window_layers=0, initializer_range=0.3)
    return Target(Qwen3ForCausalLM(cfg).float(), None)


def test_batch_engine_rounds_equal_batch_one_sliding():
    """Sliding layers in the target (window in the 4-D mask, by position) and in the drafter
    (window in its ragged layout): prefill, draft and verify logits of every row equal the batch-1
    engine's, also after a round that commits a different number of tokens per row."""
    target = sliding_target()
    drafter = make_tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    B = drafter.config.block_size
    prompts = [torch.randint(3, 120, (n,)) for n in (12, 4, 9)]
    batch, singles = BatchHFEngine(target, drafter), [HFEngine(target, drafter) for _ in prompts]
    close = dict(atol=1e-5, rtol=1e-5)
    logits = batch.prefill(prompts)
    for i, (p, e) in enumerate(zip(prompts, singles)):
        torch.testing.assert_close(logits[i:i + 1], e.prefill(p[None], capacity=64), **close)
    bonus = logits.argmax(-1)
    for counts in ([3, 1, 8], [2, 5, 1]):
        drafts = batch.draft(bonus)
        tokens = torch.cat([bonus[:, None], drafts.argmax(-1)], 1)  # [3, B]
        verified = batch.verify(tokens)
        for i, e in enumerate(singles):
            torch.testing.assert_close(drafts[i:i + 1], e.draft(bonus[i:i + 1]), **close)
            torch.testing.assert_close(verified[i:i + 1], e.verify(tokens[i:i + 1], torch.arange(B), None), **close)
            e.commit(list(range(counts[i])))
        batch.commit(torch.tensor(counts))
        assert batch.lengths.tolist() == [e.length for e in singles]
        bonus = torch.tensor([7, 8, 9])
    batch.keep_rows(torch.tensor([2, 0]))
    drafts = batch.draft(bonus[[2, 0]])
    for row, i in enumerate((2, 0)):
        torch.testing.assert_close(drafts[row:row + 1], singles[i].draft(bonus[i:i + 1]), **close)


def test_ragged_batch_sliding_window_generation():
    target = sliding_target()
    drafter = make_tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    prompts = [torch.randint(3, 120, (n,)) for n in (12, 4, 9)]
    for method in ("ar", "dflash"):
        gens = generate_batch(target, drafter, prompts, method=method, max_new_tokens=24)
        refs = one_by_one(target, drafter, prompts, method, max_new_tokens=24)
        assert [g.tokens for g in gens] == [r.tokens for r in refs], method


def test_ragged_multi_token_acceptance_tiny(tiny_target, monkeypatch):
    """Drafts right for the first n % B slots (n: the row's length), so rows accept different
    numbers of tokens in the same round: τ per row exactly as alone, tokens unchanged."""
    drafter = make_tiny_drafter(tiny_target)
    B, V, max_new = drafter.config.block_size, tiny_target.vocab_size, 40
    torch.manual_seed(3)
    prompts = [torch.randint(3, 120, (n,)) for n in (17, 22, 12)]  # n % B: 1, 6, 4
    seqs = [p.tolist() + greedy_reference(tiny_target, p[None], max_new + B) for p in prompts]

    class OracleBatch(BatchHFEngine):
        def prefill(self, prompts):
            self.ids = list(range(len(prompts)))  # prompt index of each batch row
            return super().prefill(prompts)

        def keep_rows(self, rows):
            self.ids = [self.ids[k] for k in rows.tolist()]
            super().keep_rows(rows)

        def draft(self, bonus):
            real = super().draft(bonus)
            return torch.cat([oracle_proposals(seqs[i], V, B, 1)(int(n)) for i, n in zip(self.ids, self.lengths)]).to(real)

    monkeypatch.setattr(batch_mod, "BatchHFEngine", OracleBatch)
    gens = generate_batch(tiny_target, drafter, prompts, method="dflash", max_new_tokens=max_new)
    for p, s, g in zip(prompts, seqs, gens):
        assert g.tokens == s[len(p):len(p) + max_new]
        assert g.accept_lengths == expected_taus(len(p), max_new, B, B - 1)
    assert len({tuple(g.accept_lengths) for g in gens}) == 3 and max(max(g.accept_lengths) for g in gens) > 3


def test_batch_rejects_ddtree_and_bad_requests(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    ids = [torch.tensor([5, 6, 7])]
    with pytest.raises(ValueError, match="DDTree is batch 1 only"):
        generate_batch(tiny_target, drafter, ids, method="ddtree", max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate_batch(tiny_target, None, ids, method="dflash", max_new_tokens=4)
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        generate_batch(tiny_target, drafter, ids, max_new_tokens=[4, 4])
    with pytest.raises(ValueError, match="non-empty"):
        generate_batch(tiny_target, drafter, [torch.tensor([], dtype=torch.long)], max_new_tokens=4)


# ---- the real testbed (SmolLM2 + the bundled trained drafter) ----------------------------------------


@pytest.fixture(scope="module")
def smol_batch(smollm2):
    from dflashkit.checkpoint import load_drafter
    from dflashkit.data.prompts import load_prompts
    from dflashkit.demo import bundled_drafter_dir

    drafter = load_drafter(bundled_drafter_dir(), smollm2, dtype=torch.float32)
    prompts = [chat_ids(smollm2.tokenizer, c.messages[0]["content"]) for c in load_prompts("humaneval", limit=4)]
    assert len({p.shape[1] for p in prompts}) == 4  # ragged
    return drafter, prompts


@pytest.mark.slow
def test_smollm2_batch_greedy_identical(smollm2, smol_batch):
    """4 HumanEval prompts in one batch, greedy DFlash and AR: each row equals the target's own
    greedy tokens and the batch-1 DFlash generation, with the same τ in every round."""
    drafter, prompts = smol_batch
    n = 20
    ref = [greedy_reference(smollm2, p, n) for p in prompts]
    alone = one_by_one(smollm2, drafter, prompts, "dflash", max_new_tokens=n)
    dflash = generate_batch(smollm2, drafter, prompts, method="dflash", max_new_tokens=n)
    ar = generate_batch(smollm2, None, prompts, method="ar", max_new_tokens=n)
    for i in range(len(prompts)):
        assert dflash[i].tokens == alone[i].tokens == ar[i].tokens == ref[i], i
        assert dflash[i].accept_lengths == alone[i].accept_lengths, i
        assert ar[i].accept_lengths == [1] * (n - 1)
    assert len({tuple(g.accept_lengths) for g in dflash}) > 1 and min(g.tau for g in dflash) > 1.5


@pytest.mark.slow
def test_smollm2_batch_sampling_per_row_seeded(smollm2, smol_batch):
    """temperature 0.7, top_p 0.8: a row's draws equal its batch-1 draws with the same seed (so
    they follow the target's own distribution), reruns reproduce, another seed changes the row,
    and every emitted token lies in the target's top-p nucleus at its position."""
    drafter, prompts = smol_batch
    prompts, n, temp, top_p = prompts[:3], 12, 0.7, 0.8
    samp = [Sampling(temp, top_p, seed=s) for s in (11, 12, 13)]
    a = generate_batch(smollm2, drafter, prompts, method="dflash", max_new_tokens=n, sampling=samp)
    for p, s, g in zip(prompts, samp, a):
        assert g.tokens == generate(HFEngine(smollm2, drafter), p, method="dflash", max_new_tokens=n, sampling=s).tokens
    # another batch (other rows, other order, another seed for one row): the seeded rows reproduce
    b = generate_batch(smollm2, drafter, [prompts[2], prompts[0]], method="dflash", max_new_tokens=n,
                       sampling=[samp[2], Sampling(temp, top_p, seed=99)])
    assert b[0].tokens == a[2].tokens and b[1].tokens != a[0].tokens
    assert sum(sum(g.accept_lengths) - g.rounds for g in a) > 0, "drafts must be accepted under sampling too"
    for p, g in zip(prompts, a):
        seq = torch.cat([p, torch.tensor([g.tokens])], 1)
        probs = torch.softmax(smollm2.model(seq).logits[0, p.shape[1] - 1:-1] / temp, -1)  # [n, V]
        sp, order = probs.sort(-1, descending=True)
        rank = (order == torch.tensor(g.tokens)[:, None]).float().argmax(-1)
        mass_before = (sp.cumsum(-1) - sp).gather(1, rank[:, None])[:, 0]
        assert (mass_before < top_p + 1e-4).all(), "a token outside the top-p nucleus"
