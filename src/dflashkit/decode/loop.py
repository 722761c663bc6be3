"""The scheduler around the round: streams of requests decoded by `round.speculative_round`.

`decode_stream` runs one `_Stream`: it prefills the requests, launches rounds, reads each round's
tokens on the host and extends each row's answer. Around the round it owns three things:

  admissions   requests that join a running batch (`admit`: continuous batching), and rows that
               leave it (finished or cancelled);
  late reads   round k+1 is launched before round k's tokens are read whenever they have not
               reached the host yet, so the device never waits for the host's per-row Python;
  sizing       cost-aware decoding (`decode/cost.py`): whether a round drafts, and how much of
               its draft it verifies.

τ (acceptance length) of a round = accepted draft tokens + 1 (the target's token at the end of
the path), 1 <= τ <= B. The final round counts only tokens up to the stop token or the token
limit (named convention: it makes online τ equal offline τ from cached features).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from dflashkit.decode import cost
from dflashkit.decode.engine import Engine
from dflashkit.decode.generation import Generation, GenerationChunk, Sampling, new_generator, usage_stats
from dflashkit.decode.round import Batch, Request, Round, Row, Stages, row_tokens, speculative_round
from dflashkit.decode.static import static_engine, supported
from dflashkit.method import DEFAULT_ACCEPTANCE, TOP_K, Method

RESERVE = 2048  # answer tokens the caches make room for at the start

Admit = Callable[[int], Sequence[Request]]  # rows running -> requests that join the batch now
Step = list[tuple[int, list[int], Generation]]  # one yield of the stream: (index, new tokens, Generation) per row


def check_request(method: Method, max_new_tokens: int, drafter: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if method.drafts and drafter is None:
        raise ValueError(f"method {method.kind!r} needs a drafter; use method 'ar' without one")


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


def _top(logits: Tensor, k: int) -> tuple[list, list]:
    """logits [b, q, V] -> the top-k ids and logits, [b][q][k] lists on the host."""
    values, ids = logits.float().topk(k, dim=-1)
    return ids.tolist(), values.tolist()


def _room(prompt: int, limit: int, method: Method, B: int) -> int:
    """Cache positions a request reserves: its prompt and its answer up to a few thousand tokens
    (`RESERVE`), and a round's draft. The caches grow beyond that only if the answer does (a
    request without a token limit must not reserve the model's whole context)."""
    return prompt + min(limit, RESERVE) + (method.tree_budget or 0) + 2 * B


