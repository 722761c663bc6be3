"""The one round loop: b prompts, any method, greedy or sampled, lossless.

A round, for every running row, starting with its bonus token at position `length` (the first
token whose target features are not yet in the drafter's cache):

  draft   the drafter turns the features of the tokens verified last round plus the bonus into
          per-slot distributions for positions length+1 .. length+B-1;
  tree    DFlash: one chain of the B-1 argmax tokens; DDTree: a best-first tree of `budget`
          nodes from the top-`top_k` tokens per slot; autoregressive decoding: no node at all;
  verify  one target pass over [bonus, nodes...] of every row at positions length + depth, each
          node seeing the prefix and its ancestors;
  commit  walk from the root while the target's token at the current node (its argmax, or a
          sample of its own distribution) is a child; keep the accepted path in the caches; the
          target's token at the last node is the next bonus.

Lossless: every committed token is the target's argmax (greedy) or a sample of the target's own
distribution drawn before looking at the draft ("accept while draft == target sample"), so the
output is exactly what the target alone produces; the drafter only decides how many of those
tokens one target pass yields.

τ (acceptance length) of a round = accepted draft tokens + 1 (the target's token at the end of
the path), 1 <= τ <= B. The final round counts only tokens up to the stop token or the token
limit (named convention: it makes online τ equal offline τ from cached features).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from dflashkit.decode import cost
from dflashkit.decode.cache import HostCopy, to_device
from dflashkit.decode.engine import Draft, Engine
from dflashkit.decode.generation import (METHODS, Generation, GenerationChunk, Sampling, new_generator, target_tokens,
                                         usage_stats)
from dflashkit.decode.static import static_engine, supported
from dflashkit.decode.tree import TOP_K, Trees, chains, prefix, verification, walk


RESERVE = 2048  # answer tokens the caches make room for at the start
STAGE_END = "stage end: "  # profiler marks of a profiled stream (`_Stages`)
GREEDY = Sampling()


class _Stages:
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


def check_request(method: str, max_new_tokens: int, drafter: Any, budget: int | None = None,
                  top_k: int | None = None) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter; use method 'ar' without one")
    if method == "ddtree" and (budget is None or budget < 1):
        raise ValueError(f"ddtree needs a node budget >= 1, got {budget}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k (DDTree's candidates per slot): expected None (the node budget) or an int >= 1, "
                         f"got {top_k!r}")


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


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} prompts")
    return values


def _requests(prompts: Sequence[Tensor], max_new_tokens: int | Sequence[int], sampling: Any, stop_ids: Any) -> list[Request]:
    """One `Request` per prompt ([T] or [1, T]), each setting given once for all or per prompt."""
    prompts = [p.reshape(-1) if p.ndim == 2 and p.shape[0] == 1 else p for p in prompts]
    if not prompts or any(p.ndim != 1 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of [T] or [1, T] token tensors")
    n = len(prompts)
    return [Request(p, lim, s or Sampling(), stop) for p, lim, s, stop in
            zip(prompts, _per_row(max_new_tokens, n, "max_new_tokens"), _per_row(sampling, n, "sampling"),
                _per_row(stop_ids, n, "stop_ids"))]


def _trees(draft: Draft | None, bonus: Tensor, curve: cost.CostCurve | None,
           empty: dict[int, tuple[Trees, Tensor, Tensor]]) -> tuple[Trees, Tensor, Tensor, Tensor]:
    """Each row's tree (none for an autoregressive round) and the `tree.verification` tensors:
    tokens and depths [b, q], ancestors [b, q, q]. With a cost `curve`, only the prefix of the
    draft that maximises expected tokens per second is kept (the same size for every row).
    empty: per batch size, the empty trees' tensors, made once (an AR step is a few launches)."""
    if draft is None:
        b = bonus.shape[0]
        if b not in empty:
            trees = chains(bonus[:, None][:, :0])
            empty[b] = (trees, *verification(bonus, trees, chain=True)[1:])
        trees, depths, anc = empty[b]
        return trees, bonus[:, None], depths, anc
    trees, tokens, depths, anc = draft.trees, draft.tokens, draft.depths, draft.ancestors
    if curve is None or len(curve.candidates()) == 1:  # only the full width pays: as without a curve
        return trees, tokens, depths, anc
    q = curve.best_width(cost.tree_expectation(trees.scores.cpu()))
    return prefix(trees, q - 1), tokens[:, :q], depths[:, :q], anc[:, :q, :q]


