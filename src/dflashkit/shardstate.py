"""A step checkpoint's weights and optimiser state in shards (`torch.distributed.checkpoint`), for
jobs of several ranks.

Each rank writes the part of the fp32 master weights and AdamW moments it holds (its FSDP2 shards;
under DDP the replicated tensors are split between the ranks by DCP's planner) into
`CHECKPOINT/state/`, hashes what it wrote, and rank 0 lists every rank's sums in
`state/SHA256SUMS` (so `sha256sum -c` and `checkpoint.verify_file` check each shard). Nothing is
gathered on one rank. A load reads the shards into however many ranks the job has now: DCP
reshards them, so a job of 4 ranks resumes on 2 or on 1.

`Saves` writes them in the background (`async_save`): the training loop stalls only while the state
is copied to host memory, and a checkpoint is declared complete (its sums, then whatever the caller
adds: latest.json) only once every rank's shards are on disk.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from dflashkit.checkpoint import SUMS, CheckpointError, atomic_write_bytes, sha256_file, verify_file, writing


def tensors(names: list[str], master: list[Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{'params': name -> master weight, 'optimizer': name -> {AdamW state}}: the tensors
    themselves (DTensors under FSDP2), for DCP to write or to read into. State that AdamW has not
    made yet (before its first step) is made here as AdamW makes it: zero moments, step 0."""
    opt: dict[str, dict[str, Tensor]] = {}
    for name, m in zip(names, master):
        st = optimizer.state[m]
        if not st:
            st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(m),
                      exp_avg_sq=torch.zeros_like(m))
        opt[name] = st
    return {"params": dict(zip(names, master)), "optimizer": opt}


def save(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its shards of `state` into `directory`, then the sums of all of them go
    to `directory`/SHA256SUMS (each rank hashes only the files it wrote)."""
    import torch.distributed.checkpoint as dcp

    with _named_failures():
        dcp.save(state, storage_writer=_writer(directory, cache=False))
    _share_sums(directory, None)


class Saves:
    """Sharded saves in the background, one at a time: `start` waits for the save before it, copies
    the state to host memory (the loop's whole stall) and leaves the writing, the sums and `then`
    to a thread. Their collectives run in a gloo group of their own, apart from training's.

    On the GPU the host copy is pinned and kept from one save to the next, and it is made when the
    job starts, in the background (`state`; `where`: the checkpoints' folder): at the 27B drafter's
    shape the save that made its 22 GB stalled the loop 20.8 s, the later ones 0.4 s (H100)."""

    def __init__(self, timeout_s: float, state: dict[str, Any], where: Path) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.writer = _writer(where, cache=torch.cuda.is_available())
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflashkit-save")
        self.pending: Future | None = None
        device = _device(state)
        if device is not None:  # (what it copies now is overwritten by the first save)
            self.pending = self.pool.submit(_staged, self.writer, state, device)

    def start(self, state: dict[str, Any], directory: Path, then: Callable[[float], None] | None) -> None:
        """`then(released)` runs once every rank's shards and the sums are written; `released`: when
        this call returned (the end of the loop's stall)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        written = dcp.async_save(state, checkpoint_id=str(directory), storage_writer=self.writer,
                                 process_group=self.group)
        self.pending = self.pool.submit(self._complete, written, directory, then, time.perf_counter())

    def _complete(self, written: Future, directory: Path, then: Callable[[float], None] | None,
                  released: float) -> None:
        with _named_failures():
            written.result()
        _share_sums(directory, self.group)
        if then is not None:
            then(released)

    def wait(self) -> None:
        """The save in flight, if any, finished (its failure raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def _device(state: dict[str, Any]) -> torch.device | None:
    """The CUDA device that `state`'s tensors live on, or None (a CPU's state: no pinned copy)."""
    first = next(iter(state["params"].values()), None)
    return first.device if first is not None and first.device.type == "cuda" else None


def _staged(writer: FileSystemWriter, state: dict[str, Any], device: torch.device) -> None:
    """The writer's pinned host copy of `state`, made once (on this rank's device: pinned memory
    made on another would open a CUDA context on it)."""
    torch.cuda.set_device(device)
    writer.stage(state)


def _share_sums(directory: Path, group: Any) -> None:
    """Each rank hashes the files it wrote; rank 0 writes every rank's sums to SHA256SUMS."""
    rank = dist.get_rank()
    mine = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp")) + ([".metadata"] if rank == 0 else [])
    sums: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, {n: sha256_file(directory / n) for n in mine}, group=group)
    if rank == 0:
        every = {n: h for part in sums for n, h in part.items()}
        atomic_write_bytes(directory / SUMS, "".join(f"{every[n]}  {n}\n" for n in sorted(every)).encode())


class _NamedFileSystem(FileSystem):
    """DCP's files, a failed write's error naming the file (DCP's own leaves it out)."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror, str(path)) from e


def _writer(directory: Path, cache: bool) -> FileSystemWriter:
    w = FileSystemWriter(directory, cache_staged_state_dict=cache)
    w.fs = _NamedFileSystem()
    return w


@contextmanager
def _named_failures() -> Iterator[None]:
    """DCP's failure of a save (every rank's, gathered) as the first failed write among them: a
    full disk or a file-size limit is one line naming the file and the cause (`checkpoint.writing`)."""
    try:
        yield
    except CheckpointException as e:
        for _, (exc, _trace) in sorted(e.failures.items()):
            if isinstance(exc, OSError) and exc.filename:
                with writing(Path(exc.filename)):
                    raise exc from None
        raise


def verify(directory: Path) -> None:
    """Each file of `directory` against its SHA256SUMS, the files split between the ranks; a
    damaged one is refused on every rank."""
    files = sorted(p for p in directory.iterdir() if p.name != SUMS)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        for f in files[rank::world]:
            verify_file(f)
        problem = None
    except CheckpointError as e:
        problem = str(e)
    problems: list[Any] = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    if any(problems):
        raise CheckpointError(next(p for p in problems if p))


def load(state: dict[str, Any], directory: Path) -> None:
    """Read the shards of `directory` into `state` (its tensors, in place), resharded to this job's ranks."""
    import torch.distributed.checkpoint as dcp

    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(f"{directory}: no .metadata; the sharded state was not completely written")
    verify(directory)
    with warnings.catch_warnings():  # that one process reads shards of several is what is meant here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
