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
  trees (DDTree)   the tree's shape (how many children each node has) is the match rule's
                   best-first tree, a function of the drafter's logits alone; the children of a
                   node at depth d are, in order, the first draws of one sample of slot d's q
                   without replacement (Gumbel-top-k); the walk runs recursive rejection sampling
                   over them (Jeon et al. 2024): accept the i-th child with min(1, p_i/q_i), else
                   go on with p_{i+1} = norm(max(0, p_i − q_i)) and q_{i+1} = q_i without the
                   child.

p and q are both the request's temperature- and top-p-adjusted distributions
(`generation.distribution`). Greedy rows are not for this module: at temperature 0 the match
rule is the exact one. Every draw of a row comes from one 63-bit seed per round, taken from the
row's own stream (`round_seeds`), through a counter-based hash: a row draws the same whatever
else the batch holds, and a round needs one host draw per row, not one per token.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dflashkit.decode.generation import Sampling, distribution, draw
from dflashkit.decode.tree import Trees, Walk, candidates, walk
from dflashkit.method import Method

if TYPE_CHECKING:
    from dflashkit.decode.engine import Draft

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_DRAFT, _ACCEPT, _RESIDUAL = 1, 2, 3  # the streams a round's seed splits into


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
    return torch.tensor([g.getrandbits(63) if g is not None else 0 for g in gens], dtype=torch.long, device=device)


class Settings(NamedTuple):
    """Each row's sampling settings, ready to broadcast over a vocabulary: temperature [b, 1];
    top_p [b, 1], or 1.0 where no row cuts (no sort). Rows that do not sample get temperature 1
    (their results are not used)."""

    temperature: Tensor
    top_p: Tensor | float

    @classmethod
    def of(cls, samplings: Sequence[Sampling], device: torch.device) -> Settings:
        t = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in samplings], device=device)[:, None]
        if all(s.top_p == 1 for s in samplings):
            return cls(t, 1.0)
        return cls(t, torch.tensor([s.top_p for s in samplings], device=device)[:, None])

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


def widths(shape: Trees, depth: int) -> list[int]:
    """Per depth 0..depth-1 of a parent, the most children any node of the trees at that depth
    has (host ints: `tree_walk`'s loop bounds; the one host read of a sampled DDTree round)."""
    b, m = shape.tokens.shape
    counts = torch.zeros(b, m + 1, dtype=torch.long, device=shape.parents.device)
    counts.scatter_add_(1, shape.parents, torch.ones_like(shape.parents))
    parent_depth = torch.cat([shape.depths.new_zeros(b, 1), shape.depths], 1)  # [b, m+1]
    per = torch.zeros(b, depth + 1, dtype=torch.long, device=counts.device)
    per.scatter_reduce_(1, parent_depth.clamp(max=depth), counts, "amax")
    return per.amax(0)[:depth].tolist()


def sampled_tokens(dlogits: Tensor, shape: Trees, k: int, settings: Settings, seeds: Tensor) -> tuple[Tensor, Tensor]:
    """The drafter's logits [b, S, V] and the trees the match rule drafts from them (`shape`:
    `tree.draft_trees`, k candidates per slot) -> (the rejection rule's tokens for the same
    nodes [b, m], the drafter's adjusted distributions q [b, S, V]). A node of depth d that is
    its parent's r-th child (`sibling_rank`) takes the r-th draw of one sample of slot d's q
    without replacement (Gumbel-top-k: the order of log q + Gumbel noise); a chain's nodes take
    one draw of each slot. The shape is a function of the drafter's logits alone, as the walk's
    proof needs, and the match rule's own: as bushy where the drafter is unsure, whatever the
    temperature."""
    b, S, V = dlogits.shape
    q = distribution(dlogits, *settings.rows(S))
    gumbel = -torch.log(-torch.log(uniforms(seeds, _DRAFT, (S, V))))
    drawn = (q.log() + gumbel.float()).topk(k, dim=-1).indices  # [b, S, k]: draws without replacement, in order
    slot = (shape.depths - 1)[..., None].expand(-1, -1, k)
    return drawn.gather(1, slot).gather(2, sibling_rank(shape.parents)[..., None])[..., 0], q


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


