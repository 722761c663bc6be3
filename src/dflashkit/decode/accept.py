"""Speculative sampling with the drafter's own probabilities: the 'rejection' acceptance rule.

The 'match' rule (`tree.walk`) accepts a drafted token when it equals the target's own sample:
per slot, the chance is p(x̂), the target's probability of the drafter's one token. The
'rejection' rule draws the draft from the drafter's distribution q instead and accepts x with
probability min(1, p(x)/q(x)), drawing from norm(max(0, p − q)) on a rejection: per slot, the
chance is 1 − TV(p, q), and the output is still exactly the target's distribution
(docs/conventions.md proves it for chains and trees).

  chains (DFlash)  each slot's token is a sample of that slot's q; a block is drafted in one
                   pass, so q does not depend on the tokens drawn before it and the rule applies
                   slot by slot along the accepted prefix; after a fully accepted block the bonus
                   token comes from p.
  trees (DDTree)   the match rule's tree (a function of the drafter's logits alone); at each
                   node, the first child is a draw of its slot's q, accepted with min(1, p/q);
                   the other children are the next likeliest tokens of q, each a proposal of one
                   token (a point mass), which recursive rejection sampling accepts when a draw
                   of the residual norm(max(0, p − q)) is that token. A chain is the tree whose
                   nodes have one child each: the same rule.
  DFlash 2         the same, with each node's q its own: the selector's conditional after the
                   node's token, over the next slot's candidates (`lattice_tokens`); a chain
                   is drawn slot by slot, each slot from the row of the draw before.
  DSpark           the same, each node's q the Markov-biased conditional after its own path
                   (`markov_tokens`, over the whole vocabulary; eager on a graph engine: its q
                   comes from the drafter's Markov head, node by node).

Every node's outcome (`picked_tokens`) is computed at once, then `tree.walk` follows them: no
loop over depths and no host read. The two steps are about 140 small kernels a round; an engine
with CUDA graphs replays each from one (`Steps`, `static.static_engine`).

p and q are both the request's temperature- and top-p-adjusted distributions
(`generation.distribution`). Greedy rows are not for this module: at temperature 0 the match
rule is the exact one. Every draw of a row comes from one 63-bit seed per round, taken from the
row's own stream (`round_seeds`), through a counter-based hash: a row draws the same whatever
else the batch holds, and a round needs one host draw per row, not one per token. A round's
uniforms are hashed in one pass (the hash's kernels are a third of the rule's): each slot's
draft draw, then each node's acceptance test and residual draw. The seeds and settings reach
the device without waiting for it (`cache.to_device`), so that the host queues the next round
while this one runs, as under the match rule.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from dflashkit.decode.cache import to_device
from dflashkit.decode.generation import Sampling, distribution, draw
from dflashkit.decode.markov import MarkovDraft, conditionals
from dflashkit.decode.tree import Lattice, Trees, Walk, walk
from dflashkit.method import Method

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_ROUND = 1  # the stream of a round's uniforms under its seed


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 (torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: Tensor) -> Tensor:
    """SplitMix64's finaliser (int64 arithmetic wraps, as the generator's does in uint64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniforms(seeds: Tensor, stream: int, shape: Sequence[int]) -> Tensor:
    """seeds [b] (int64) -> [b, *shape] float64 uniforms in (0, 1): the draws numbered 0.. of
    `stream` under each row's seed, a pure function of (seed, stream, number)."""
    n = 1
    for s in shape:
        n *= s
    key = _mix(seeds * _GOLDEN + stream)  # [b]
    count = torch.arange(1, n + 1, device=seeds.device, dtype=torch.long)
    bits = _shr(_mix(key[:, None] + count[None, :] * _GOLDEN), 11)  # 53 bits
    return ((bits.double() + 0.5) / 2.0**53).view(-1, *shape)


def round_seeds(gens: Sequence[random.Random | None], device: torch.device) -> Tensor:
    """One seed per row for a round's draws, from each row's own stream (0 where it has none)."""
    return to_device([g.getrandbits(63) if g is not None else 0 for g in gens], device)


