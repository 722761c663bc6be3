"""A step checkpoint's weights and optimiser state in shards (`torch.distributed.checkpoint`), for
jobs of several ranks.

Each rank writes the part of the fp32 master weights and AdamW moments it holds (its FSDP2 shards;
under DDP the replicated tensors are split between the ranks by DCP's planner) into
`CHECKPOINT/state/`, hashes what it wrote, and rank 0 lists every rank's sums in
`state/SHA256SUMS` (so `sha256sum -c` and `checkpoint.verify_file` check each shard). Nothing is
gathered on one rank. A load reads the shards into however many ranks the job has now: DCP
reshards them, so a job of 4 ranks resumes on 2 or on 1.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dflashkit.checkpoint import SUMS, CheckpointError, atomic_write_bytes, sha256_file, verify_file


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

    dcp.save(state, checkpoint_id=str(directory))
    rank = dist.get_rank()
    mine = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp")) + ([".metadata"] if rank == 0 else [])
    sums: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, {n: sha256_file(directory / n) for n in mine})
    if rank == 0:
        every = {n: h for part in sums for n, h in part.items()}
        atomic_write_bytes(directory / SUMS, "".join(f"{every[n]}  {n}\n" for n in sorted(every)).encode())


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
