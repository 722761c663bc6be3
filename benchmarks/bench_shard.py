"""The target's forward whole and sharded (`target.parallel=shard`), random weights, features as
online training asks for them (the default taps of 5, micro-batches of `--batch` x `--seq` tokens).

One process (one GPU) measures the code path: the decoder layers are FSDP2 units over a mesh of one
rank, so each layer's "all-gather" is a local copy into the gather buffer and out. The difference
to the whole target is FSDP's own cost per forward (those copies, its hooks), not communication.
Under torchrun each rank runs its own micro-batch and the weights are gathered over the GPUs' links:
then it is the real cost of sharding, and the memory column shows what a rank holds.

    python benchmarks/bench_shard.py --shape qwen3-8b
    torchrun --nproc_per_node 8 benchmarks/bench_shard.py --shape qwen3.6-27b
    python benchmarks/bench_shard.py --target smollm2   # a checkpoint: the loader too, features compared
    python benchmarks/bench_shard.py --tiny        # CPU smoke test of the same code (gloo)

Per variant: ms per forward (mean over `--iters` after `--warmup`), tokens/s per rank, the memory
held before the forward (weights) and the peak during it, and the bytes a rank gathers per forward
(the layers' weights it does not hold). The whole target stops after the deepest tap; the sharded
one runs every layer (each is a collective on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench_online import SHAPES, random_target
from dflashkit.data.features import online_features
from dflashkit.drafter import default_target_layer_ids
from dflashkit.parallel import init_process_group, load_sharded_target, shard_layers, target_mesh
from dflashkit.target import Target, load_target


def _timed(fn: Callable[[], Any], iters: int, warmup: int, cuda: bool) -> list[float]:
    out = []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(1e3 * (time.perf_counter() - t))
    return out


def _held_gib(target: Target, cuda: bool) -> float:
    if cuda:
        return torch.cuda.memory_allocated() / 2**30
    local = [p.to_local() if hasattr(p, "to_local") else p for p in target.model.parameters()]
    return sum(t.numel() * t.element_size() for t in local) / 2**30


def measure(name: str, target: Target, ids: torch.Tensor, layer_ids: list[int], args: argparse.Namespace,
            cuda: bool) -> dict[str, Any]:
    held = _held_gib(target, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ms = _timed(lambda: online_features(target, ids, layer_ids), args.iters, args.warmup, cuda)
    world = dist.get_world_size()
    layer_bytes = sum(p.numel() * p.element_size() for p in target.layers.parameters())
    gathered = layer_bytes * (world - 1) / world if target.sharded else 0
    return {"variant": name, "ranks": world, "ms": round(statistics.fmean(ms), 2),
            "ms_min": round(min(ms), 2), "tokens_per_s_per_rank": round(ids.numel() / statistics.fmean(ms) * 1e3),
            "held_gib": round(held, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "gathered_gib_per_forward": round(gathered / 2**30, 2)}


def print_table(rows: list[dict]) -> None:
    cols = [("variant", 10), ("ranks", 6), ("ms", 9), ("ms min", 9), ("tok/s/rank", 11), ("held GiB", 9),
            ("peak GiB", 9), ("gathered GiB", 13), ("load peak GiB", 14), ("max diff", 10)]
    print("".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(cols)))
    for r in rows:
        vals = [r["ranks"], r["ms"], r["ms_min"], r["tokens_per_s_per_rank"], r["held_gib"], r["peak_gib"],
                r["gathered_gib_per_forward"], r.get("load_peak_gib", ""), r.get("max_abs_diff_to_whole", "")]
        print(f"{r['variant']:<10}" + "".join(f"{str(v):>{w}}" for v, (_, w) in zip(vals, cols[1:])))


def random_rows(shape_name: str, seq: int, args: argparse.Namespace, device: torch.device, cuda: bool) -> list[dict]:
    """A random target of the shape, whole, then its layers sharded in place."""
    target = random_target(SHAPES[shape_name], device, torch.bfloat16 if cuda else torch.float32)
    ids = own_batch(target, args.batch, seq, device)
    layer_ids = default_target_layer_ids(target.num_layers, 5)
    rows = [measure("whole", target, ids, layer_ids, args, cuda)]
    shard_layers(target, target_mesh(device))
    if cuda:
        torch.cuda.empty_cache()
    rows.append(measure("sharded", target, ids, layer_ids, args, cuda))
    return rows


def loaded_rows(path: str, seq: int, args: argparse.Namespace, device: torch.device, cuda: bool) -> list[dict]:
    """A checkpoint loaded sharded (rank 0 reads, each rank keeps its shards: the peak while loading
    is measured), then whole; the features of both on the same batch compared."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sharded = load_sharded_target(path, gguf_file=None, dtype="auto", device=device)
    load_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    ids = own_batch(sharded, args.batch, seq, device)
    layer_ids = default_target_layer_ids(sharded.num_layers, 5)
    row = measure("sharded", sharded, ids, layer_ids, args, cuda)
    row["load_peak_gib"] = round(load_peak, 2) if load_peak is not None else None
    got = online_features(sharded, ids, layer_ids)
    whole = load_target(path, device=device)
    want = online_features(whole, ids, layer_ids)
    row["max_abs_diff_to_whole"] = float((got.float() - want.float()).abs().max())
    return [measure("whole", whole, ids, layer_ids, args, cuda), row]


def own_batch(target: Target, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own micro-batch
    return torch.randint(0, target.vocab_size, (batch, seq), generator=g).to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized hybrid target (smoke test)")
    ap.add_argument("--target", help="a checkpoint (directory, .gguf, or a testbed name such as smollm2) loaded "
                    "sharded and whole, instead of a random target of --shape")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per forward (a micro-batch)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_shard_<shape>.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one process without torchrun: a group of one
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_process_group(device)
    name = Path(args.target).name if args.target else "tiny" if args.tiny else args.shape
    seq = min(args.seq, 128) if args.tiny else args.seq
    rows = (loaded_rows(args.target, seq, args, device, cuda) if args.target
            else random_rows(name, seq, args, device, cuda))
    if dist.get_rank() == 0:
        report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                  "target": name, "seq": seq, "batch": args.batch, "date": time.strftime("%Y-%m-%d"), "runs": rows}
        out = Path(args.out) / f"bench_shard_{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print_table(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