class _Stream:
    """One stream of requests over an engine: rows admitted, rounds launched (`speculative_round`)
    and read, a round late where the host would otherwise hold the device up."""

    def __init__(self, engine: Engine, method: Method, cancelled: Callable[[int], bool], record_top: int,
                 profile: bool) -> None:
        self.engine, self.method, self.cancelled, self.record_top = engine, method, cancelled, record_top
        self.stages = Stages(profile, engine.target.device)
        # A round needs nothing from the host to launch the next one (the walk, the commit and the
        # next bonus stay on the device), so the host reads a round's tokens while the next runs,
        # unless they have already arrived (the host being the slower side, as for a small
        # target): then it reads them first, and never runs a round past every row's end.
        # Profiling and recording read every round at once.
        self.lag = not (record_top or profile)
        self.inflight: Round | None = None
        self.sizing: cost.Sizing | None = None
        self.admitted = 0  # requests so far: the next one's index
        self.batch = Batch([], torch.zeros(0, dtype=torch.long))

    def prefill(self, requests: Sequence[Request], prefill: Callable[[list[Tensor], int], Tensor]
                ) -> tuple[list[Row], Tensor, Step]:
        """Prefill `requests` (numbered on from `admitted`) through `prefill(prompts, capacity)`
        -> their rows, first tokens on the device [m] and the stream step that reports them."""
        engine = self.engine
        for r in requests:
            check_request(self.method, r.max_new_tokens, engine.drafter)
        limits = [r.max_new_tokens for r in requests]
        if engine.target.max_positions:  # the answer ends where the model's positions do
            limits = [min(lim, engine.target.max_positions - len(r.prompt)) for lim, r in zip(limits, requests)]
        gens = [new_generator(r.sampling) for r in requests]
        t0 = time.perf_counter()
        room = max(_room(len(r.prompt), m, self.method, engine.block) for r, m in zip(requests, limits))
        logits = prefill([r.prompt for r in requests], room)
        bonus = row_tokens(logits[:, None], [r.sampling for r in requests], gens)[:, 0]  # [m], stays on the device
        tokens = bonus.tolist()  # waits for the prefill: time to first token is honest on CUDA too
        t1 = time.perf_counter()
        rows = [Row(self.admitted + j, r, lim, g, Generation([], [], "", len(r.prompt), t1 - t0, 0.0), t1)
                for j, (r, lim, g) in enumerate(zip(requests, limits, gens))]
        self.admitted += len(requests)
        if self.record_top:
            ids, values = _top(logits[:, None], self.record_top)
            for j, row in enumerate(rows):
                row.res.top.append((ids[j][0], values[j][0]))
        return rows, bonus, [(row.index, row.extend([t]), row.res) for row, t in zip(rows, tokens)]

    def start(self, requests: Sequence[Request], rows: int | None) -> Step:
        """The first requests' prefill; on a `fixed_rows` engine, `rows` places from the start
        (idle ones: one-token prompts that never decode)."""
        engine, n = self.engine, len(requests)
        batch, bonus, step = self.prefill(requests, lambda ps, room: engine.prefill(ps, capacity=room))
        self.batch = Batch(list(batch), bonus)
        if rows and engine.fixed_rows and rows > n:
            engine.join([torch.zeros(1, dtype=torch.long)] * (rows - n), range(n, rows), capacity=0)
            self.batch.rows += [None] * (rows - n)
            self.batch.bonus = torch.cat([bonus, bonus.new_zeros(rows - n)])
        return step

    def size(self) -> None:
        """Cost-aware decoding: the engine's `Sizing` for this method and batch size, measured the
        first time (the measurement is not decoding time)."""
        if not self.method.drafts:
            return
        key = (self.method.kind, self.method.budget, self.engine.batch)
        self.sizing, measured = cost.sizing(self.engine, key, self.method.widest(self.engine.block))
        if measured:
            for row in filter(None, self.batch.rows):
                row.t1 = time.perf_counter()

    def live(self) -> list[bool]:
        """The rows to decode in the next round."""
        return [row is not None and not row.res.finish_reason and not self.cancelled(row.index)
                for row in self.batch.rows]

    def read(self, rnd: Round, next_started: float | None = None) -> Step:
        """A launched (and committed) round's host side: read each row's path and tokens, tell
        the engine the counts, let cost-aware sizing learn from it, extend each row's answer ->
        the stream step. A round's time runs to the launch of the next (`next_started`, when that
        came first: read a round late, a round costs the interval between launches) or to now."""
        host, w = rnd.read(), rnd.width
        # a chain's path is nodes 0..accepted; new tokens: the accepted draft tokens (equal to the
        # target's), then its next one
        paths: list[Sequence[int]] = [range(h[0] + 1) if rnd.chain else h[1:h[0] + 2] for h in host]
        news = [h[1 + w:2 + w + h[0]] for h in host]
        # A row whose place a join took after the launch: its lengths are the newcomer's (count 0)
        stays = [run and now is row for run, row, now in zip(rnd.running, rnd.rows, self.batch.rows)]
        if rnd.drafted:  # committed on the device at launch: the host learns the counts (idle rows: 0)
            self.engine.settle([len(path) if stay else 0 for path, stay in zip(paths, stays)])
        if self.sizing is not None:
            seconds = (next_started or time.perf_counter()) - rnd.started  # (the read has waited for verification)
            if rnd.drafted and rnd.timed:
                self.sizing.curve.observe(seconds, rnd.width, rnd.chosen)
            kept = [len(new) for new, run in zip(news, rnd.running) if run]
            self.sizing.drafting.observe(rnd.drafted, seconds, sum(kept) / max(1, len(kept)), rnd.timed)
        self.stages.mark("commit")
        return self.report(rnd, paths, news, stays)

    def report(self, rnd: Round, paths: list[Sequence[int]], news: list[list[int]], stays: list[bool]) -> Step:
        """Each running row's answer extended by a read round's tokens -> the stream step."""
        top = _top(rnd.logits, self.record_top) if self.record_top else None
        step = []
        now = time.perf_counter()
        for r, (row, path, new, stay) in enumerate(zip(rnd.rows, paths, news, stays)):
            if not stay or row.res.finish_reason:  # (a lagged round may follow a row's last one)
                continue
            new = row.extend(new)
            if top is not None:  # the m-th new token was chosen at node path[m]
                row.res.top += [(top[0][r][j], top[1][r][j]) for j in path[:len(new)]]
            row.res.accept_lengths.append(len(new))
            if self.sizing is not None:
                row.res.draft_sizes.append(rnd.width - 1)
            row.res.decode_seconds = now - row.t1
            if self.stages.on:
                row.res.stage_seconds = dict(self.stages.seconds)
            step.append((row.index, new, row.res))
        return step

    def read_inflight(self, next_started: float | None = None) -> Step:
        rnd, self.inflight = self.inflight, None
        return self.read(rnd, next_started)

    def join(self, joining: Sequence[Request]) -> Step:
        """`joining` into the batch (`Engine.join`): into idle places of a `fixed_rows` engine,
        else appended -> the step that reports their first tokens."""
        batch, running = self.batch, self.batch.running
        idle = [k for k, r in enumerate(running) if not r]  # only on a fixed-rows engine
        places = (idle + list(range(len(batch.rows), len(batch.rows) + len(joining))))[:len(joining)]
        new, first, step = self.prefill(joining, lambda ps, room: self.engine.join(ps, places, capacity=room))
        batch.bonus = torch.cat([batch.bonus, first[len(idle):]])  # appended rows come after the idle ones
        batch.bonus[torch.tensor(places, device=batch.bonus.device)] = first
        running += [False] * (len(places) - len(idle))
        for k, row in zip(places, new):
            batch.rows[k:k + 1] = [row]  # replaces an idle row, or appends
            running[k] = not row.res.finish_reason
        return step

    def drop_finished(self) -> None:
        """Rows that stopped leave the batch (an engine without fixed rows)."""
        batch = self.batch
        keep = [k for k, r in enumerate(batch.running) if r]
        self.engine.keep_rows(keep)
        batch.bonus = batch.bonus[torch.tensor(keep, dtype=torch.long, device=batch.bonus.device)]
        batch.rows, batch.running = [batch.rows[k] for k in keep], [True] * len(keep)

    def rounds(self, admit: Admit | None) -> Iterator[Step]:
        """Rounds until no row runs and `admit` brings none. A round in flight is read first when
        its tokens are already on the host, or when what comes next depends on them: the rows that
        run (appending or dropping rows needs settled rounds), or room for the requests joining."""
        fixed = self.engine.fixed_rows
        while True:
            if self.inflight is not None and self.inflight.read.ready():  # reading it waits for nothing
                yield self.read_inflight()
            self.batch.running = running = self.live()
            if self.inflight is not None and (not any(running) or not fixed and (admit is not None or not all(running))):
                yield self.read_inflight()
                continue
            joining = list(admit(sum(running))) if admit is not None else []
            if self.inflight is not None and len(joining) > running.count(False):  # rows that ended in it
                yield self.read_inflight()  # may make room
                self.batch.running = running = self.live()
            if not any(running) and not joining:
                break
            if not all(running) and not fixed:
                self.drop_finished()
            if joining:
                yield self.join(joining)
                if not any(self.batch.running):  # every joining request ended at its first token
                    continue
            rnd = speculative_round(self.engine, self.batch, self.method, self.sizing, self.stages,
                                    keep_logits=bool(self.record_top))
            if not self.lag or rnd.chosen:  # (a round that read its draft's scores waited for the device)
                if self.inflight is not None:
                    yield self.read_inflight(rnd.started)
                yield self.read(rnd)
                continue
            if self.inflight is not None:  # the last round's tokens, read while this one runs on the device
                yield self.read_inflight(rnd.started)
            self.inflight = rnd


