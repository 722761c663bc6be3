"""Draft trees: building, the target's attention rule over them, and the acceptance walk.

Pure functions. A round verifies, per row, the bonus token (node 0, the root) and draft nodes
1..m; DFlash is the special case of a single chain, autoregressive decoding the case of no node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Tree:
    """Draft nodes 1..m under the root 0 (the bonus token). `parents[i-1]` is node i's parent."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float] = field(default_factory=list, compare=False)  # summed log-probability (best-first trees)

    @classmethod
    def chain(cls, tokens: list[int]) -> "Tree":
        """DFlash: node k (depth k) under node k-1."""
        return cls(list(tokens), list(range(len(tokens))), list(range(1, len(tokens) + 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestors(self, size: int | None = None) -> Tensor:
        """bool [size, size] (default m+1): node i may attend to node j (j is i or an ancestor of i).
        Rows past the tree (padding of a batch) see only themselves."""
        size = len(self) + 1 if size is None else size
        lines = [[0]]  # node i's ancestors and itself; parents precede children
        for i, p in enumerate(self.parents, start=1):
            lines.append(lines[p] + [i])
        lines += [[i] for i in range(len(lines), size)]
        rows = [i for i, line in enumerate(lines) for _ in line]
        anc = torch.zeros(size, size, dtype=torch.bool)
        anc[rows, [j for line in lines for j in line]] = True  # one op: tree building stays cheap
        return anc

    def children(self) -> list[dict[int, int]]:
        kids: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (p, t) in enumerate(zip(self.parents, self.tokens), start=1):
            kids[p][t] = i
        return kids


def build_tree(logprobs: Tensor, token_ids: Tensor, budget: int) -> Tree:
    """Best-first tree from per-slot top-K (logprobs/token_ids [B-1, K], sorted descending).

    A prefix's score is the sum of its slots' log-probabilities. Popping the best candidate and
    pushing its next sibling (same slot, next rank) and its first child (next slot, rank 0)
    enumerates prefixes in exactly descending score order, so the first `budget` pops are the
    `budget` best prefixes, and each one's parent is already in the tree."""
    lp, ids = logprobs.tolist(), token_ids.tolist()
    slots, k = len(lp), len(lp[0]) if lp else 0
    tree = Tree([], [], [])
    heap = [(-lp[0][0], 0, 0, 0, 0.0)] if slots and budget > 0 else []  # (-score, parent, slot, rank, parent score)
    while heap and len(tree) < budget:
        neg, parent, slot, rank, pscore = heapq.heappop(heap)
        tree.tokens.append(ids[slot][rank])
        tree.parents.append(parent)
        tree.depths.append(slot + 1)
        tree.scores.append(-neg)
        node = len(tree)
        if rank + 1 < k:
            heapq.heappush(heap, (-(pscore + lp[slot][rank + 1]), parent, slot, rank + 1, pscore))
        if slot + 1 < slots:
            heapq.heappush(heap, (neg - lp[slot + 1][0], node, slot + 1, 0, -neg))
    return tree


def prefix(tree: Tree, m: int) -> Tree:
    """The first m nodes of a best-first tree: itself a best-first tree (parents come first)."""
    return Tree(tree.tokens[:m], tree.parents[:m], tree.depths[:m], tree.scores[:m])


def walk(tree: Tree, tokens: list[int]) -> tuple[list[int], int]:
    """Follow the target's token (`tokens[i]` at node i) down the tree. Returns the accepted path
    (node indices, root first) and the target's token after it (the next bonus).

    Sampled decoding stays lossless: the token at node i was drawn before anyone looked at i's
    children, and reaching i depends only on its ancestors' tokens."""
    kids = tree.children()
    path = [0]
    while (nxt := kids[path[-1]].get(tokens[path[-1]])) is not None:
        path.append(nxt)
    return path, tokens[path[-1]]


def walk_chains(chain: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """`walk` for a chain per row, on the device (no host read before the next round can be
    queued): chain [b, m] draft tokens, tokens [b, m + 1] the target's token at the root and at
    each draft node -> (accepted draft tokens [b], the target's token after them: the next bonus [b])."""
    accepted = (chain == tokens[:, :-1]).cumprod(1).sum(1)
    return accepted, tokens.gather(1, accepted[:, None])[:, 0]


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
