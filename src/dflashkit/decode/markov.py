"""DSpark's drafts: each slot's distribution follows the token drafted before it.

A DSpark drafter's slot s has unary logits (the target's LM head on its hidden state) plus the
Markov head's bias from the token before it, W2 u(prev, hidden, state) (`family.MarkovHead.step`;
`rnn` carries a state along the block). Its greedy chain is the sequential argmax (each slot's
argmax after the token chosen before it); its tree is a beam over prefixes, each prefix's
children from its own biased conditional (`rnn`: its own state), the best `budget` prefixes of
all depths as DDTree keeps them (`tree.selected`). With a confidence head, a node's score is the
expected acceptance of its path: the cumulative product of the confidences along it (a child
other than its parent's most likely scaled by its probability against the most likely's), which
cost-aware drafting (`cost.tree_expectation`) reads as the chance that the target accepts the
path. Without one (or on an engine built to leave it out, `Engine`'s confidence), scores are the
drafter's summed log-probabilities, as DDTree's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.decode.tree import Lattice, Trees, candidates, chains, selected


class MarkovDraft(NamedTuple):
    """A DSpark drafter's draft of b blocks of S drafting slots, before any token is chosen."""

    unary: Tensor  # [b, S, V] the drafting slots' logits without the Markov bias
    hidden: Tensor  # [b, S, H] their hidden states
    first: Tensor  # [b] the token before the first drafting slot (the bonus)
    markov: Any  # family.MarkovHead, or None
    confidence: Any  # family.ConfidenceHead, or None
    with_markov: bool  # the confidence head reads the Markov embedding of the token before
    state: Tensor | None = None  # [b, 1, r] `rnn`'s state entering the first drafting slot (None: zero)

    @classmethod
    def of(cls, drafter: Any, unary: Tensor, block: Tensor, first: Tensor, confidence: bool = True
           ) -> MarkovDraft | None:
        """A DSpark drafter's draft from its pass: unary logits [b, S, V] of the drafting slots,
        block [b, S or S + 1, H] the hidden states of every slot of the block (None for the other
        kinds). Bonus-first, an `rnn` head's state passes through slot 0 (after the bonus), as
        training carries it along the whole block (`MarkovHead.block_inputs`). confidence False:
        the draft leaves the confidence head out and is scored by its probabilities, as the other
        kinds' (a benchmark's baseline for the head's scores, `Engine`)."""
        if drafter.config.kind != "dspark":
            return None
        cfg, markov = drafter.config, drafter.markov()
        lead = cfg.draft_slots.start
        state = None
        if lead and markov is not None and markov.kind == "rnn":
            state = markov.step(markov.embed(first[:, None]), block[:, :lead], None)[1]
        head = drafter.confidence() if confidence else None
        return cls(unary, block[:, lead:], first, markov, head, cfg.confidence_head_with_markov, state)


def conditionals(draft: MarkovDraft, s: int, prev: Tensor, state: Tensor | None
                 ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Slot s after each of W prefixes, prev [b, W] their last tokens, state [b, W, r] (`rnn`; None
    at slot 0) -> (biased logits [b, W, V], the Markov embedding of prev [b, W, r], the state after)."""
    b, W = prev.shape
    unary = draft.unary[:, s, None]  # [b, 1, V]
    if draft.markov is None:
        return unary.expand(-1, W, -1), None, None
    emb = draft.markov.embed(prev)
    u, state = draft.markov.step(emb, draft.hidden[:, s, None].expand(-1, W, -1), state)
    return unary + draft.markov.bias(u).to(unary.dtype), emb, state


def log_confidence(draft: MarkovDraft, s: int, emb: Tensor | None, W: int) -> Tensor | None:
    """log sigmoid of the confidence head at slot s after each of W prefixes [b, W]; None without a head."""
    if draft.confidence is None:
        return None
    h = draft.hidden[:, s, None].expand(-1, W, -1)
    features = torch.cat([h, emb.to(h.dtype)], -1) if draft.with_markov else h
    return F.logsigmoid(draft.confidence(features).float())


def markov_chain(draft: MarkovDraft) -> Trees:
    """The greedy chain: slot s's argmax of its biased logits after the token chosen at s - 1
    (the bonus before slot 0), scored by the confidences' (else the log-probabilities') running sums."""
    prev, state = draft.first[:, None], draft.state
    tokens, scores = [], []
    for s in range(draft.unary.shape[1]):
        logits, emb, state = conditionals(draft, s, prev, state)
        logits = logits.float()
        best, prev = logits.max(-1)  # [b, 1]
        conf = log_confidence(draft, s, emb, 1)  # with a head, no log-normaliser over the vocabulary
        tokens.append(prev)
        scores.append(best - torch.logsumexp(logits, -1) if conf is None else conf)
    return chains(torch.cat(tokens, 1), torch.cat(scores, 1).cumsum(1))


def markov_trees(draft: MarkovDraft, budget: int | None, top_k: int | None) -> Trees:
    """Each row's tree: budget None, the chain (`markov_chain`); else `markov_tree`."""
    return markov_chain(draft) if budget is None else markov_tree(draft, budget, top_k)