class Settings(NamedTuple):
    """Each row's sampling settings, ready to broadcast over a vocabulary: temperature [b, 1];
    top_p [b, 1], or 1.0 where no row cuts (no sort). Rows that do not sample get temperature 1
    (their results are not used)."""

    temperature: Tensor
    top_p: Tensor | float

    @classmethod
    def of(cls, samplings: Sequence[Sampling], device: torch.device) -> Settings:
        t = to_device([s.temperature if s.temperature > 0 else 1.0 for s in samplings], device, torch.float32)[:, None]
        if all(s.top_p == 1 for s in samplings):
            return cls(t, 1.0)
        return cls(t, to_device([s.top_p for s in samplings], device, torch.float32)[:, None])

    def rows(self, *lead: int) -> Settings:
        """The settings broadcast over `lead` more dimensions ([b, 1, ..., 1])."""
        shape = (-1, *(1,) * len(lead), 1)
        return Settings(self.temperature.view(shape), self.top_p.view(shape) if isinstance(self.top_p, Tensor) else 1.0)


def sibling_rank(parents: Tensor) -> Tensor:
    """parents [b, m] -> [b, m]: how many earlier nodes share each node's parent (its place
    among its siblings, in node order)."""
    m = parents.shape[1]
    same = parents[:, :, None] == parents[:, None, :]  # [b, i, j]
    earlier = torch.ones(m, m, dtype=torch.bool, device=parents.device).tril(-1)
    return (same & earlier).sum(-1)


def _children(trees: Trees) -> tuple[Tensor, Tensor]:
    """-> (real [b, m]: the node is not padding (which is its own parent), count [b, m+1]: each
    node's children)."""
    b, m = trees.tokens.shape
    real = trees.parents < torch.arange(1, m + 1, device=trees.parents.device)
    count = torch.zeros(b, m + 1, dtype=torch.long, device=real.device).scatter_add_(1, trees.parents, real.long())
    return real, count


class Drawn(NamedTuple):
    """What `sampled_tokens` draws beside the tokens, for `picked_tokens`: the drafter's adjusted
    distributions q [b, S, V], one draw of each slot's q [b, S], and each node's two uniforms
    [b, 2, m+1] (its acceptance test, its residual draw; node 0 is the bonus). per_node
    (`lattice_tokens`): q [b, m+1, V] and the draws [b, m+1] are each node's, for its children."""

    q: Tensor
    drawn: Tensor
    u: Tensor
    per_node: bool = False


def sampled_tokens(dlogits: Tensor, shape: Trees, settings: Settings, seeds: Tensor) -> tuple[Tensor, Drawn]:
    """The drafter's logits [b, S, V] and the trees the match rule drafts from them (`shape`:
    `tree.draft_trees`) -> (the rejection rule's tokens for the same nodes [b, m], `Drawn`).
    Every node with children has its slot's draw among them: as the match rule's child where
    that is the draw (most often its first, the drafter's argmax), else in place of its last
    child (the least likely, with the smallest subtree). A chain's nodes are the draws. The shape
    is a function of the drafter's logits alone, as the proof needs, and the match rule's own: as
    bushy where the drafter is unsure, whatever the temperature."""
    b, S, V = dlogits.shape
    m = shape.tokens.shape[1]
    u = uniforms(seeds, _ROUND, (S + 2 * (m + 1),))
    q = distribution(dlogits, *settings.rows(S))
    drawn = draw(q.flatten(0, 1), u[:, :S].flatten()).view(b, S)
    return _placed(shape, drawn.gather(1, shape.depths - 1)), Drawn(q, drawn, u[:, S:].view(b, 2, m + 1))


def _placed(shape: Trees, own: Tensor) -> Tensor:
    """The tokens [b, m] of `shape` with the draw at each node's parent (own [b, m]) among that
    parent's children: where no child is the draw, it takes the last child's place."""
    real, count = _children(shape)
    has = torch.zeros_like(count).scatter_reduce_(1, shape.parents, ((shape.tokens == own) & real).long(), "amax")
    last = real & (sibling_rank(shape.parents) == count.gather(1, shape.parents) - 1)
    return torch.where(last & (has.gather(1, shape.parents) == 0), own, shape.tokens)


