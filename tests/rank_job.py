"""What each worker of test_ranks.py runs: the tiny training job of train_job.py, with one fault
placed in the job's first start only (`TORCHELASTIC_RESTART_COUNT` 0), so that torchrun's restart
runs clean. As a torchrun script: `rank_job.py OUT FAULT [overrides...]`, FAULT one of
`step:R:N` (rank R is killed inside step N, after its backward), `save:N` (rank 0 is killed
while it writes the checkpoint of step N) or `none`."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))

from train_job import run_job  # noqa: E402


def _inside_step(rank: int, at: int, act: Callable[[], Any]) -> None:
    """`act()` on rank `rank` inside step `at` of this run, after the step's backward."""
    from dflashkit import train as train_mod

    real, steps = train_mod.Trainer.accumulate, []

    def accumulate(self, *a, **k):
        out = real(self, *a, **k)
        steps.append(1)
        if int(os.environ["RANK"]) == rank and len(steps) == at:
            act()
        return out

    train_mod.Trainer.accumulate = accumulate


def _inside_save(at: int) -> None:
    """Rank 0 dies (as by kill -9) while it completes the checkpoint of step `at`: every rank's
    shards are written, its training state not."""
    from dflashkit import train as train_mod
    from dflashkit.checkpoint import FAULT_ENV

    real = train_mod.publish_checkpoint

    def save(out_dir, step, *a, **k):
        if step == at:
            os.environ[FAULT_ENV] = "replace training_state.pt"
        return real(out_dir, step, *a, **k)

    train_mod.publish_checkpoint = save


def arm(fault: str) -> None:
    kind, *numbers = fault.split(":")
    if kind == "step":
        rank, at = map(int, numbers)
        _inside_step(rank, at, lambda: os.kill(os.getpid(), signal.SIGKILL))
    elif kind == "save":
        _inside_save(int(numbers[0]))


def stopped_rank(rank: int, world: int, port: int, out: str, logs: str, overrides: list[str]) -> None:
    """A gloo rank of a job whose rank 1 stops (SIGSTOP) inside step 3; its stderr and log lines
    go to `logs`.rank<R>, progress lines every second."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DFLASHKIT_PROGRESS_SECONDS="1")
    sys.stderr = open(f"{logs}.rank{rank}", "w", buffering=1)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _inside_step(1, 3, lambda: os.kill(os.getpid(), signal.SIGSTOP))
    run_job(out, overrides)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out_dir, fault, *rest = sys.argv[1:]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        arm(fault)
    run_job(out_dir, rest, auto_resume=True)