def markov_tree(draft: MarkovDraft, budget: int, top_k: int | None) -> Trees:
    """DDTree over the biased conditionals: a beam of width `budget` over prefixes, each prefix's
    top-`top_k` children (None: `budget`) from its own conditional (its last token, its `rnn`
    state), prefixes ranked by summed log-probabilities; the best `budget` of all depths kept."""
    b, S, V = draft.unary.shape
    K = candidates(budget, top_k, V)
    beam = draft.unary.new_zeros(b, 1, dtype=torch.float32)  # log-probability of each beam prefix
    reach = torch.zeros_like(beam)  # its expected acceptance (log), with a confidence head
    last, state, base = draft.first[:, None], draft.state, 0
    ranks, parents, tokens, depths, expect = [], [], [], [], []
    for s in range(S):
        W = beam.shape[1]
        logits, emb, after = conditionals(draft, s, last, state)
        logits = logits.float()  # (top-K less the log-normaliser: no second [b, W, V] buffer)
        lp, ids = logits.topk(K, dim=-1)  # [b, W, K]
        lp = lp - torch.logsumexp(logits, -1, keepdim=True)
        beam, idx = (beam[..., None] + lp).flatten(1).topk(min(budget, W * K), dim=1)
        w = idx // K
        last = ids.flatten(1).gather(1, idx)
        conf = log_confidence(draft, s, emb, W)
        if conf is not None:  # the most likely child accepted with the confidence, the others scaled down
            reach = reach.gather(1, w) + conf.gather(1, w) + (lp - lp[..., :1]).flatten(1).gather(1, idx)
            expect.append(reach)
        state = None if after is None else after.gather(1, w[..., None].expand(-1, -1, after.shape[-1]))
        ranks.append(beam)
        parents.append(base + w)
        tokens.append(last)
        depths.append(torch.full_like(idx, s + 1))
        base += W  # the new beam is numbered after the one it extends
    cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
    return selected(cat(ranks), cat(parents), cat(tokens), cat(depths), budget, cat(expect) if expect else None)


def kind_draft(drafter: Any, block: Tensor, logits: Tensor, roots: Tensor, confidence: bool = True
               ) -> Lattice | MarkovDraft | None:
    """What a drafter of the family drafts from beside its unary logits [b, S, V], by kind: DSpark's
    Markov draft, DFlash 2's lattice, nothing for DFlash. block [b, B', H]: the pass's hidden states
    of every slot; roots [b]: each block's first token (the bonus); confidence: whether a
    confidence head scores the Markov draft (`MarkovDraft.of`). The decoding engine's draft step
    and offline evaluation both take it from here."""
    spark = MarkovDraft.of(drafter, logits, block, roots, confidence)
    if spark is not None:
        return spark
    selector = drafter.selector()
    hidden = block[:, drafter.config.draft_slots.start:]
    return None if selector is None else Lattice(*selector.lattice(hidden, logits, roots))
