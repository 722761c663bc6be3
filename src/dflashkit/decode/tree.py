"""Draft trees: building, the target's attention rule over them, and the acceptance walk.

Pure tensor functions over b rows at once, on the device that holds the drafter's logits (no
host round trip inside a round). A round verifies, per row, the bonus token (node 0, the root)
and draft nodes 1..m; DFlash is the special case of a single chain, autoregressive decoding the
case of no node. A DFlash 2 drafter drafts over a `Lattice` (its selector's conditional
log-probs between the candidates of consecutive slots): its chain is the greedy `lattice_walk`,
its tree the best-first tree over the lattice's paths (`lattice_tree`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor


class Trees(NamedTuple):
    """b draft trees of m nodes each under their roots (node 0, the bonus token, not stored).
    tokens [b, m]; parents [b, m]: node i's parent (in 0..i-1; a padding node, which is never
    accepted, is its own parent); depths [b, m] (1..); scores [b, m]: summed log-probability of
    the path to the node (best-first trees: non-increasing along the nodes)."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor

    @property
    def size(self) -> int:  # m (not __len__: a NamedTuple's length is its field count)
        return self.tokens.shape[1]


def chains(tokens: Tensor, scores: Tensor | None = None) -> Trees:
    """tokens [b, m] -> DFlash's trees: node k (depth k) under node k-1."""
    b, m = tokens.shape
    k = torch.arange(m, device=tokens.device).expand(b, -1)
    return Trees(tokens, k, k + 1, tokens.new_zeros(b, m, dtype=torch.float) if scores is None else scores)


TIE = 1e-9  # per depth: of two prefixes with equal scores the shallower comes first


