"""Cost-aware drafting: how much to verify, given what verification costs on this hardware.

A verification pass of q tokens costs more with q on a compute-bound machine (a 2-core CPU: a
16-token pass costs several 1-token steps) and about the same on a memory-bound one (a GPU at
batch 1). The engine measures its cost curve once (seconds per pass of q tokens at the batch
size in use); each round then keeps the prefix of the draft (a chain's first k tokens, a
best-first tree's first m nodes, itself a best-first tree) that maximises expected tokens per
second, taking the drafter's own probabilities as the chance that the target accepts a path.
Lossless either way: it only decides how much of the draft is verified.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

MIN_SAVING = 0.1  # a narrower verification pass is a candidate if its round costs <= 90 % of a full one
TRUST = 3  # choosing rounds of a width after which their times replace the model's


@dataclass
class CostCurve:
    widths: list[int]  # verification widths measured, ascending: the only widths a round verifies
    seconds: list[float]  # one pass of that width, measured back to back
    stall_seconds: float = 0.0  # measured: what reading the draft's confidences before verifying adds (a GPU's queue)
    overhead_seconds: float = 0.0  # a round's time besides its pass, full width unread (running estimate)
    excess: dict[int, deque] = field(default_factory=dict)  # width -> its last choosing rounds' time beyond overhead + pass

    def chosen_seconds(self, width: int) -> float:
        """A choosing round's time at `width`: the overhead, the pass, and what such rounds took
        beyond these: the median of this width's last rounds once `TRUST` of them ran, else of
        every width's, else the measured stall. Learnt per width, because the error is the
        width's own: on 2 CPU cores a pass of 4 tokens inside a round took 10 ms more than back
        to back, one of 16 tokens 6 ms (SmolLM2). Kept as a difference, it follows the overhead
        as that drifts (longer contexts, other prompts)."""
        extra = self.stall_seconds
        own = self.excess.get(width, ())
        if len(own) >= TRUST:
            extra = _median(own)
        else:  # (pooled only here: this runs for every candidate width every round)
            pooled = [x for d in self.excess.values() for x in d]
            extra = _median(pooled) if len(pooled) >= TRUST else extra
        return self.overhead_seconds + self.seconds[self.widths.index(width)] + extra

    def candidates(self) -> list[int]:
        """The widths worth choosing: those whose choosing round costs at most (1 - MIN_SAVING) of
        a round that verifies the full (widest) draft unread, and the full one. Where verification
        is about free (a GPU at small batch) only the full width is left, and a round runs as
        without cost-awareness: no read of the draft's confidences, no wait for them. Judged on
        whole rounds as they are learnt: a pass that saves a fifth of itself saves too little of a
        round whose draft and host work cost as much again (SmolLM2 on an H200: 1.25 against 1.53
        ms a pass, 2.4 ms a round)."""
        bar = (1 - MIN_SAVING) * (self.overhead_seconds + self.seconds[-1])
        return [w for w in self.widths[:-1] if self.chosen_seconds(w) <= bar] + self.widths[-1:]

    def best_width(self, expected: Tensor) -> int:
        """expected [q_max]: tokens a round yields (summed over rows) when it verifies q = 1..q_max
        tokens per row -> the candidate width q <= q_max with the most tokens per second. Only
        measured widths: their cost is known, not interpolated, and each is a pass shape already
        run (with CUDA graphs, a new width would capture new graphs in the middle of decoding)."""
        e = expected.tolist()
        rates = {w: e[w - 1] / self.chosen_seconds(w) for w in self.candidates() if w <= len(e)}
        return max(rates, key=rates.__getitem__)

    def observe(self, round_seconds: float, width: int, chosen: bool) -> None:
        """A round that verified `width` tokens per row took `round_seconds`, having read the
        draft's confidences to choose (`chosen`) or not: rounds run unread learn the overhead
        (the draft, the tree, host work, the commit), choosing rounds what their width costs
        beyond it, so that a narrower pass is not credited with savings a round does not see."""
        if width not in self.widths:
            return
        other = round_seconds - self.seconds[self.widths.index(width)]
        if not chosen:
            base = max(0.0, other)
            self.overhead_seconds = 0.8 * self.overhead_seconds + 0.2 * base if self.overhead_seconds else base
        elif not self.overhead_seconds:  # no round unread yet (a CPU may never run one): this one's, less the stall
            self.overhead_seconds = max(0.0, other - self.stall_seconds)
        else:
            self.excess.setdefault(width, deque(maxlen=5)).append(other - self.overhead_seconds)


@dataclass
class Drafting:
    """Whether a round drafts at all. A round with a draft yields τ tokens per running row in
    t_draft seconds, one without (an autoregressive step of the same rows) 1 token in t_ar; the
    rate of drafting is τ · t_ar / t_draft. Both sides are estimated from the rounds actually run
    (medians of the last few times: a round that captures CUDA graphs is an outlier; τ over the
    last 16 draft rounds; t_ar first from `ar_first` rounds). Drafting goes on until its rate, over
    a full window of 16 draft rounds and with τ taken `z` standard errors above its mean, falls
    below 1 - `margin`: a noisy estimate near 1 must not give up rounds that pay (judged on its
    first round or two, an H200 stopped drafting where it paid 1.27x; on a window's plain mean, it
    stopped on chat prompts where drafting paid 1.11x, as τ's 16-round means dip); then rounds
    skip the draft, except the last
    `retry` of every `interval` rounds, which re-estimate τ (from these alone) and t_draft:
    drafting resumes if its rate, judged the same way, is 1 - `margin` or more (a stricter bar kept
    drafting off through stretches where it paid), else the interval doubles (up to
    `max_interval`: where drafting is far from paying, re-trying it must not cost much). The first draft after rounds without one takes their
    features in one longer pass: it is not timed (the second is). t_ar is measured while not
    drafting (it depends on the batch, not the text)."""

    explore: int = 16
    max_interval: int = 128
    retry: int = 4
    margin: float = 0.15
    z: float = 1.0
    ar_first: int = 3
    draft_s: deque = field(default_factory=lambda: deque(maxlen=5))
    ar_s: deque = field(default_factory=lambda: deque(maxlen=5))
    taus: deque = field(default_factory=lambda: deque(maxlen=16))
    drafting: bool = True
    since: int = 0  # rounds without drafting since it stopped or was last re-tried
    interval: int = field(init=False)  # rounds between re-tries: `explore`, doubling while they fail

    def __post_init__(self) -> None:
        self.interval = self.explore

    def choose(self) -> bool:
        """True: the next round drafts."""
        if not self.draft_s:  # (the first draft takes the prompt: untimed, so the first two draft)
            return True
        if len(self.ar_s) < self.ar_first:
            return False
        return self.drafting or self.since >= self.interval - self.retry

    def rate(self, z: float = 0.0) -> float:
        """Tokens per second of drafting rounds over those of rounds without a draft (τ taken `z`
        standard errors of its mean above it)."""
        n = len(self.taus)  # (plain sums: this runs every round; `statistics` took 60 µs, 3 % of a GPU round)
        tau = sum(self.taus) / n
        if z and n > 1:
            tau += z * (max(0.0, sum(t * t for t in self.taus) - n * tau * tau) / (n - 1) / n) ** 0.5
        return tau * _median(self.ar_s) / _median(self.draft_s)

    def observe(self, drafted: bool, seconds: float, tau: float | None, timed: bool = True) -> None:
        """A round ran: with a draft or not, its wall time (`timed` False: not representative),
        and (with a draft) the tokens it gave per running row."""
        if timed:
            (self.draft_s if drafted else self.ar_s).append(seconds)
        if drafted and not self.drafting and self.since == self.interval - self.retry:
            self.taus.clear()  # a re-try judges τ on the text as it is now
        if drafted and tau is not None:
            self.taus.append(tau)
        if not (self.draft_s and self.ar_s and self.taus):
            return
        if self.drafting:
            if len(self.taus) == self.taus.maxlen and self.rate(self.z) < 1 - self.margin:
                self.drafting, self.since, self.interval = False, 0, self.explore
            return
        self.since += 1
        if self.since >= self.interval:  # a re-try just ended
            if self.rate(self.z) >= 1 - self.margin:
                self.drafting = True
            else:
                self.since, self.interval = 0, min(2 * self.interval, self.max_interval)


class Sizing(NamedTuple):
    """Cost-aware decoding's state for one engine, method and batch size: what verification costs
    (`CostCurve`) and whether drafting pays (`Drafting`)."""

    curve: CostCurve
    drafting: Drafting

    def reads_scores(self) -> bool:
        """Whether a round reads its draft's scores to choose the width it verifies: only where a
        narrower width is a candidate (else rounds run as without cost-awareness, unread)."""
        return len(self.curve.candidates()) > 1


def sizing(engine: Any, key: tuple, widest: int) -> tuple[Sizing, bool]:
    """The engine's `Sizing` under `key` (`Engine.cost_state`), and whether it was measured now:
    measured once, what the rounds learn carries over to the engine's next streams (a short
    answer must not pay for learning it again). widest: the widest verification of a round."""
    if key in engine.cost_state:
        return engine.cost_state[key], False
    widths = sorted({w for w in (1, 2, 4, 8, 16, 32, 64, widest) if w <= widest})
    engine.cost_state[key] = Sizing(measure(engine, widths), Drafting())
    return engine.cost_state[key], True


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def measure(engine, widths: list[int], reps: int = 3) -> CostCurve:
    """Time verification passes of each width on the engine's current rows (after a prefill), and
    the stall of a host read between passes (on a GPU, fixed-width rounds queue their work behind
    each other; a round that must read the draft's confidences first cannot). Nothing is
    committed: the passes write past every row's length, where the next round writes."""
    b, dev = engine.batch, engine.target.device

    def timed(q: int, read: bool, reps: int = reps) -> float:
        tokens = torch.zeros(b, q, dtype=torch.long, device=dev)
        depths = torch.arange(q, device=dev).expand(b, -1)
        engine.verify(tokens, depths)  # warm-up (graph capture, compilation)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            logits = engine.verify(tokens, depths)
            if read:
                logits[:, 0, :1].cpu()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    # A wider pass does the narrower one's work and more: a narrow width timed above a wider one
    # met a slow moment of the machine (a 1-token pass at 171 ms beside an 8-token one at 123 ms,
    # 2 busy CPU cores), and takes the wider one's time.
    seconds = [timed(q, read=False) for q in widths]
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    stall = 0.0
    if dev.type == "cuda":  # the difference of two timings: more passes than for the curve
        stall = max(0.0, timed(widths[-1], read=True, reps=10) - timed(widths[-1], read=False, reps=10))
    return CostCurve(list(widths), seconds, stall_seconds=stall)


def tree_expectation(scores: Tensor) -> Tensor:
    """scores [b, m]: each node's summed log-probability, best-first trees (a chain's are the
    running sums of its slots' log-probabilities) -> expected tokens of a round that verifies the
    first 0..m nodes of each row's tree, summed over rows: [m + 1]. A node is accepted with the
    probability of its path, and the target's own token at the end of the path always counts."""
    b = scores.shape[0]
    reach = scores.double().exp().sum(0).cumsum(0).float()  # expected accepted nodes among the first j
    return torch.cat([reach.new_zeros(1), reach]) + b