def lattice_tokens(lattice: Lattice, shape: Trees, settings: Settings, seeds: Tensor,
                   vocab: int) -> tuple[Tensor, Drawn]:
    """`sampled_tokens` for a DFlash 2 draft: its lattice (candidates [b, S, K], log-probs
    [b, S, K, K]) and the trees the match rule drafts from it (`tree.draft_trees`) -> (the
    rejection rule's tokens [b, m], `Drawn` per node, q over a vocabulary of `vocab`). A node's
    q is the selector's conditional after its own token (the root's: after the bonus) over the
    next slot's candidates; each (slot, row) is drawn once, and a node takes its row's draw,
    placed among its children as `sampled_tokens` places a slot's. A node's row is its token's,
    which may be its parent's draw: the tokens settle depth by depth, one pass each. Nodes of one
    depth that share a row share its draw; at most one of them is on any path (docs/conventions.md)."""
    cands, logprobs = lattice
    b, S, K = cands.shape
    m = shape.size
    u = uniforms(seeds, _ROUND, (S * K + 2 * (m + 1),))
    q = distribution(logprobs, *settings.rows(S, K))  # [b, S, K, K]
    drawn = cands.gather(2, draw(q.flatten(0, 2), u[:, :S * K].flatten()).view(b, S, K))  # each row's draw [b, S, K]
    depth = torch.cat([shape.depths.new_zeros(b, 1), shape.depths], 1)  # [b, m+1]
    mine = cands.gather(1, (depth - 1).clamp(min=0)[..., None].expand(-1, -1, K))  # each node's own slot's candidates
    slot = depth.clamp(max=S - 1)  # the slot of each node's children

    def rows(tokens: Tensor) -> Tensor:  # [b, m+1]: each node's (slot, row) in q's rows (the root: row 0)
        nodes = torch.cat([tokens.new_full((b, 1), -1), tokens], 1)
        return slot * K + (mine == nodes[..., None]).long().argmax(-1)

    at, tokens = rows(shape.tokens), shape.tokens
    for _ in range(min(S, m)):  # after pass d, the tokens to depth d are final
        tokens = _placed(shape, drawn.flatten(1).gather(1, at).gather(1, shape.parents))
        at = rows(tokens)
    qn = q.flatten(1, 2).gather(1, at[..., None].expand(-1, -1, K))  # [b, m+1, K]
    kids = cands.gather(1, slot[..., None].expand(-1, -1, K))  # the candidates of each node's children
    dense = qn.new_zeros(b, m + 1, vocab).scatter_(2, kids, qn)
    return tokens, Drawn(dense, drawn.flatten(1).gather(1, at), u[:, S * K:].view(b, 2, m + 1), True)