@dataclass
class Request:
    """One sequence to decode: its prompt [T], token limit, sampling settings and stop tokens."""

    prompt: Tensor
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: set[int] | frozenset[int] = frozenset()


@dataclass
class _Row:
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
class _Round:
    """A round launched on the device whose host side (`decode_stream`'s finish) is still to run."""

    rows: list[_Row | None]  # the batch at launch (a row's place may be taken before the read)
    running: list[bool]  # rows that decode in it
    read: HostCopy  # per row [accepted, the path's nodes..., the target's tokens at them...]
    logits: Tensor | None  # kept for record_top
    width: int  # verified nodes per row
    chain: bool  # every row's tree is a chain (DFlash, AR)
    started: float
    drafted: bool  # False: an autoregressive round (no draft, or cost-aware decoding chose none)
    timed: bool  # its time represents a round of its kind (not a draft that took a long context first)
    chosen: bool  # cost-aware: the host read the draft's confidences to choose the width verified


Admit = Callable[[int], Sequence[Request]]  # rows running -> requests that join the batch now
Step = list[tuple[int, list[int], Generation]]  # one yield of the stream: (index, new tokens, Generation) per row


def _top(logits: Tensor, k: int) -> tuple[list, list]:
    """logits [b, q, V] -> the top-k ids and logits, [b][q][k] lists on the host."""
    values, ids = logits.float().topk(k, dim=-1)
    return ids.tolist(), values.tolist()


def _room(prompt: int, limit: int, budget: int | None, B: int) -> int:
    """Cache positions a request reserves: its prompt and its answer up to a few thousand tokens
    (`RESERVE`), and a round's draft. The caches grow beyond that only if the answer does (a
    request without a token limit must not reserve the model's whole context)."""
    return prompt + min(limit, RESERVE) + (budget or 0) + 2 * B


def _start(engine: Engine, requests: Sequence[Request], first: int, method: str, budget: int | None,
           prefill: Callable[[list[Tensor], int], Tensor], record_top: int) -> tuple[list[_Row], Tensor, Step]:
    """Prefill `requests` (numbered from `first`) through `prefill(prompts, capacity)` -> their
    rows, first tokens on the device [m] and the stream step that reports them."""
    for r in requests:
        check_request(method, r.max_new_tokens, engine.drafter, budget)
    limits = [r.max_new_tokens for r in requests]
    if engine.target.max_positions:  # the answer ends where the model's positions do
        limits = [min(lim, engine.target.max_positions - len(r.prompt)) for lim, r in zip(limits, requests)]
    B = engine.block
    gens = [new_generator(r.sampling) for r in requests]
    t0 = time.perf_counter()
    room = max(_room(len(r.prompt), m, budget, B) for r, m in zip(requests, limits))
    logits = prefill([r.prompt for r in requests], room)
    bonus = row_tokens(logits[:, None], [r.sampling for r in requests], gens)[:, 0]  # [m], stays on the device
    tokens = bonus.tolist()  # waits for the prefill: time to first token is honest on CUDA too
    t1 = time.perf_counter()
    rows = [_Row(first + j, r, lim, g, Generation([], [], "", len(r.prompt), t1 - t0, 0.0), t1)
            for j, (r, lim, g) in enumerate(zip(requests, limits, gens))]
    if record_top:
        ids, values = _top(logits[:, None], record_top)
        for j, row in enumerate(rows):
            row.res.top.append((ids[j][0], values[j][0]))
    return rows, bonus, [(row.index, row.extend([t]), row.res) for row, t in zip(rows, tokens)]