@functools.lru_cache(maxsize=None)
def _pairs(width: int, K: int, budget: int, shared: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """The (prefix w, rank k) pairs of a beam of `width` prefixes and K ranks, both sorted best
    first, that can be among the best `budget` extensions. shared (every prefix extends by the
    same row): (w+1)(k+1) <= budget, since the (w+1)(k+1)-1 pairs (w' <= w, k' <= k) score at
    least as much; about budget·ln(budget) pairs instead of width·K (DDTree-64 with 64
    candidates per slot: 280, not 4,096). A row per prefix (a lattice): only k < budget, the
    prefix's own better children (another prefix's row may hold worse ones). Cached per shape:
    made in a CUDA graph's warm-up, never during its capture."""
    pairs = [(w, k) for w in range(width) for k in range(min(K, budget // (w + 1) if shared else budget))]
    w, k = torch.tensor(pairs, dtype=torch.long).T
    return w.to(device), k.to(device)


def best_first(logprobs: Tensor, token_ids: Tensor, budget: int, follow: Tensor | None = None) -> Trees:
    """The best `budget` prefixes of per-slot choices, a prefix scored by the sum of its choices'
    log-probabilities, as trees in descending score order (each node after its parent).
    logprobs/token_ids [b, S, K]: one row of K choices per slot (DFlash's top-K), each sorted
    descending; or [b, S, P, K] with follow [b, S, P, K]: P rows per slot (DFlash 2's lattice,
    `lattice_tree`), a prefix extending by the row its last choice leads to (choice k of row p
    of slot s leads to row follow[:, s, p, k] of slot s+1; the root's is row 0).

    A beam search of width `budget`: the best prefixes of depth d extend the best of depth d-1
    (a prefix scores at most its parent, so a parent outside the beam would leave `budget`
    better children in it), over the pairs that can win (`_pairs`). The nodes are then the best
    `budget` over all depths; ties go to the shallower prefix (`TIE`), so a node never outranks
    its parent and the set is closed under parents. Fixed shapes and no host read: a CUDA graph
    captures it (`static_engine`)."""
    if follow is None:
        logprobs, token_ids = logprobs[:, :, None], token_ids[:, :, None]
    b, S, P, K = logprobs.shape
    dev = logprobs.device
    beam = logprobs.new_zeros(b, 1)  # the scores of the beam's prefixes (best first): first, the root alone
    row = torch.zeros(b, 1, dtype=torch.long, device=dev)  # the row each prefix extends by (a lattice's)
    base = 0  # the index of the beam's first prefix, numbering the root 0 and then every candidate kept
    scores, parents, tokens, depths = [], [], [], []
    for s in range(S):
        width = beam.shape[1]
        w, k = _pairs(width, K, budget, P == 1, dev)
        lp, ids = logprobs[:, s].flatten(1), token_ids[:, s].flatten(1)  # [b, P * K]
        at = k if P == 1 else row[:, w] * K + k  # [pairs], or [b, pairs]: each pair's choice in its slot
        cand = beam[:, w] + (lp[:, at] if P == 1 else lp.gather(1, at))  # [b, pairs]
        beam, idx = cand.topk(min(budget, cand.shape[1]), dim=1)
        chosen = at[idx] if P == 1 else at.gather(1, idx)
        scores.append(beam)
        parents.append(base + w[idx])
        tokens.append(ids.gather(1, chosen))
        depths.append(torch.full_like(idx, s + 1))
        if P > 1:
            row = follow[:, s].flatten(1).gather(1, chosen)
        base += width  # the new beam is numbered after the one it extends
    return selected(*(torch.cat(x, 1) for x in (scores, parents, tokens, depths)), budget)


def selected(scores: Tensor, parents: Tensor, tokens: Tensor, depths: Tensor, budget: int,
             kept: Tensor | None = None) -> Trees:
    """The best `budget` of a beam search's candidates of all depths ([b, n] each: score, parent
    (0 the root, candidate c is c + 1), token, depth), ties to the shallower, as trees in
    descending score order. kept: the scores the trees carry instead (DSpark's expected acceptance)."""
    b, dev = scores.shape[0], scores.device
    m = min(budget, scores.shape[1])
    pick = (scores.double() - TIE * depths).topk(m, dim=1).indices  # [b, m], best first
    # candidate c is node new[c + 1] of the tree (new[0] = 0: the root)
    new = torch.zeros(b, scores.shape[1] + 1, dtype=torch.long, device=dev)
    new.scatter_(1, pick + 1, torch.arange(1, m + 1, device=dev).expand(b, -1))
    return Trees(tokens.gather(1, pick), new.gather(1, parents.gather(1, pick)), depths.gather(1, pick),
                 (scores if kept is None else kept).gather(1, pick))


class Lattice(NamedTuple):
    """DFlash 2's draft of b blocks of S slots (`family.CandidateSelector.lattice`): tokens
    [b, S, K], each slot's candidates (the unary head's top-K); logprobs [b, S, K, K]: row p of
    slot s holds the log-probabilities of slot s's candidates after candidate p of slot s-1 (the
    selector's edge scores, normalised over the K); slot 0 follows the bonus token, in every row."""

    tokens: Tensor
    logprobs: Tensor


def lattice_walk(lattice: Lattice) -> Trees:
    """DFlash 2's chain: from the bonus, each slot's most likely candidate after the one chosen
    before it, scored by its summed log-probabilities. Every row's best is found at once; the walk
    is then one small gather per slot (no host read)."""
    tokens, logprobs = lattice
    lp, best = logprobs.max(-1)  # [b, S, K]: each row's best candidate and its log-prob
    rows = [best.new_zeros(best.shape[0], 1)]  # slot 0's rows all follow the bonus
    for s in range(tokens.shape[1]):
        rows.append(best[:, s].gather(1, rows[-1]))
    before, chosen = torch.cat(rows[:-1], 1), torch.cat(rows[1:], 1)  # [b, S]: the row of each slot, its choice
    return chains(tokens.gather(2, chosen[..., None])[..., 0], lp.gather(2, before[..., None])[..., 0].cumsum(1))


def lattice_tree(lattice: Lattice, budget: int, top_k: int | None) -> Trees:
    """DFlash 2's best-first tree: the best `budget` paths from the bonus through the lattice
    (`best_first` with a row per predecessor), from each row's top-`top_k` candidates (None:
    `budget`; at most the lattice's K)."""
    tokens, logprobs = lattice
    lp, order = logprobs.topk(candidates(budget, top_k, tokens.shape[2]), dim=-1)  # [b, S, K, k]: each row's best first
    ids = tokens[:, :, None].expand(-1, -1, tokens.shape[2], -1).gather(3, order)
    return best_first(lp, ids, budget, follow=order)  # a choice's index among its slot's candidates is its row next


def prefix(trees: Trees, m: int) -> Trees:
    """The first m nodes of best-first trees: themselves best-first trees (parents come first)."""
    return Trees(*(x[:, :m] for x in trees))


def ancestors(parents: Tensor) -> Tensor:
    """parents [b, m] -> bool [b, m+1, m+1]: node i may attend to node j (j is i or an ancestor
    of i). A padding node (its own parent) sees only itself. Reachability by repeated squaring:
    log2(depth) small matrix products instead of a walk per node."""
    b, m = parents.shape
    q = m + 1
    up = torch.cat([parents.new_zeros(b, 1), parents], 1)  # the root is its own parent
    anc = torch.eye(q, dtype=torch.float, device=parents.device).expand(b, -1, -1).clone()
    anc.scatter_(2, up[..., None], 1.0)
    for _ in range(max(1, int(m)).bit_length()):  # paths of length <= 2^k, k > log2(m) >= log2(depth)
        anc = (anc @ anc).clamp_(max=1.0)
    return anc.bool()


def causal(b: int, q: int, device: torch.device) -> Tensor:
    """The ancestor rule of b chains of q nodes (a prefill's, a DFlash block's): bool [b, q, q]."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(b, -1, -1)


def verification(bonus: Tensor, trees: Trees, chain: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """What the target verifies: tokens [b, m+1] (the bonus, then the nodes), positions relative
    to the bonus (depths) [b, m+1] and the ancestor rule [b, m+1, m+1]. chain: the trees are
    `chains` (the rule is causal: one kernel)."""
    b, q = bonus.shape[0], trees.size + 1
    zero = trees.depths.new_zeros(b, 1)
    anc = causal(b, q, bonus.device) if chain else ancestors(trees.parents)
    return torch.cat([bonus[:, None], trees.tokens], 1), torch.cat([zero, trees.depths], 1), anc


def candidates(budget: int, top_k: int | None, vocab: int) -> int:
    """DDTree's candidates per slot for a tree of `budget` nodes (`method.TOP_K`), within the vocabulary."""
    return min(budget if top_k is None else top_k, vocab)


def drafted(dlogits: Tensor, budget: int | None, top_k: int | None, scored: bool = False,
            lattice: Lattice | None = None, top: tuple[Tensor, Tensor] | None = None) -> Trees:
    """Each row's tree from the drafter's logits [b, B-1, V]: budget None, a chain (DFlash's of
    argmax tokens; scored: with the scores that cost-aware drafting reads, a pass over the
    logits, else skipped); else a best-first tree of `budget` nodes from the top-`top_k` tokens of
    each slot (None: `budget`). With a `lattice` (DFlash 2) the chain is `lattice_walk` and the
    tree `lattice_tree`, both scored. top: the log-probs' top-k (values, indices) [b, B-1, k >= the
    candidates], where a caller builds several trees from one draft (offline evaluation)."""
    if lattice is not None:
        return lattice_walk(lattice) if budget is None else lattice_tree(lattice, budget, top_k)
    if budget is None:
        if scored:
            lp, tok = torch.log_softmax(dlogits.float(), -1).max(-1)
            return chains(tok, lp.cumsum(1))
        return chains(dlogits.argmax(-1))
    k = candidates(budget, top_k, dlogits.shape[-1])
    values, indices = top or torch.log_softmax(dlogits.float(), -1).topk(k, dim=-1)
    return best_first(values[..., :k], indices[..., :k], budget)


def draft_trees(dlogits: Tensor, bonus: Tensor, budget: int | None, top_k: int | None,
                scored: bool = False, lattice: Lattice | None = None) -> tuple[Trees, Tensor, Tensor, Tensor]:
    """The drafter's logits [b, B-1, V] (and a DFlash 2 drafter's `lattice`) and bonus tokens
    [b] -> each row's tree (`drafted`) and its `verification` tensors."""
    trees = drafted(dlogits, budget, top_k, scored, lattice)
    return (trees, *verification(bonus, trees, chain=budget is None))


class Walk(NamedTuple):
    """The acceptance walk of each row: accepted [b] (draft tokens kept); path [b, m+1]: the
    node at each depth of the accepted path (root first; past `accepted`, 0); new [b, m+1]: the
    target's token at each of those nodes (the accepted draft tokens, then the next bonus)."""

    accepted: Tensor
    path: Tensor
    new: Tensor

    @property
    def bonus(self) -> Tensor:
        return self.new.gather(1, self.accepted[:, None])[:, 0]


def walk(trees: Trees, anc: Tensor, picked: Tensor, chain: bool = False) -> Walk:
    """Follow the target's token (`picked` [b, m+1], its token at each node) down each tree: a
    node is on the accepted path when its token and its ancestors' equal the target's token at
    their parents. anc: `ancestors(trees.parents)`; chain: the trees are `chains` (the first
    mismatch ends the path: fewer kernels).

    Sampled decoding stays lossless: the token at node i was drawn before anyone looked at i's
    children, and reaching i depends only on its ancestors' tokens."""
    b, m = trees.tokens.shape
    dev = picked.device
    if chain:
        accepted = (trees.tokens == picked[:, :-1]).cumprod(1).sum(1) if m else torch.zeros_like(picked[:, 0])
        return Walk(accepted, torch.arange(m + 1, device=dev).expand(b, -1), picked)
    own = torch.arange(1, m + 1, device=dev)
    match = (trees.tokens == picked.gather(1, trees.parents)) & (trees.parents < own)  # padding never matches
    match = torch.cat([match.new_ones(b, 1), match], 1)  # the root is always kept
    on = ~(anc & ~match[:, None, :]).any(-1)  # [b, m+1]: the node and all its ancestors match
    depth = torch.cat([trees.depths.new_zeros(b, 1), trees.depths], 1)
    accepted = (depth * on).amax(1)
    # node at each depth of the path: at most one node per depth matches (siblings differ)
    path = torch.zeros(b, m + 2, dtype=torch.long, device=dev)
    path.scatter_(1, torch.where(on, depth, m + 1), torch.arange(m + 1, device=dev).expand(b, -1))
    path = path[:, :m + 1]
    return Walk(accepted, path, picked.gather(1, path))


def visibility(lengths: Tensor, depths: Tensor, ancestors: Tensor, n_slots: int,
               window: int | None = None) -> Tensor:
    """The target's attention rule for one verification pass, over cache slots.

    Row i has its committed prefix in slots [0, lengths[i]) (slot = position) and its q verified
    nodes written at slots lengths[i] + j, at positions lengths[i] + depths[i, j]. Node j sees the
    prefix and its ancestors (itself included): ancestors bool [b, q, q]. With a sliding `window`,
    only keys at positions > its position - window. Returns bool [b, q, n_slots].

    A prefill is the case lengths = 0, depths = 0..q-1, a causal `ancestors`."""
    b, q = depths.shape
    slot = torch.arange(n_slots, device=depths.device)
    rel = slot[None, :] - lengths[:, None]  # [b, n] slot -> node index
    in_tree = (rel >= 0) & (rel < q)
    node = rel.clamp(0, q - 1)
    vis = (rel < 0)[:, None, :] | (ancestors.gather(2, node[:, None, :].expand(b, q, n_slots)) & in_tree[:, None, :])
    if window is not None:
        k_pos = torch.where(in_tree, lengths[:, None] + depths.gather(1, node), slot[None, :])  # [b, n]
        q_pos = lengths[:, None] + depths  # [b, q]
        vis = vis & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    return vis
