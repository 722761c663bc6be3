"""Continuous batching in groups (`serve.Admission`): when waiting requests join a running batch.

The policy is a pure function of rows running, the batch size and the oldest request's wait; the
server's worker is driven here round by round with a fake clock (blocking hand-offs between the
test and the generator, no sleeps, nothing timed), and over the real round loop on a tiny random
target the streams of requests that join a running batch in groups are what each decodes alone."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import queue

import pytest

from datahelpers import one_thread  # noqa: F401
from dflashkit.decode.generation import GenerationChunk
from dflashkit.serve import Admission, BatchWorker, add_arguments, admission_from_args

pytestmark = pytest.mark.usefixtures("one_thread")
WAIT = 30  # seconds a hand-off may take before the test fails (a hung worker, not a timing)


def test_admission_policy():
    grouped = Admission(min_free=4, max_wait_s=0.1)
    assert not grouped.due(running=5, max_batch=8, waited_s=None)  # nobody waits
    assert not grouped.due(5, 8, 0.0) and not grouped.due(5, 8, 0.099)  # 3 free rows, a fresh request
    assert grouped.due(5, 8, 0.1)  # it has waited the bound
    assert grouped.due(4, 8, 0.0)  # 4 rows free
    assert grouped.due(0, 8, 0.0)  # nothing runs
    assert not grouped.due(8, 8, 10.0) and not grouped.due(9, 8, 10.0)  # no free row, however long it waited
    assert Admission(min_free=2, max_wait_s=math.inf).due(6, 8, 1e9)  # no time bound: rows alone decide
    assert not Admission(min_free=3, max_wait_s=math.inf).due(6, 8, 1e9)
    every = Admission()  # join at every round that has a free row
    assert every.due(7, 8, 0.0) and not every.due(8, 8, 0.0) and not every.due(7, 8, None)
    for bad in (dict(min_free=0), dict(max_wait_s=-1.0), dict(max_wait_s=math.nan)):
        with pytest.raises(ValueError, match="Admission"):
            Admission(**bad)


def test_admission_flags():
    def parse(*argv: str) -> Admission:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return admission_from_args(p.parse_args(list(argv)))

    assert parse("--max-batch", "64") == Admission(16, 0.1)  # a quarter of the batch, 100 ms
    assert parse("--max-batch", "3") == parse() == Admission(1, 0.1)
    assert parse("--max-batch", "64", "--join-min-free", "1", "--join-max-wait-ms", "0") == Admission(1, 0.0)
    with pytest.raises(ValueError, match="--join-min-free"):
        parse("--join-min-free", "0")
    with pytest.raises(ValueError, match="--join-max-wait-ms"):
        parse("--join-max-wait-ms", "-5")


class Rounds:
    """A batched generator that the test drives: per round it takes from `go` how many of its
    oldest rows finish, ends them, asks `admit` with the rows still running and puts the number
    of requests that joined on `joined` (after the first batch's size, when it starts)."""

    def __init__(self) -> None:
        self.go: queue.Queue[int] = queue.Queue()
        self.joined: queue.Queue[int] = queue.Queue()

    def generate_batch(self, requests, cancelled, admit=None):
        rows, n = list(range(len(requests))), len(requests)
        self.joined.put(n)
        while rows:
            finish = self.go.get(timeout=WAIT)
            done, rows = rows[:finish], rows[finish:]
            yield [(i, GenerationChunk([7], "length", {})) for i in done]
            new = admit(len(rows))
            rows += range(n, n + len(new))
            n += len(new)
            self.joined.put(len(new))


def test_waiting_requests_join_in_groups():
    """`max_batch` 4, a join when 2 rows are free or the oldest has waited 0.1 s (fake clock)."""
    gen, now = Rounds(), [0.0]

    async def scenario() -> None:
        engine = BatchWorker(gen, max_batch=4, admission=Admission(min_free=2, max_wait_s=0.1), clock=lambda: now[0])
        jobs = [engine.submit([1, 2], max_new_tokens=1)]
        joined = lambda finish: (gen.go.put(finish), gen.joined.get(timeout=WAIT))[1]  # noqa: E731  one round
        assert gen.joined.get(timeout=WAIT) == 1  # the batch starts with the first request
        jobs += [engine.submit([3], max_new_tokens=1) for _ in range(4)]
        assert joined(0) == 3  # 3 rows free: three join at once, the fifth waits for a row
        assert joined(0) == 0  # no free row
        assert joined(1) == 0  # one row free, the fifth has waited 0 s
        now[0] = 0.1
        assert joined(0) == 1  # it has waited 0.1 s: it takes the free row
        jobs += [engine.submit([4], max_new_tokens=1) for _ in range(2)]
        assert joined(1) == 0  # one row free, both have waited 0 s
        assert joined(1) == 2  # two rows free: both join together
        assert engine.jobs.qsize() == 0
        assert joined(4) == 0  # every row ends, nobody waits: the batch's stream ends
        for job in jobs:  # every request got its whole (one-chunk) stream, then its end
            chunk = await asyncio.wait_for(job.out.get(), WAIT)
            assert chunk.token_ids == [7] and chunk.finish_reason == "length"
            assert await asyncio.wait_for(job.out.get(), WAIT) is None
        assert engine.counters == {"completed": 7, "cancelled": 0}
        engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("graphs,cost_aware", [(False, False), (True, False), (False, True)])
def test_grouped_joins_over_the_round_loop(graphs, cost_aware, monkeypatch):
    """The real round loop (tiny random target and drafter, DFlash): requests submitted while a
    batch runs join it in groups (with no time bound, only when 2 rows are free or nothing
    runs), and each stream, complete, is what the request decodes alone; whatever round each
    arrives in, no request is lost. graphs: the CUDA-graph engine's fixed rows (graphs counted on
    CPU): the stream that starts with one request holds the server's 3 rows from the start, so
    one set of graphs serves it. cost_aware: rounds with and without a draft alternate (joins
    land between either kind)."""
    import torch

    from conftest import make_tiny_drafter, make_tiny_target
    from dflashkit.decode.engine import Engine as Decoder
    from dflashkit.decode.loop import DecodingGenerator, generate
    from test_static_engine import _counting_engine

    from dflashkit.decode import cost

    if cost_aware:
        calls = itertools.count()
        monkeypatch.setattr(cost.Drafting, "choose", lambda self: next(calls) % 3 != 1)
    captures: dict[str, int] = {}
    decoder = _counting_engine(monkeypatch, captures) if graphs else None
    target = decoder.target if graphs else make_tiny_target()
    drafter = decoder.drafter if graphs else make_tiny_drafter(target)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21], [22, 23], [24, 25, 26]]
    limits = [40, 6, 9, 12, 5, 8, 11]
    params = lambda n: dict(max_new_tokens=n, temperature=0.0, top_p=1.0, seed=None, stop_ids=set())  # noqa: E731

    async def serve() -> list[list[int]]:
        engine = BatchWorker(DecodingGenerator(decoder or Decoder(target, drafter), rows=3, cost_aware=cost_aware), max_batch=3,
                        admission=Admission(min_free=2, max_wait_s=math.inf))
        jobs = [engine.submit(prompts[0], **params(limits[0]))]
        first = await asyncio.wait_for(jobs[0].out.get(), WAIT)  # the long request decodes
        jobs += [engine.submit(p, **params(n)) for p, n in zip(prompts[1:], limits[1:])]
        streams = [list(first.token_ids)] + [[] for _ in prompts[1:]]
        for job, stream in zip(jobs, streams):
            while (chunk := await asyncio.wait_for(job.out.get(), WAIT)) is not None:
                assert not isinstance(chunk, Exception), chunk
                stream += chunk.token_ids
        assert engine.counters == {"completed": len(prompts), "cancelled": 0}
        engine.close()
        return streams

    streams = asyncio.run(serve())
    if graphs:
        assert captures == {"_step": 1, "_draft_step": 1}, captures
    for p, n, got in zip(prompts, limits, streams):
        alone = generate(Decoder(target, drafter), torch.tensor(p), max_new_tokens=n)
        assert got == alone.tokens and len(got) == n
