"""What each worker of test_ranks.py runs: the tiny training job of train_job.py, with one fault
placed in the job's first start only (`TORCHELASTIC_RESTART_COUNT` 0), so that torchrun's restart
runs clean. As a torchrun script: `rank_job.py OUT FAULT [overrides...]`, FAULT one of
`step:R:N` (rank R is killed inside step N, after its backward, once the checkpoint before step N
is complete), `save:N` (rank 0 is killed while it writes the checkpoint of step N) or `none`."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))

from train_job import file_size_limit, run_job  # noqa: E402


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
    shards are written, its training state not. A save in the background (train.async_save) dies
    only once rank 0 has trained two more steps: the loop went on while it was written."""
    from dflashkit import train as train_mod
    from dflashkit.checkpoint import FAULT_ENV

    real, went_on = train_mod.publish_checkpoint, threading.Event()
    _inside_step(0, at + 2, went_on.set)

    def save(out_dir, step, *a, **k):
        if step == at:
            if threading.current_thread() is not threading.main_thread():
                went_on.wait(timeout=120)
            os.environ[FAULT_ENV] = "replace training_state.pt"
        return real(out_dir, step, *a, **k)

    train_mod.publish_checkpoint = save


def _checkpointed(out_dir: str, step: int) -> None:
    """Waits until latest.json names step `step`: a save in the background (train.async_save) may
    still be written when the next step starts, and a kill then would be a kill during a save."""
    latest = Path(out_dir) / "latest.json"
    for _ in range(1200):
        if step == 0 or (latest.is_file() and json.loads(latest.read_text())["step"] >= step):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{latest}: step {step} not saved within 120 s")


def arm(fault: str, out_dir: str, overrides: list[str]) -> None:
    kind, *numbers = fault.split(":")
    if kind == "step":
        rank, at = map(int, numbers)
        every = int(next(o.split("=")[1] for o in overrides if o.startswith("train.save_every=")))

        def kill() -> None:
            _checkpointed(out_dir, (at - 1) // every * every)
            os.kill(os.getpid(), signal.SIGKILL)

        _inside_step(rank, at, kill)
    elif kind == "save":
        _inside_save(int(numbers[0]))


def stopped_rank(rank: int, world: int, port: int, out: str, logs: str, overrides: list[str]) -> None:
    """A gloo rank of a job whose rank 1 stops (SIGSTOP) inside step 3, once step 2's checkpoint is
    complete; its stderr and log lines go to `logs`.rank<R>, progress lines every second."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DFLASHKIT_PROGRESS_SECONDS="1")
    sys.stderr = open(f"{logs}.rank{rank}", "w", buffering=1)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def stop() -> None:
        _checkpointed(out, 2)
        os.kill(os.getpid(), signal.SIGSTOP)

    _inside_step(1, 3, stop)
    run_job(out, overrides)


def full_disk_rank(rank: int, world: int, port: int, out: str, overrides: list[str], full_at: int | None) -> None:
    """A gloo rank of the job with --auto-resume; rank 1 reaches the file-size limit (ulimit -f)
    while it writes its shard of step `full_at`'s checkpoint. The job's error, if any, goes to
    `out`/error-rank<R>.txt."""
    from dflashkit import shardstate
    from dflashkit.checkpoint import NoRoomError

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    real = shardstate._NamedFileSystem.create_stream

    @contextmanager
    def limited(self, path, mode):
        full = rank == 1 and full_at is not None and f".step-{full_at:08d}." in str(path)
        with file_size_limit(1024) if full else nullcontext(), real(self, path, mode) as stream:
            yield stream

    shardstate._NamedFileSystem.create_stream = limited
    try:
        run_job(out, overrides, auto_resume=True)
    except NoRoomError as e:
        (Path(out) / f"error-rank{rank}.txt").write_text(str(e))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out_dir, fault, *rest = sys.argv[1:]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        arm(fault, out_dir, rest)
    run_job(out_dir, rest, auto_resume=True)
