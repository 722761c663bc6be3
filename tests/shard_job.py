"""What each spawned gloo rank of test_shard.py runs: the target sharded over the ranks
(`target.parallel=shard`) against the whole target, for features, extraction and training.
Each rank writes `rank<R>.json` (its measurements) into the work directory."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_tiny_hybrid, make_tiny_target  # noqa: E402
from train_job import BASE, tiny_samples  # noqa: E402

TARGETS: dict[str, Callable[[], Any]] = {"dense": make_tiny_target, "hybrid": make_tiny_hybrid}
LAYERS = [1, 3, 5]
TRAIN = [*BASE, "train.max_steps=20", "train.eval_every=10", "train.save_every=10", "train.eval_samples=4"]
EXTRACT_SHARD_TOKENS = 170  # 5 shards: unequal numbers of forwards over 2 and over 4 ranks
EXTRACT_BATCH = 3


def _own_batch(rank: int, vocab: int) -> torch.Tensor:
    """Each rank its own batch (length too), as each trains on its own micro-batch."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(3, vocab, (2, 17 + 5 * rank), generator=g)


def _max_error(sharded: Any, whole: Any, rank: int) -> float:
    ids = _own_batch(rank, whole.vocab_size)
    a = sharded.forward(ids, LAYERS, logits=False, hidden=False).features
    b = whole.forward(ids, LAYERS, logits=False, hidden=False).features
    return float((a - b).abs().max())


def _held_share(target: Any) -> float:
    """Share of the decoder layers' weights this rank holds."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in target.layers.parameters())
    return local / sum(p.numel() for p in target.layers.parameters())


def features(rank: int, path: str) -> tuple[dict[str, Any], Any]:
    """Sharded in place (targets handed in) and loaded sharded from `path` (rank 0 scatters),
    against the whole target; also returns the whole target loaded from `path`."""
    from dflashkit.parallel import load_sharded_target, shard_target
    from dflashkit.target import load_target

    out: dict[str, Any] = {}
    for name, make in TARGETS.items():
        sharded = shard_target(make(), torch.device("cpu"))
        out[f"handed/{name}"] = {"error": _max_error(sharded, make(), rank), "share": _held_share(sharded)}
    sharded = load_sharded_target(path, gguf_file=None, dtype="auto", device=torch.device("cpu"))
    whole = load_target(path)
    head, embed = sharded.model.get_output_embeddings().weight, sharded.model.get_input_embeddings().weight
    out["loaded"] = {"error": _max_error(sharded, whole, rank), "share": _held_share(sharded), "tied": head is embed,
                     "head_equal": bool(torch.equal(head, whole.model.get_output_embeddings().weight))}
    return out, whole


def extract_samples() -> list[Any]:
    return tiny_samples(24, seed=1)


def forwards_per_rank(world: int) -> list[int]:
    """How many target forwards each rank's shards of the extraction take."""
    from dflashkit.data.features import plan_shards

    shards = plan_shards([len(s.input_ids) for s in extract_samples()], EXTRACT_SHARD_TOKENS)
    return [sum(-(-(end - start) // EXTRACT_BATCH) for start, end in shards[r::world]) for r in range(world)]


def extract(target: Any, out: Path, rank: int | None = None, world: int | None = None) -> None:
    from dflashkit.data.features import extract_features

    extract_features(target, extract_samples(), LAYERS, out, dtype="float32", batch_size=EXTRACT_BATCH,
                     shard_size=EXTRACT_SHARD_TOKENS, rank=rank, world=world)


def extract_command(path: str, out: Path, rank: int) -> None:
    """`dflashkit extract ... target.parallel=shard`, as torchrun runs it in each rank."""
    from dflashkit.cli import main as cli_main

    tokenized = out.parent / f"tokenized-rank{rank}.jsonl"
    tokenized.write_text("".join(json.dumps(s.__dict__) + "\n" for s in extract_samples()))
    code = cli_main(["extract", "--input", str(tokenized), "--out", str(out), "--shard-size", str(EXTRACT_SHARD_TOKENS),
                     f"target.path={path}", "target.device=cpu", "target.parallel=shard", f"data.batch_size={EXTRACT_BATCH}",
                     "data.feature_dtype=float32", f"drafter.num_taps={len(LAYERS)}",
                     f"drafter.target_layer_ids={LAYERS}"])
    assert code == 0, code


def train(work: Path, name: str, parallel: str, resume: str | None = None, tag: str = "", *overrides: str) -> None:
    from dflashkit.config import load_config
    from dflashkit.train import train as run_train

    out = work / f"train-{name}-{parallel}{tag}"
    cfg = load_config(None, [*TRAIN, f"train.output_dir={out}", f"target.parallel={parallel}", *overrides])
    run_train(cfg, target=TARGETS[name](), samples=tiny_samples(), resume=resume)


def run_rank(rank: int, world: int, port: int, work: str, path: str, trained: list[str], resume: bool,
             local_world: int) -> None:
    """Rank `rank` of `world`: features and extraction of the target saved at `path` (rank 0 also
    extracts with the whole target, alone, into `one/`), then training of the `trained` targets,
    replicated and sharded (within groups of `local_world` ranks, as on nodes of that many GPUs);
    with `resume` the sharded dense run resumed from its step 10, else the dense target sharded
    under a drafter sharded too (train.parallel=fsdp)."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Ranks whose collectives stopped pairing up fail in a minute, not gloo's default half hour.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    root = Path(work)
    try:
        result, whole = features(rank, path)
        extract_command(path, root / "extract", rank)
        if rank == 0:
            extract(whole, root / "one", rank=0, world=1)
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        for name in trained:
            train(root, name, "replicate")
            train(root, name, "shard")
        if resume:
            train(root, "dense", "shard", str(root / "train-dense-shard" / "checkpoints" / "step-00000010"), "-resumed")
        else:
            train(root, "dense", "shard", None, "-fsdp", "train.parallel=fsdp")
        (root / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