@torch.no_grad()
def decode_stream(
    engine: Engine,
    prompts: Sequence[Tensor],  # b x [T_i] or [1, T_i]
    *,
    max_new_tokens: int | Sequence[int],
    method: str = "dflash",
    budget: int | None = None,
    top_k: int | None = TOP_K,
    sampling: Sampling | Sequence[Sampling] | None = None,
    stop_ids: set[int] | frozenset[int] | Sequence[set[int] | frozenset[int]] = frozenset(),
    cancelled: Callable[[int], bool] = lambda i: False,
    admit: Admit | None = None,
    rows: int | None = None,
    profile: bool = False,
    cost_aware: bool = False,
    record_top: int = 0,
) -> Iterator[Step]:
    """Decode every prompt to its first stop token (included) or its token limit. Yields, after
    the prefill and after each round, (prompt index, newly committed tokens, its running
    `Generation`) for each row that was still running. Per row, the tokens, τ per round and
    random draws equal decoding that prompt alone (same seed). A row for which
    `cancelled(prompt index)` turns true stops before the next round, unfinished (it leaves the
    batch, or stays in it idle on an engine with `fixed_rows`).

    admit (continuous batching): called before every round with the number of rows still
    running; the `Request`s it returns join the batch now (`Engine.join`: into idle rows of a
    `fixed_rows` engine, else appended), numbered on from the prompts in the order admitted, and
    their first tokens are yielded at once. The stream ends when no row runs and `admit` returns
    nothing. Every row shares `method`. rows: on a `fixed_rows` engine (CUDA graphs), the batch
    holds this many rows from the start, idle beyond the prompts, so that joins fill idle rows
    and never grow it: a batch that grew by appends would capture a new set of graphs at every
    size it passed through (seconds of stalls for every running row).

    method: 'ar' (no drafter), 'dflash' (one chain of B-1 argmax tokens), 'ddtree' (a tree of
    `budget` nodes from the top-`top_k` tokens of each slot; None: `budget` of them). Unless profiling or recording, a
    round whose tokens have not reached the host yet is read a round late, the next one already
    running on the device (except a cost-aware round that read its draft's scores, and, with
    `admit`, on an engine without fixed rows): a row's end is then seen a round after it, and
    that round's tokens for the row are dropped. cost_aware: measure what verification costs
    here, then verify per round only the draft prefix that maximises expected tokens per second,
    and draft at all only while drafting rounds give more tokens per second than autoregressive
    ones (`decode/cost.py`; both kept on the engine per method and batch size);
    the sizes chosen (0: no draft) go to `Generation.draft_sizes`.
    record_top: keep, per output token, the target's top-`record_top` ids and logits of the pass
    that chose it (`Generation.top`; one more host transfer per round)."""
    check_request(method, 1, engine.drafter, budget, top_k)
    requests = _requests(prompts, max_new_tokens, sampling, stop_ids)
    n = len(requests)
    B = engine.block
    dev = engine.target.device
    stages = _Stages(profile, dev)

    batch: list[_Row | None]  # None: an idle row that never held a request
    batch, bonus, step = _start(engine, requests, 0, method, budget, lambda ps, room: engine.prefill(ps, capacity=room),
                                record_top)
    if rows and engine.fixed_rows and rows > n:  # idle rows: one-token prompts that never decode
        engine.join([torch.zeros(1, dtype=torch.long)] * (rows - n), range(n, rows), capacity=0)
        batch += [None] * (rows - n)
        bonus = torch.cat([bonus, bonus.new_zeros(rows - n)])
    admitted = n  # requests so far: the next one's index
    yield step
    # A round needs nothing from the host to launch the next one (the walk, the commit and the
    # next bonus stay on the device), so without admissions (which change the batch) the host
    # reads a round's tokens while the next runs, unless they have already arrived (the host
    # being the slower side, as for a small target): then it reads them first, and never runs a
    # round past every row's end. (A cost-aware round that read its draft's scores to choose a
    # width has waited for the device already: it is read at once.) Admissions keep the lag on an
    # engine with fixed rows: requests join into the places the last read freed while the next
    # round runs, which still decodes the rows that ended in it (their tokens are dropped).
    lag = not (record_top or profile)
    inflight: _Round | None = None
    running_t: tuple[list[bool], Tensor] | None = None  # the running rows on the device (for `commit_walk`)
    empty: dict[int, tuple[Trees, Tensor, Tensor]] = {}  # `_trees`' autoregressive rounds

    def finish(rnd: _Round, next_started: float | None = None) -> Step:
        """A launched (and committed) round's host side: read each row's path and tokens, tell
        the engine the counts, extend each row's answer -> the stream step. A round's time runs
        to the launch of the next (`next_started`, when that came first: read a round late, a
        round costs the interval between launches) or to now."""
        host, w = rnd.read(), rnd.width
        # a chain's path is nodes 0..accepted; new tokens: the accepted draft tokens (equal to the
        # target's), then its next one
        paths: list[Sequence[int]] = [range(h[0] + 1) if rnd.chain else h[1:h[0] + 2] for h in host]
        news = [h[1 + w:2 + w + h[0]] for h in host]
        top = _top(rnd.logits, record_top) if record_top else None
        # A row whose place a join took after the launch: its lengths are the newcomer's (count 0)
        stays = [run and now is row for run, row, now in zip(rnd.running, rnd.rows, batch)]
        if rnd.drafted:  # committed on the device at launch: the host learns the counts (idle rows: 0)
            engine.settle([len(path) if stay else 0 for path, stay in zip(paths, stays)])
        seconds = (next_started or time.perf_counter()) - rnd.started  # (the read has waited for verification)
        if curve is not None and rnd.drafted and rnd.timed:
            curve.observe(seconds, rnd.width, rnd.chosen)
        if drafting is not None:
            kept = [len(new) for new, run in zip(news, rnd.running) if run]
            drafting.observe(rnd.drafted, seconds, sum(kept) / max(1, len(kept)), rnd.timed)
        stages.mark("commit")
        step = []
        now = time.perf_counter()
        for r, (row, path, new, stay) in enumerate(zip(rnd.rows, paths, news, stays)):
            if not stay or row.res.finish_reason:  # (a lagged round may follow a row's last one)
                continue
            new = row.extend(new)
            if top is not None:  # the m-th new token was chosen at node path[m]
                row.res.top += [(top[0][r][j], top[1][r][j]) for j in path[:len(new)]]
            row.res.accept_lengths.append(len(new))
            if drafting is not None:
                row.res.draft_sizes.append(rnd.width - 1)
            row.res.decode_seconds = now - row.t1
            if profile:
                row.res.stage_seconds = dict(stages.seconds)
            step.append((row.index, new, row.res))
        return step

    def live() -> list[bool]:  # the rows to decode in the next round
        return [row is not None and not row.res.finish_reason and not cancelled(row.index) for row in batch]

    curve, drafting = None, None
    if cost_aware and method != "ar":
        # Measured once per engine, method and batch size; what the rounds learnt carries over to
        # the engine's next streams (a short answer must not pay for learning it again).
        key = (method, budget, engine.batch)
        if key not in engine.cost_state:
            top = B if method == "dflash" else budget + 1
            engine.cost_state[key] = (cost.measure(engine, sorted({w for w in (1, 2, 4, 8, 16, 32, 64, top) if w <= top})),
                                      cost.Drafting())
            for row in filter(None, batch):  # the measurement is not decoding time
                row.t1 = time.perf_counter()
        curve, drafting = engine.cost_state[key]
    while True:
        if inflight is not None and inflight.read.ready():  # reading it waits for nothing (the host is the
            step, inflight = finish(inflight), None  # slower side): read it now, so that no round runs past a row's end
            yield step
        running = live()
        if inflight is not None and (not any(running) or not engine.fixed_rows and (admit is not None or not all(running))):
            step, inflight = finish(inflight), None  # what runs next, or leaves the batch, depends on it
            yield step
            continue
        joining = list(admit(sum(running))) if admit is not None else []
        if inflight is not None and len(joining) > running.count(False):  # rows that ended in it may
            step, inflight = finish(inflight), None  # make room (appending needs settled rounds)
            yield step
            running = live()
        if not any(running) and not joining:
            break
        if not all(running) and not engine.fixed_rows:  # finished rows leave the batch
            keep = [k for k, r in enumerate(running) if r]
            engine.keep_rows(keep)
            bonus = bonus[torch.tensor(keep, dtype=torch.long, device=dev)]
            batch, running = [batch[k] for k in keep], [True] * len(keep)
        if joining:
            idle = [k for k, r in enumerate(running) if not r]  # only on a fixed-rows engine
            places = (idle + list(range(len(batch), len(batch) + len(joining))))[:len(joining)]
            new, first, step = _start(engine, joining, admitted, method, budget,
                                      lambda ps, room: engine.join(ps, places, capacity=room), record_top)
            admitted += len(joining)
            bonus = torch.cat([bonus, first[len(idle):]])  # appended rows come after the idle ones
            bonus[torch.tensor(places, device=dev)] = first
            running += [False] * (len(places) - len(idle))
            for k, row in zip(places, new):
                batch[k:k + 1] = [row]  # replaces an idle row, or appends
                running[k] = not row.res.finish_reason
            yield step
            if not any(running):  # every joining request ended at its first token
                continue
        stages.start()
        t_round = time.perf_counter()
        drafted = method != "ar" and (drafting is None or drafting.choose())
        scored = curve is not None and len(curve.candidates()) > 1  # cost-aware: the tree's scores are read
        draft = engine.draft(bonus, None if method == "dflash" else budget, top_k, scored) if drafted else None
        stages.mark("draft")
        trees, tokens, depths, anc = _trees(draft, bonus, curve, empty)
        stages.mark("tree")
        logits = engine.verify(tokens, depths, anc)  # [b, q, V]
        picked = row_tokens(logits, [row.request.sampling if row else GREEDY for row in batch],
                            [row.gen if row else None for row in batch])  # [b, q]
        stages.mark("verify")
        chain = method != "ddtree" or not drafted
        walked = walk(trees, anc, picked, chain)  # on the device: the next bonus stays there
        bonus = walked.bonus
        read = HostCopy(torch.cat([walked.accepted[:, None], walked.path, walked.new], 1))  # the round's one transfer
        rnd = _Round(list(batch), running, read, logits if record_top else None, tokens.shape[1], chain, t_round, drafted,
                     not (drafted and engine.caught_up), drafted and scored)
        if not drafted:  # each running row keeps its one node
            engine.commit([range(1) if run else range(0) for run in running], context=method != "ar")
        else:  # each row's path as the walk left it on the device: the next round can queue behind
            if running_t is None or running_t[0] != running:
                running_t = (list(running), to_device([int(r) for r in running], dev))
            engine.commit_walk(walked, running_t[1], chain)
        if not lag or (drafted and scored):  # (a round that read its draft's scores waited for the device)
            if inflight is not None:
                yield finish(inflight, t_round)
                inflight = None
            yield finish(rnd)
            continue
        if inflight is not None:  # the last round's tokens, read while this one runs on the device
            yield finish(inflight, t_round)
        inflight = rnd