@torch.no_grad()
def decode_stream(
    engine: Engine,
    prompts: Sequence[Tensor],  # b x [T_i] or [1, T_i]
    *,
    max_new_tokens: int | Sequence[int],
    method: str | Method = "dflash",
    budget: int | None = None,
    top_k: int | None = TOP_K,
    acceptance: str = DEFAULT_ACCEPTANCE,
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

    method: a `Method`, or its kind 'ar' (no drafter), 'dflash' (one chain of B-1 argmax tokens),
    'ddtree' (a tree of `budget` nodes from the top-`top_k` tokens of each slot; None: `budget` of
    them). acceptance: how sampled rounds accept (`method.Acceptance`; 'rejection': drafts drawn
    from the drafter's distributions, `decode/accept.py`); ignored where `method` is a `Method`.
    Unless profiling or recording, a round whose tokens have not reached the host yet is read a
    round late, the next one already
    running on the device (except a cost-aware round that read its draft's scores, and, with
    `admit`, on an engine without fixed rows): a row's end is then seen a round after it, and
    that round's tokens for the row are dropped. cost_aware: measure what verification costs
    here, then verify per round only the draft prefix that maximises expected tokens per second,
    and draft at all only while drafting rounds give more tokens per second than autoregressive
    ones (`decode/cost.py`; both kept on the engine per method and batch size);
    the sizes chosen (0: no draft) go to `Generation.draft_sizes`.
    record_top: keep, per output token, the target's top-`record_top` ids and logits of the pass
    that chose it (`Generation.top`; one more host transfer per round)."""
    method = Method.of(method, budget, top_k, acceptance)
    check_request(method, 1, engine.drafter)
    stream = _Stream(engine, method, cancelled, record_top, profile)
    yield stream.start(_requests(prompts, max_new_tokens, sampling, stop_ids), rows)
    if cost_aware:
        stream.size()
    yield from stream.rounds(admit)


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


def make_engine(target: Any, drafter: Any, kind: str = "auto", draft_tokens: int | None = None,
                confidence: bool = True) -> Engine:
    """'hf' (any Transformers model); 'static' (own layers, CUDA graphs on CUDA); or 'auto': for
    the targets the static runner supports, on CUDA static + torch.compile of the layer functions
    and of the drafter's step + fused q/k/v and gate/up weights, on a CPU static (with oneDNN's
    packed weights in fp32, and a bf16 copy of the drafter where `bf16_drafting`): the fastest
    measured on each (docs/benchmarks.md); else hf. Hybrids
    with linear attention always run on the static runner (Transformers' layers cannot roll their
    state back). draft_tokens: tokens drafted a round (default: the drafter's block less the
    bonus; fewer can pay where a round's cost grows with its tokens, docs/serving.md). confidence:
    whether a drafter's confidence head scores its drafts (`Engine`)."""
    if kind not in ("auto", "hf", "static"):
        raise ValueError(f"engine: expected 'auto', 'hf' or 'static', got {kind!r}")
    if kind == "hf" or (kind == "auto" and supported(target) is not None and "linear_attention" not in target.layer_kinds):
        return Engine(target, drafter, draft_tokens=draft_tokens, confidence=confidence)
    gpu = kind == "auto" and target.device.type == "cuda"
    bf16 = kind == "auto" and drafter is not None and bf16_drafting(target)
    return static_engine(target, drafter, compile=gpu, compile_drafter=gpu, draft_dtype=torch.bfloat16 if bf16 else None,
                         draft_tokens=draft_tokens, confidence=confidence)


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
    `decode_stream`'s (rounds draft only while drafting pays at the batch's size); acceptance:
    `decode_stream`'s."""

    def __init__(self, engine: Engine, *, method: str | Method = "dflash", budget: int | None = None,
                 top_k: int | None = TOP_K, rows: int | None = None, cost_aware: bool = False,
                 acceptance: str = DEFAULT_ACCEPTANCE) -> None:
        self.method = Method.of(method, budget, top_k, acceptance)
        check_request(self.method, 1, engine.drafter)
        self.engine, self.rows, self.cost_aware = engine, rows, cost_aware

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
        self.engine.reserve(_room(span, positions - span if positions else RESERVE, self.method, B))
        # Once long enough to cross into the second span of slots (a compiled step that
        # specialised on the first span recompiles here, not under a request), then as given:
        # last, so that its graphs are captured over the caches as the long prompt left them.
        long = [prompt[i % len(prompt)] for i in range(max(1, self.engine.slot_bucket - B))]
        for p in (long, list(prompt)):
            generate_batch(self.engine, [torch.tensor(p)] * rows, max_new_tokens=n, method=self.method,
                           cost_aware=self.cost_aware)
        if self.method.acceptance == "rejection":  # sampled rounds run the rule's own graphs: with top-p and without
            for top_p in (1.0, 0.9):
                generate_batch(self.engine, [torch.tensor(prompt)] * rows, max_new_tokens=B + 1, method=self.method,
                               cost_aware=self.cost_aware, sampling=[Sampling(1.0, top_p, 0)] * rows)
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
            self.engine, [r.prompt for r in first], method=self.method,
            max_new_tokens=[r.max_new_tokens for r in first], sampling=[r.sampling for r in first],
            stop_ids=[r.stop_ids for r in first], cancelled=cancelled, rows=self.rows, cost_aware=self.cost_aware,
            admit=None if admit is None else lambda running: convert(admit(running)))
        for step in steps:
            stats = {"batch_size": self.engine.batch}
            yield [(i, GenerationChunk(new, g.finish_reason, {**usage_stats(g, self.method.label), **stats})
                    if g.finish_reason else GenerationChunk(new)) for i, new, g in step]

    def generate(self, input_ids: list[int], **kw: Any) -> Iterator[GenerationChunk]:
        for step in self.generate_batch([(input_ids, kw)]):
            yield step[0][1]