def chain_walk(tokens: Tensor, q: Tensor, logits: Tensor, settings: Settings, seeds: Tensor) -> Walk:
    """The rejection rule down each row's chain: tokens [b, m] (slot k's draw of q [b, m, V]),
    the target's logits [b, m+1, V] at the bonus and every node -> the `tree.Walk`."""
    b, m = tokens.shape
    q = q[:, :m]  # (cost-aware decoding may verify a prefix of the block)
    p = distribution(logits, *settings.rows(m + 1))  # [b, m+1, V]
    u = uniforms(seeds, _ACCEPT, (m,))
    ok = accepts(u, p[:, :m].gather(2, tokens[..., None])[..., 0], q.gather(2, tokens[..., None])[..., 0])
    accepted = ok.long().cumprod(1).sum(1)
    at = accepted[:, None, None].expand(-1, 1, p.shape[2])
    q_end = torch.cat([q, torch.zeros_like(q[:, :1])], 1)  # past the block nothing was drawn: p itself
    last = draw(residual(p.gather(1, at)[:, 0], q_end.gather(1, at)[:, 0]), uniforms(seeds, _RESIDUAL, (1,))[:, 0])
    new = torch.cat([tokens, last[:, None]], 1).scatter(1, accepted[:, None], last[:, None])
    return Walk(accepted, torch.arange(m + 1, device=tokens.device).expand(b, -1), new)


class _Node(NamedTuple):
    """Where each row's walk stands: its node, whether it still walks, and its path so far."""

    node: Tensor
    alive: Tensor
    accepted: Tensor
    path: Tensor
    new: Tensor


def _recursive_rejection(p: Tensor, q: Tensor, kids: Tensor, tokens: Tensor, u: Tensor, width: int
                         ) -> tuple[Tensor, Tensor]:
    """Recursive rejection sampling over each row's candidates: kids [b, m] marks the current
    node's children, `tokens` their tokens (each child's place among its siblings is its rank in
    one draw of q without replacement); u [b, width] the acceptance draws. -> (the accepted
    child [b] (-1: none), the distribution to draw from where none was accepted [b, V])."""
    b = p.shape[0]
    rank = sibling_rank(torch.where(kids, 0, torch.arange(1, kids.shape[1] + 1, device=kids.device)))
    chosen = torch.full((b,), -1, dtype=torch.long, device=p.device)
    for r in range(width):
        child = kids & (rank == r)  # [b, m]: at most one
        idx = child.float().argmax(1)
        x = tokens.gather(1, idx[:, None])  # [b, 1]
        q_x = q.gather(1, x)[:, 0]
        live = child.any(1) & (chosen < 0) & (q_x > 0)  # a child q cannot draw (top-p) ends the candidates
        hit = live & accepts(u[:, r], p.gather(1, x)[:, 0], q_x)
        chosen = torch.where(hit, idx, chosen)
        miss = (live & ~hit)[:, None]
        p = torch.where(miss, residual(p, q), p)
        q = torch.where(miss, q.scatter(1, x, 0.0), q)
        q = torch.where(miss, q / q.sum(-1, keepdim=True).clamp(min=1e-30), q)
    return chosen, p


def tree_walk(trees: Trees, q: Tensor, widths: list[int], logits: Tensor, settings: Settings, seeds: Tensor) -> Walk:
    """The rejection rule down each row's tree (recursive rejection sampling at every node of
    the path, `_recursive_rejection`): q [b, S, V] the drafter's distributions, widths
    (`widths`) the walk's bounds, the target's logits [b, m+1, V] at the bonus and
    every node -> the `tree.Walk`."""
    b, m = trees.tokens.shape
    if m == 0:  # (cost-aware decoding verified the bonus alone: a chain of no node)
        return chain_walk(trees.tokens, q, logits, settings, seeds)
    dev = logits.device
    real = trees.parents < torch.arange(1, m + 1, device=dev)  # padding nodes are no one's children
    u = uniforms(seeds, _ACCEPT, (len(widths), max(widths, default=0) or 1))
    v = uniforms(seeds, _RESIDUAL, (len(widths) + 1,))
    zero = torch.zeros(b, dtype=torch.long, device=dev)
    at = _Node(zero, torch.ones(b, dtype=torch.bool, device=dev), zero, zero.new_zeros(b, m + 1), zero.new_zeros(b, m + 1))
    deepest = min(len(widths), m)  # a path is at most m nodes deep
    for d in range(deepest + 1):
        p = distribution(logits.gather(1, at.node[:, None, None].expand(-1, 1, logits.shape[2]))[:, 0], *settings)
        chosen = torch.full((b,), -1, dtype=torch.long, device=dev)
        if d < deepest and widths[d]:
            kids = real & (trees.parents == at.node[:, None]) & at.alive[:, None]
            chosen, p = _recursive_rejection(p, q[:, d], kids, trees.tokens, u[:, d], widths[d])
        at = _step(at, d, chosen, trees.tokens, draw(p, v[:, d]))
    return Walk(at.accepted, at.path, at.new)


