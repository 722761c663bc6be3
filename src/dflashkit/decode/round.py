"""One speculative round over a batch of rows: draft, tree, verify, accept, commit.

A round, for every running row, starting with its bonus token at position `length` (the first
token whose target features are not yet in the drafter's cache):

  draft   the drafter turns the features of the tokens verified last round plus the bonus into
          per-slot distributions for positions length+1 .. length+B-1, and each row's tree from
          them (DFlash: one chain of the B-1 argmax tokens; DDTree: a best-first tree of `budget`
          nodes from the top-`top_k` tokens per slot; autoregressive decoding: no node at all);
  tree    what the target verifies of it: all of it, or (cost-aware) the prefix worth its cost;
  verify  one target pass over [bonus, nodes...] of every row at positions length + depth, each
          node seeing the prefix and its ancestors; the target's own token at every node (its
          argmax, or a sample of its own distribution);
  accept  walk from the root while the target's token at the current node is a child: the
          accepted path, and the target's token at its last node, the next bonus (the 'match'
          rule); or, in a sampled round under the 'rejection' rule (`Method.acceptance`), drafts
          drawn from the drafter's distributions, accepted with min(1, p/q) (`accept.Rejection`);
  commit  keep the accepted path in the caches. The host learns each row's count when it reads
          the round (`Engine.settle`), which may be after the next round is launched.

Nothing in a round waits for the host: its tokens come back in one copy (`Round.read`).

Lossless: every committed token is the target's argmax (greedy), a sample of the target's own
distribution drawn before looking at the draft ("accept while draft == target sample"), or a
draft token accepted by rejection sampling, whose output distribution is the target's
(docs/conventions.md); the output is exactly what the target alone produces, and the drafter
only decides how many of those tokens one target pass yields.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from dflashkit.decode import cost
from dflashkit.decode.accept import Rejection
from dflashkit.decode.cache import HostCopy, to_device
from dflashkit.decode.engine import Draft, Engine
from dflashkit.decode.generation import Generation, Sampling, target_tokens
from dflashkit.decode.tree import Trees, Walk, chains, prefix, verification, walk
from dflashkit.method import Method

STAGE_END = "stage end: "  # profiler marks of a profiled stream (`Stages`)
GREEDY = Sampling()


class Stages:
    """Wall time per stage; synchronises CUDA at each boundary so that the times are honest, and
    marks each boundary in a profiler's trace (an empty `record_function` named `STAGE_END` +
    the stage that ended; 'between rounds' at a round's start): a kernel belongs to the stage
    of the first mark after it starts."""

    def __init__(self, on: bool, device: torch.device) -> None:
        self.on, self.cuda = on, device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.t = 0.0

    def _boundary(self, stage: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        with record_function(STAGE_END + stage):
            pass

    def start(self) -> None:
        if self.on:
            self._boundary("between rounds")
            self.t = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.on:
            self._boundary(stage)
            now = time.perf_counter()
            self.seconds[stage] += now - self.t
            self.t = now


@dataclass
class Request:
    """One sequence to decode: its prompt [T], token limit, sampling settings and stop tokens."""

    prompt: Tensor
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: set[int] | frozenset[int] = frozenset()


@dataclass
class Row:
    """A request in the running batch: its index in the stream, settings and result so far."""

    index: int
    request: Request
    limit: int  # max_new_tokens, within the model's positions
    gen: random.Random | None  # its own random stream
    res: Generation
    t1: float  # when its first token was known: decode time counts from here

    def extend(self, new: list[int]) -> list[int]:
        return self.res.extend(new, self.limit, self.request.stop_ids)


@dataclass
class Batch:
    """The rows a round decodes: each place's row (None: an idle place that never held a
    request), which of them run, and their bonus tokens on the device [b]."""

    rows: list[Row | None]
    bonus: Tensor
    running: list[bool] = field(default_factory=list)
    _running_t: tuple[list[bool], Tensor] | None = None  # `running` on the device, as last sent
    _empty: dict[int, tuple[Trees, Tensor, Tensor]] = field(default_factory=dict)  # `no_draft`'s, per size

    def running_t(self) -> Tensor:
        """`running` on the device [b] (sent again only when it changed)."""
        if self._running_t is None or self._running_t[0] != self.running:
            self._running_t = (list(self.running), to_device([int(r) for r in self.running], self.bonus.device))
        return self._running_t[1]

    def no_draft(self) -> tuple[Trees, Tensor, Tensor, Tensor]:
        """An autoregressive round's trees (none) and `tree.verification` tensors: each row's
        bonus alone. Made once per batch size (an AR step is a few launches)."""
        b = self.bonus.shape[0]
        if b not in self._empty:
            trees = chains(self.bonus[:, None][:, :0])
            self._empty[b] = (trees, *verification(self.bonus, trees, chain=True)[1:])
        trees, depths, anc = self._empty[b]
        return trees, self.bonus[:, None], depths, anc


@dataclass
class Round:
    """A round launched on the device whose host side (reading its tokens) is still to run."""

    rows: list[Row | None]  # the batch at launch (a row's place may be taken before the read)
    running: list[bool]  # rows that decode in it
    read: HostCopy  # per row [accepted, the path's nodes..., the target's tokens at them...]
    logits: Tensor | None  # the target's logits [b, q, V] when recorded
    width: int  # verified nodes per row
    chain: bool  # every row's tree is a chain (DFlash, AR)
    started: float
    drafted: bool  # False: an autoregressive round (no draft, or cost-aware decoding chose none)
    timed: bool  # its time represents a round of its kind (not a draft that took a long context first)
    chosen: bool  # cost-aware: the host read the draft's confidences to choose the width verified


def row_tokens(logits: Tensor, samplings: Sequence[Sampling], gens: Sequence[random.Random | None]) -> Tensor:
    """logits [b, q, V] -> [b, q]: each row through `target_tokens` with its own sampling and
    random stream, so a row draws exactly what it would draw decoded alone."""
    out = logits.argmax(-1)
    groups: dict[tuple[float, float], list[int]] = {}  # rows that sample, by their settings
    for i, s in enumerate(samplings):
        if s.temperature > 0:
            groups.setdefault((s.temperature, s.top_p), []).append(i)
    b, q = out.shape
    for (temperature, top_p), rows in groups.items():
        u = to_device([gens[i].random() for i in rows for _ in range(q)], logits.device, torch.float64)
        whole = len(rows) == b  # (indexing by a host list would wait for the device)
        idx = slice(None) if whole else to_device(rows, logits.device)
        out[idx] = target_tokens(logits[idx].flatten(0, 1), Sampling(temperature, top_p), u).view(len(rows), q)
    return out


def verified(draft: Draft | None, batch: Batch, sizing: cost.Sizing | None) -> tuple[Trees, Tensor, Tensor, Tensor]:
    """The tree step: each row's tree (none for an autoregressive round) and the
    `tree.verification` tensors: tokens and depths [b, q], ancestors [b, q, q]. Cost-aware
    (`sizing` that reads the draft's scores), only the prefix of the draft that maximises expected
    tokens per second is kept (the same size for every row)."""
    if draft is None:
        return batch.no_draft()
    if sizing is None or not sizing.reads_scores():  # only the full width pays: as without sizing
        return draft.trees, draft.tokens, draft.depths, draft.ancestors
    q = sizing.curve.best_width(cost.tree_expectation(draft.trees.scores.cpu()))
    return prefix(draft.trees, q - 1), draft.tokens[:, :q], draft.depths[:, :q], draft.ancestors[:, :q, :q]


def commit(engine: Engine, walked: Walk, batch: Batch, method: Method, drafted: bool, chain: bool) -> None:
    """The commit step: each running row keeps its accepted path in the caches. A drafted round
    commits the paths as the walk left them on the device (`Engine.commit_walk`: the next round can
    queue behind it; the host's lengths learn them from `Engine.settle` when the round is read); a
    round without a draft keeps each running row's one node, known on the host."""
    if drafted:
        engine.commit_walk(walked, batch.running_t(), chain)
    else:
        engine.commit([range(1) if run else range(0) for run in batch.running], context=method.drafts)


def speculative_round(engine: Engine, batch: Batch, method: Method, sizing: cost.Sizing | None, stages: Stages,
                      keep_logits: bool = False) -> Round:
    """Launch one round over `batch`'s running rows (their bonus tokens become the next ones,
    still on the device) -> the `Round` whose tokens the host reads later. sizing: cost-aware
    decoding's choices (whether to draft, how much of the draft to verify); keep_logits: the
    round keeps the target's logits (`Round.logits`)."""
    stages.start()
    started = time.perf_counter()
    drafted = method.drafts and (sizing is None or sizing.drafting.choose())
    scored = sizing is not None and sizing.reads_scores()  # cost-aware: the tree's scores are read
    draft = engine.draft(batch.bonus, method.tree_budget, method.top_k, scored) if drafted else None
    samplings = [row.request.sampling if row else GREEDY for row in batch.rows]
    gens = [row.gen if row else None for row in batch.rows]
    rejection = Rejection.of(method, samplings, gens, batch.bonus.device, engine.accept_steps) if drafted else None
    if rejection is not None:  # the sampling rows' trees: draws of the drafter's distributions
        draft = draft.retokened(rejection.draft(draft.logits, draft.trees, draft.lattice))
    stages.mark("draft")
    trees, tokens, depths, anc = verified(draft, batch, sizing)
    stages.mark("tree")
    logits = engine.verify(tokens, depths, anc)  # [b, q, V]
    stages.mark("verify")
    chain = method.chain or not drafted
    # accept, on the device: the next bonus stays there
    walked = rejection.walk(trees, anc, logits, chain) if rejection is not None else \
        walk(trees, anc, row_tokens(logits, samplings, gens), chain)
    read = HostCopy(torch.cat([walked.accepted[:, None], walked.path, walked.new], 1))  # the round's one transfer
    commit(engine, walked, batch, method, drafted, chain)
    batch.bonus = walked.bonus
    return Round(list(batch.rows), batch.running, read, logits if keep_logits else None, tokens.shape[1], chain,
                 started, drafted, not (drafted and engine.caught_up), drafted and scored)