def generate_batch(engine: Engine, prompts: Sequence[Tensor], **kw: Any) -> list[Generation]:
    """`finished` to the end: one finished `Generation` per prompt, in order."""
    out = dict(finished(engine, prompts, **kw))
    return [out[i] for i in range(len(prompts))]


def finished(engine: Engine, prompts: Sequence[Tensor], *, rows: int | None = None, refill: float = 0.25,
             **kw: Any) -> Iterator[tuple[int, Generation]]:
    """`decode_stream` over every prompt -> (prompt index, its finished `Generation`) as each ends
    (rows that a `cancelled` keyword stopped come last, unfinished).

    rows: decode at most this many prompts at once; a finished row's place goes to the next
    prompt once `refill` of the rows are free (continuous batching). Joins come in groups because
    the running rows wait for each join's prefill; a batch that only ran to its longest row would
    leave most rows idle when lengths vary (sampled messages, answers that stop early)."""
    n = len(prompts)
    if rows is not None and n > rows:
        requests = _requests(prompts, kw.pop("max_new_tokens"), kw.pop("sampling", None),
                             kw.pop("stop_ids", frozenset()))
        queue = iter(requests[rows:])
        group = max(1, int(rows * refill))

        def admit(running: int) -> list[Request]:  # stream indices follow the prompts' order
            free = rows - running
            return [] if running and free < group else [r for _, r in zip(range(free), queue)]

        first = requests[:rows]
        kw.update(admit=admit, rows=rows, max_new_tokens=[r.max_new_tokens for r in first],
                  sampling=[r.sampling for r in first], stop_ids=[r.stop_ids for r in first])
        prompts = [r.prompt for r in first]
    unfinished: dict[int, Generation] = {}
    for step in decode_stream(engine, prompts, **kw):
        for i, _, g in step:
            if g.finish_reason:
                unfinished.pop(i, None)
                yield i, g
            else:
                unfinished[i] = g
    yield from unfinished.items()  # rows that `cancelled` stopped