def _step(at: _Node, d: int, chosen: Tensor, tokens: Tensor, drawn: Tensor) -> _Node:
    """Depth d of the walk: rows that accepted a child move to it (node index chosen + 1); the
    others take the drawn token as their bonus and stop."""
    hit = at.alive & (chosen >= 0)
    stop = at.alive & ~hit
    token = torch.where(hit, tokens.gather(1, chosen.clamp(min=0)[:, None])[:, 0], drawn)
    new = torch.where((hit | stop)[:, None], at.new.scatter(1, torch.full_like(at.node[:, None], d), token[:, None]),
                      at.new)
    node = torch.where(hit, chosen + 1, at.node)
    slot = min(d + 1, at.path.shape[1] - 1)  # (past the deepest node no row moves)
    path = torch.where(hit[:, None], at.path.scatter(1, torch.full_like(node[:, None], slot), node[:, None]), at.path)
    return _Node(node, hit, at.accepted + hit.long(), path, new)


@dataclass
class Rejection:
    """A round under the rejection rule: its rows' settings and seeds, which rows decode
    greedily (their trees and walk are the match rule's: exact at temperature 0), and, once the
    draft is made, the drafter's distributions q [b, S, V] and (trees) the walk's bounds."""

    settings: Settings
    seeds: Tensor
    greedy: Tensor | None  # [b] bool; None: every row samples
    q: Tensor | None = None
    widths: list[int] | None = None

    @classmethod
    def of(cls, method: Method, samplings: Sequence[Sampling], gens: Sequence[random.Random | None],
           device: torch.device) -> Rejection | None:
        """The round's rejection state, or None where the match rule decides it (the method's
        rule, or no row samples)."""
        greedy = [s.temperature == 0 for s in samplings]
        if method.acceptance != "rejection" or all(greedy):
            return None
        mask = torch.tensor(greedy, device=device) if any(greedy) else None
        return cls(Settings.of(samplings, device), round_seeds(gens, device), mask)

    def draft(self, draft: Draft, method: Method) -> Draft:
        """The engine's draft with each sampling row's tokens drawn from the drafter's
        distributions (`sampled_tokens`, on the same trees); greedy rows keep theirs."""
        S, V = draft.logits.shape[1:]
        k = 1 if method.chain else candidates(method.budget or 1, method.top_k, V)
        tokens, self.q = sampled_tokens(draft.logits, draft.trees, k, self.settings, self.seeds)
        if self.greedy is not None:
            tokens = torch.where(self.greedy[:, None], draft.trees.tokens, tokens)
        self.widths = None if method.chain else widths(draft.trees, S)
        return draft._replace(trees=draft.trees._replace(tokens=tokens), tokens=torch.cat([draft.tokens[:, :1], tokens], 1))

    def walk(self, trees: Trees, anc: Tensor, logits: Tensor, chain: bool) -> Walk:
        """The acceptance walk of `trees` (the sampled draft's, or the prefix of them that
        cost-aware decoding verified) over the target's logits [b, m+1, V]: `chain_walk` or
        `tree_walk`; greedy rows walk by the match rule."""
        assert self.q is not None, "Rejection.walk follows Rejection.draft"
        if chain:
            walked = chain_walk(trees.tokens, self.q, logits, self.settings, self.seeds)
        else:
            assert self.widths is not None
            walked = tree_walk(trees, self.q, self.widths, logits, self.settings, self.seeds)
        if self.greedy is None:
            return walked
        matched = walk(trees, anc, logits.argmax(-1), chain)
        keep = self.greedy[:, None]
        return Walk(torch.where(self.greedy, matched.accepted, walked.accepted),
                    torch.where(keep, matched.path, walked.path), torch.where(keep, matched.new, walked.new))
