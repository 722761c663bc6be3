"""The training loop's stall for one step checkpoint, at a drafter's real shape: the sharded save
of a job of several ranks (`shardstate`, what `train` writes with the optimiser state on the device),
written in the foreground (`train.async_save=false`) and in the background (the default).

The state is what each rank checkpoints: the fp32 master weights and both AdamW moments of the
drafter `train()` builds for the target shape (for qwen3.6-27b: five layers, hidden 5120, about
1.8B parameters, ~22 GB), in shards over the ranks as FSDP2 holds them. `--share N` in one process
saves the part one rank of N holds (the first 1/N of each tensor's rows): the per-rank figure
that N ranks imply, without the other ranks' traffic on the same disk and bus.

Per save: the stall (how long the loop waits: for a background save, the copy of the state to
host memory) and the total (until every shard and its sums are written). The host copy (pinned, on
the GPU) is made before the first save, as `train` makes it in the background when a job starts, and
every save reuses it.

    python benchmarks/bench_checkpoint.py --shape qwen3.6-27b --work /local/disk
    python benchmarks/bench_checkpoint.py --shape qwen3.6-27b --share 8 --work /local/disk
    torchrun --nproc-per-node 8 benchmarks/bench_checkpoint.py --shape qwen3.6-27b --work /local/disk
    python benchmarks/bench_checkpoint.py --tiny                 # CPU smoke test of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from bench_online import SHAPES
from dflashkit import shardstate
from dflashkit.drafter import DFlashDrafter, drafter_config_for_target

TIMEOUT_S = 3600.0


def join() -> tuple[int, int, torch.device]:
    """This process's rank, the world size and its device, in a process group (one of 1 alone)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from datetime import timedelta

    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size(), device


def drafter_shape(name: str) -> DFlashDrafter:
    """The drafter `train()` builds by default for the target shape, on the meta device (no memory)."""
    shape = SHAPES[name]
    hybrid = "linear_num_key_heads" in shape
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (shape["num_hidden_layers"] // 4) if hybrid else None
    target = SimpleNamespace(**shape, rms_norm_eps=1e-6, layer_types=layer_types)
    with torch.device("meta"):
        return DFlashDrafter(drafter_config_for_target(target, mask_token_id=0))


def rank_state(drafter: DFlashDrafter, device: torch.device, world: int, share: int) -> dict[str, Any]:
    """This rank's fp32 master weights (DTensors sharded by rows over the ranks, as FSDP2's; alone
    with `share`: the first 1/share of each tensor's rows) and their AdamW state."""
    from torch.distributed.tensor import Shard, init_device_mesh, zeros

    names, shapes = zip(*((n, p.shape) for n, p in drafter.named_parameters()))
    if world > 1:
        mesh = init_device_mesh(device.type, (world,))
        master = [zeros(*s, device_mesh=mesh, placements=[Shard(0)]) for s in shapes]
        for m in master:  # DTensor's own random init wants an accelerator's RNG
            m.to_local().normal_()
    else:
        master = [torch.randn(-(-s[0] // share), *s[1:], device=device) for s in shapes]
    return shardstate.tensors(list(names), master, torch.optim.AdamW(master))


def local_bytes(state: dict[str, Any]) -> int:
    tensors = [*state["params"].values(), *(t for st in state["optimizer"].values() for t in st.values())]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def timed_saves(state: dict[str, Any], mode: str, saves: int, work: Path) -> list[dict[str, Any]]:
    """`saves` saves of `state` in `mode` ('sync' or 'async'), each into a fresh directory: the stall and the total."""
    background = shardstate.Saves(TIMEOUT_S, state, work) if mode == "async" else None
    if background is not None:
        background.wait()  # the host copy made as a job makes it at its start, before its first save
    rows = []
    for i in range(saves):
        directory = work / f"{mode}-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        if background is None:
            shardstate.save(state, directory)
            stall = time.perf_counter() - t0
        else:
            background.start(state, directory, None)
            stall = time.perf_counter() - t0
            background.wait()
        total = time.perf_counter() - t0
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory)
        rows.append({"mode": mode, "save": i + 1, "stall_s": round(stall, 3), "total_s": round(total, 3)})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'shape':<12} {'ranks':>5} {'share':>5} {'GB/rank':>8} {'mode':<6} {'save':>4} {'stall s':>8} {'total s':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['shape']:<12} {r['ranks']:>5} {r['share']:>5} {r['gb_per_rank']:>8.2f} {r['mode']:<6} {r['save']:>4} "
              f"{r['stall_s']:>8.3f} {r['total_s']:>8.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.6-27b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized drafter (smoke test)")
    ap.add_argument("--share", type=int, default=1, help="alone: save the part one rank of N holds")
    ap.add_argument("--modes", default="sync,async", help="comma-separated: sync (foreground), async (background)")
    ap.add_argument("--saves", type=int, default=2, help="saves per mode (later background saves reuse the host copy)")
    ap.add_argument("--work", default=None, help="folder the checkpoints are written to (on the disk a job would use)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_checkpoint.json")
    args = ap.parse_args()
    rank, world, device = join()
    if args.share < 1 or (args.share > 1 and world > 1):
        ap.error("--share: a whole number >= 1, in one process only (under torchrun each rank saves its own shards)")
    shape = "tiny" if args.tiny else args.shape
    state = rank_state(drafter_shape(shape), device, world, args.share)
    work = Path(args.work or tempfile.gettempdir()) / f"bench_checkpoint-{os.environ['MASTER_PORT']}"
    rows = []
    for mode in args.modes.split(","):
        for row in timed_saves(state, mode, args.saves, work):
            rows.append({"shape": shape, "ranks": world, "share": args.share, "device": str(device),
                         "gb_per_rank": local_bytes(state) / 1e9, **row})
    if rank == 0:
        print_table(rows)
        out = Path(args.out) / "bench_checkpoint.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {out}")
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