def markov_tokens(spark: MarkovDraft, shape: Trees, settings: Settings, seeds: Tensor) -> tuple[Tensor, Drawn]:
    """`sampled_tokens` for a DSpark draft (`decode.markov`) and the trees the match rule drafts
    from it -> (the rejection rule's tokens [b, m], `Drawn` per node). A node's q is the
    Markov-biased conditional after its own path (its token, its `rnn` state), for its children;
    its draw is placed among its children as `sampled_tokens` places a slot's. A node's q follows
    its token, which may be its parent's draw: depth by depth, one pass each."""
    b, m = shape.tokens.shape
    S, V = spark.unary.shape[1:]
    u = uniforms(seeds, _ROUND, (3 * (m + 1),))
    depth = torch.cat([shape.depths.new_zeros(b, 1), shape.depths], 1)  # [b, m+1]
    parents = torch.cat([shape.parents.new_zeros(b, 1), shape.parents], 1)
    tokens, q = shape.tokens, spark.unary.new_zeros(b, m + 1, V, dtype=torch.float32)
    drawn, state = depth.new_zeros(b, m + 1), None if spark.state is None else spark.state.expand(-1, m + 1, -1)
    for d in range(S):  # the nodes of depth d have their final tokens: their draws settle depth d + 1
        level = (depth == d)[..., None]
        nodes = torch.cat([spark.first[:, None], tokens], 1)
        before = None if state is None else state.gather(1, parents[..., None].expand(-1, -1, state.shape[-1]))
        logits, _, after = conditionals(spark, d, nodes, before)
        qd = distribution(logits, *settings.rows(m + 1))  # [b, m+1, V]
        q = torch.where(level, qd, q)
        drawn = torch.where(level[..., 0], draw(qd.flatten(0, 1), u[:, :m + 1].flatten()).view(b, m + 1), drawn)
        state = None if after is None else after if state is None else torch.where(level, after, state)
        tokens = _placed(shape, drawn.gather(1, shape.parents))
    return tokens, Drawn(q, drawn, u[:, m + 1:].view(b, 2, m + 1), True)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """What is drawn on a rejection: norm(max(0, p − q)) over the last dimension (p where the
    difference vanishes: p and q equal up to rounding, where a rejection is itself rounding)."""
    r = (p - q).clamp_(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Accept a draw x of q with probability min(1, p(x)/q(x)): u < p/q (u < 1 caps the ratio)."""
    return u * q_x < p_x


def expected_acceptance(p: Tensor, q: Tensor) -> Tensor:
    """The chance that a slot accepts: Σ_x q(x)·min(1, p(x)/q(x)) = Σ_x min(p(x), q(x))."""
    return torch.minimum(p, q).sum(-1)


def picked_tokens(trees: Trees, drawn: Drawn, logits: Tensor, settings: Settings) -> Tensor:
    """The rejection rule at every node at once -> the target's token at each node [b, m+1],
    for `tree.walk` to follow (a child is on the path when its token is the one picked at its
    parent): the slot's draw of q (`sampled_tokens`, a child of every node with children) where
    `accepts` takes it, else a draw of `residual(p, q)`; the node's other children are
    proposals of one token each, so that this draw picks one of them with the chance the rule
    gives it. A node without a child draws from p (the bonus after a fully accepted path).
    drawn: `sampled_tokens`' (for these trees, or the trees of which these are a prefix); logits
    [b, m+1, V]: the target's at the bonus and every node. Every node draws from uniforms of its
    own number: one pass, no loop over depths."""
    b, m = trees.tokens.shape
    q, u = drawn.q, drawn.u[:, :, :m + 1]
    S, V = q.shape[1:]
    p = distribution(logits, *settings.rows(m + 1))  # [b, m+1, V]
    has = _children(trees)[1] > 0
    if drawn.per_node:
        x, qn = drawn.drawn[:, :m + 1], q[:, :m + 1]
    else:
        depth = torch.cat([trees.depths.new_zeros(b, 1), trees.depths], 1).clamp(max=S - 1)
        x, qn = drawn.drawn.gather(1, depth), q.gather(1, depth[..., None].expand(-1, -1, V))
    qn = qn * has[..., None]  # x [b, m+1]: the draw among each node's children; a node without a child: q = 0
    ok = has & accepts(u[:, 0], p.gather(2, x[..., None])[..., 0], qn.gather(2, x[..., None])[..., 0])
    other = draw(residual(p, qn).flatten(0, 1), u[:, 1].flatten()).view(b, m + 1)
    return torch.where(ok, x, other)


def _sample(dlogits: Tensor, tokens: Tensor, parents: Tensor, depths: Tensor, scores: Tensor,
            temperature: Tensor, top_p: Tensor | float, seeds: Tensor) -> tuple[Tensor, Drawn]:
    return sampled_tokens(dlogits, Trees(tokens, parents, depths, scores), Settings(temperature, top_p), seeds)


def _sample_lattice(cands: Tensor, logprobs: Tensor, tokens: Tensor, parents: Tensor, depths: Tensor, scores: Tensor,
                    temperature: Tensor, top_p: Tensor | float, seeds: Tensor, vocab: int) -> tuple[Tensor, Drawn]:
    trees = Trees(tokens, parents, depths, scores)
    return lattice_tokens(Lattice(cands, logprobs), trees, Settings(temperature, top_p), seeds, vocab)


def _pick(tokens: Tensor, parents: Tensor, depths: Tensor, scores: Tensor, q: Tensor, drawn: Tensor, u: Tensor,
          per_node: bool, logits: Tensor, temperature: Tensor, top_p: Tensor | float) -> Tensor:
    return picked_tokens(Trees(tokens, parents, depths, scores), Drawn(q, drawn, u, per_node), logits,
                         Settings(temperature, top_p))


class Steps(NamedTuple):
    """The rule's device steps, `sampled_tokens` (`lattice_tokens` for DFlash 2) and
    `picked_tokens`, over flat arguments (tensors, top-p's 1.0 where no row cuts, sizes): what
    `static.Graphs` captures and replays."""

    sample: Callable[..., tuple[Tensor, Drawn]] = _sample
    pick: Callable[..., Tensor] = _pick
    sample_lattice: Callable[..., tuple[Tensor, Drawn]] = _sample_lattice


@dataclass
class Rejection:
    """A round under the rejection rule: its rows' settings and seeds, which rows decode
    greedily (their trees and walk are the match rule's: exact at temperature 0), and, once the
    draft is made, what it drew (`Drawn`)."""

    settings: Settings
    seeds: Tensor
    greedy: Tensor | None  # [b] bool; None: every row samples
    steps: Steps = Steps()
    drawn: Drawn | None = None

    @classmethod
    def of(cls, method: Method, samplings: Sequence[Sampling], gens: Sequence[random.Random | None],
           device: torch.device, steps: Steps = Steps()) -> Rejection | None:
        """The round's rejection state, or None where the match rule decides it (the method's
        rule, or no row samples). steps: the engine's (eager, or replayed from CUDA graphs)."""
        greedy = [s.temperature == 0 for s in samplings]
        if method.acceptance != "rejection" or all(greedy):
            return None
        mask = to_device(greedy, device, torch.bool) if any(greedy) else None
        return cls(Settings.of(samplings, device), round_seeds(gens, device), mask, steps)

    def draft(self, dlogits: Tensor, trees: Trees, lattice: Lattice | MarkovDraft | None = None) -> Trees:
        """The drafter's logits [b, S, V] (and a DFlash 2 drafter's lattice, or a DSpark
        drafter's Markov draft) and the trees the engine drafted from them -> the same trees, each
        sampling row's tokens drawn from the drafter's distributions (`sampled_tokens`,
        `lattice_tokens`, `markov_tokens`); greedy rows keep theirs."""
        if isinstance(lattice, MarkovDraft):  # (eagerly: its q comes from the drafter's heads, node by node)
            tokens, self.drawn = markov_tokens(lattice, trees, self.settings, self.seeds)
        elif lattice is None:
            tokens, self.drawn = self.steps.sample(dlogits, *trees, *self.settings, self.seeds)
        else:
            tokens, self.drawn = self.steps.sample_lattice(*lattice, *trees, *self.settings, self.seeds,
                                                           dlogits.shape[-1])
        if self.greedy is not None:
            tokens = torch.where(self.greedy[:, None], trees.tokens, tokens)
        return trees._replace(tokens=tokens)

    def walk(self, trees: Trees, anc: Tensor, logits: Tensor, chain: bool) -> Walk:
        """The acceptance walk of `trees` (the sampled draft's, or the prefix of them that
        cost-aware decoding verified) over the target's logits [b, m+1, V]: `tree.walk` over
        `picked_tokens` (greedy rows: over the target's argmax, the match rule)."""
        assert self.drawn is not None, "Rejection.walk follows Rejection.draft"
        picked = self.steps.pick(*trees, *self.drawn, logits, *self.settings)
        if self.greedy is not None:
            picked = torch.where(self.greedy[:, None], logits.argmax(-1), picked)
        return walk(trees, anc, picked, chain)