def generate(engine: Engine, prompt_ids: Tensor, **kw: Any) -> Generation:
    """One prompt ([1, T] or [T]) to the end: its finished `Generation`."""
    if prompt_ids.ndim == 2 and prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids: expected shape [1, T] or [T], got {tuple(prompt_ids.shape)}; "
                         "use generate_batch for several prompts")
    return generate_batch(engine, [prompt_ids], **kw)[0]


def make_engine(target: Any, drafter: Any, kind: str = "auto", draft_tokens: int | None = None) -> Engine:
    """'hf' (any Transformers model); 'static' (own layers, CUDA graphs on CUDA); or 'auto': for
    the targets the static runner supports, on CUDA static + torch.compile of the layer functions
    and of the drafter's step + fused q/k/v and gate/up weights, on a CPU static (with oneDNN's
    packed weights in fp32, and a bf16 copy of the drafter where `bf16_drafting`): the fastest
    measured on each (docs/benchmarks.md); else hf. Hybrids
    with linear attention always run on the static runner (Transformers' layers cannot roll their
    state back). draft_tokens: tokens drafted a round (default: the drafter's block less the
    bonus; fewer can pay where a round's cost grows with its tokens, docs/serving.md)."""
    if kind not in ("auto", "hf", "static"):
        raise ValueError(f"engine: expected 'auto', 'hf' or 'static', got {kind!r}")
    if kind == "hf" or (kind == "auto" and supported(target) is not None and "linear_attention" not in target.layer_kinds):
        return Engine(target, drafter, draft_tokens=draft_tokens)
    gpu = kind == "auto" and target.device.type == "cuda"
    bf16 = kind == "auto" and drafter is not None and bf16_drafting(target)
    return static_engine(target, drafter, compile=gpu, compile_drafter=gpu, draft_dtype=torch.bfloat16 if bf16 else None,
                         draft_tokens=draft_tokens)


