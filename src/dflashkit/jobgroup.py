"""The process group of a torchrun job: joined afresh after a restart, with a collective timeout,
and a heartbeat that names a rank that does not arrive.

torchrun's agent keeps one TCPStore for the whole job (the default rendezvous, `--standalone` and
`--rdzv-backend c10d` alike) and hands it to every generation of workers it starts. The keys that
`init_process_group` writes there (gloo's addresses of each rank, the barrier counters) outlive the
workers that wrote them: after `--max-restarts` starts the workers again, a rank can read the
address of a dead peer, and the new group fails ("Connection refused") or waits forever.
`TORCHELASTIC_RESTART_COUNT` cannot name a generation either: it is counted per node. So the ranks
agree on a fresh generation number through the store itself (`_generation`) and build their group
under a prefix of it, where no key of an earlier generation exists.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

NAMESPACE = "dflashkit"
POLL_S = 0.05


def join_job(backend: str, timeout_s: float) -> None:
    """Join torchrun's job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as a process group of
    `backend` whose collectives fail after `timeout_s` seconds instead of waiting for ever."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    space = f"{NAMESPACE}/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}"
    generation = _generation(store, space, rank, world, timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{space}/{generation}", store), rank=rank,
                            world_size=world, timeout=timeout)
    _JOB.update(store=store, space=f"{space}/{generation}")


# The store and key prefix of the group this process joined, for the heartbeat.
_JOB: dict[str, Any] = {}


def joined() -> bool:
    """This process joined its group through `join_job` (a caller may have made the group itself)."""
    return bool(_JOB)


def _generation(store: Any, space: str, rank: int, world: int, timeout_s: float) -> int:
    """A number every rank of this start of the job agrees on and no earlier start used: rank 0
    draws it (a counter in the store), and each other rank asks for it under a nonce of its own,
    so that no answer meant for an earlier start is taken."""
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"{space}/hello/{rank}", nonce)
        generation = int(store.get(f"{space}/welcome/{nonce}"))  # waits up to the store's timeout
        store.set(f"{space}/{generation}/joined/{rank}", "1")
        return generation
    generation = store.add(f"{space}/generation", 1)
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for r in sorted(waiting):
            hello = f"{space}/hello/{r}"
            nonce = store.get(hello) if store.check([hello]) else None
            if nonce is not None and answered.get(r) != nonce:  # an earlier start's nonce is answered in vain
                store.set(f"{space}/welcome/{nonce.decode()}", str(generation))
                answered[r] = nonce
            if store.check([f"{space}/{generation}/joined/{r}"]):
                waiting.discard(r)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not join the job within {timeout_s:.0f} s "
                               "(train.dist_timeout)")
        time.sleep(POLL_S)
    return generation


class Heartbeat:
    """Each rank's step, written to the job's store every `interval` seconds by a thread of its
    own (so it keeps coming while the main thread waits in a collective). The lowest rank whose
    beat is current reads every rank's: once its own step has waited longer than `interval`, it
    logs which ranks have fallen behind or fallen silent (stopped, or their host gone), and calls
    `tick` (the progress line) either way."""

    def __init__(self, interval: float, timeout_s: float, tick: Callable[[], None] = lambda: None) -> None:
        self.interval, self.timeout_s, self.tick = interval, timeout_s, tick
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        base = _JOB["store"]
        # A client of its own: the main thread's store calls may block for the whole timeout.
        self.store = dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.prefix = f"{_JOB['space']}/beat"
        self.step, self.since = 0, time.monotonic()
        self.started = self.since
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last changed here)
        self.beats = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dflashkit-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.interval + 5)

    def at(self, step: int) -> None:
        """The main thread starts step `step` (1-based)."""
        self.step, self.since = step, time.monotonic()

    def _run(self) -> None:
        while True:
            try:
                self._beat()
            except Exception as e:  # a store that is gone (rank 0's host down): the collectives report it
                log.debug("heartbeat: %s", e)
            if self.stopped.wait(self.interval):
                return

    def _beat(self) -> None:
        self.beats += 1
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps([self.beats, self.step]))
        now = time.monotonic()
        steps, silent = {}, {}
        for r in range(self.world):
            key = f"{self.prefix}/{r}"
            count, step = json.loads(self.store.get(key)) if self.store.check([key]) else (0, 0)
            steps[r] = step
            last = self.seen.setdefault(r, (count, self.started))
            if last[0] != count:
                self.seen[r] = (count, now)
            elif now - last[1] > 2 * self.interval:
                silent[r] = now - last[1]
        if min((r for r in range(self.world) if r not in silent), default=self.rank) != self.rank:
            return
        self.tick()
        waited = now - self.since
        if waited > self.interval:
            log.warning(self.report(waited, steps, silent))

    def report(self, waited: float, steps: dict[int, int], silent: dict[int, float]) -> str:
        """One line: the step that waits, and the ranks it waits for."""
        behind = [r for r, s in steps.items() if s < self.step and r not in silent]
        parts = [f"rank {r} silent for {s:.0f} s (stopped, or its host is down)" for r, s in sorted(silent.items())]
        parts += [f"rank {r} still at step {steps[r]}" for r in behind]
        who = "; ".join(parts) or "every rank is at this step (a long step, or a save)"
        return (f"step {self.step} has waited {waited:.0f} s on rank {self.rank}: {who}; a collective that waits "
                f"{self.timeout_s:.0f} s (train.dist_timeout) ends the job")