def bf16_drafting(target: Any) -> bool:
    """Whether the drafter of an fp32 target on this CPU runs faster in bf16: where the CPU has
    bf16 matrix units (AMX or AVX-512 BF16), a draft reads half the bytes (SmolLM2's bundled
    drafter on 2 cores: 25 against 32-35 ms a draft; over the demo's suites the same DFlash τ,
    DDTree-64's 2.69 against 2.70). Lossless all the same: the fp32 target verifies every token."""
    has = [getattr(torch.cpu, f, lambda: False) for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return target.device.type == "cpu" and target.dtype == torch.float32 and any(f() for f in has)


class DecodingGenerator:
    """The server's generator (`generation.BatchedGenerator`): requests decoded by the round loop,
    one chunk per round; each request keeps its own sampling parameters, seed and token limit.
    Speculative methods add their acceptance statistics to the usage block. rows: the server's
    largest batch (`decode_stream`'s `rows`: one batch size, one set of CUDA graphs). cost_aware:
    `decode_stream`'s (rounds draft only while drafting pays at the batch's size)."""

    def __init__(self, engine: Engine, *, method: str = "dflash", budget: int | None = None, top_k: int | None = TOP_K,
                 rows: int | None = None, cost_aware: bool = False) -> None:
        check_request(method, 1, engine.drafter, budget, top_k)
        self.engine, self.method, self.budget, self.top_k, self.rows = engine, method, budget, top_k, rows
        self.cost_aware = cost_aware
        self.label = None if method == "ar" else method if method != "ddtree" else f"ddtree-{budget}"

    def warm_up(self, prompt: Sequence[int]) -> None:
        """Decode `prompt` on every row for a few rounds, untimed and unreported: on an engine with
        CUDA graphs, the layer functions are compiled and the rounds' graphs captured before the
        first request, instead of stalling it (and every request that joins) for tens of seconds."""
        if not self.engine.fixed_rows:
            return
        B = self.engine.block
        rows, n = self.rows or 1, 3 * B + 1
        # The room of a request without a token limit whose prompt fits a span of slots, so that
        # it need not grow the caches and drop the graphs captured here.
        span, positions = self.engine.slot_bucket, self.engine.target.max_positions
        self.engine.reserve(_room(span, positions - span if positions else RESERVE, self.budget, B))
        # Once long enough to cross into the second span of slots (a compiled step that
        # specialised on the first span recompiles here, not under a request), then as given:
        # last, so that its graphs are captured over the caches as the long prompt left them.
        long = [prompt[i % len(prompt)] for i in range(max(1, self.engine.slot_bucket - B))]
        for p in (long, list(prompt)):
            generate_batch(self.engine, [torch.tensor(p)] * rows, max_new_tokens=n, method=self.method,
                           budget=self.budget, top_k=self.top_k, cost_aware=self.cost_aware)
        self.engine.warm_joins(rows)  # and the prefills of requests that join a running batch

    def generate_batch(self, requests: Sequence[tuple[list[int], dict[str, Any]]],
                       cancelled: Callable[[int], bool] = lambda i: False,
                       admit: Callable[[int], Sequence[tuple[list[int], dict[str, Any]]]] | None = None,
                       ) -> Iterator[list[tuple[int, GenerationChunk]]]:
        """requests: (input ids, `generate` keyword arguments). Yields (request index, chunk) per
        round. admit: continuous batching (`decode_stream`'s `admit`), requests in the same form,
        numbered on from `requests`. A finished request's stats carry `batch_size`: the rows of
        the batch in its last round."""
        def convert(items: Sequence[tuple[list[int], dict[str, Any]]]) -> list[Request]:
            return [Request(torch.tensor(ids), kw["max_new_tokens"],
                            Sampling(kw["temperature"], kw["top_p"], kw["seed"]), kw["stop_ids"]) for ids, kw in items]

        first = convert(requests)
        steps = decode_stream(
            self.engine, [r.prompt for r in first], method=self.method, budget=self.budget, top_k=self.top_k,
            max_new_tokens=[r.max_new_tokens for r in first], sampling=[r.sampling for r in first],
            stop_ids=[r.stop_ids for r in first], cancelled=cancelled, rows=self.rows, cost_aware=self.cost_aware,
            admit=None if admit is None else lambda running: convert(admit(running)))
        for step in steps:
            stats = {"batch_size": self.engine.batch}
            yield [(i, GenerationChunk(new, g.finish_reason, {**usage_stats(g, self.label), **stats})
                    if g.finish_reason else GenerationChunk(new)) for i, new, g in step]

    def generate(self, input_ids: list[int], **kw: Any) -> Iterator[GenerationChunk]:
        for step in self.generate_batch([(input_ids, kw)]):
            yield step[0][1]
