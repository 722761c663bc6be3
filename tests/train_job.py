"""A tiny, deterministic training job for test_train.py: in-process, in spawned gloo ranks, or as a
script that can be killed (`python train_job.py OUT [--resume] [--sleep S] [overrides...]`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_tiny_target  # noqa: E402
from dflashkit.config import load_config  # noqa: E402
from dflashkit.data.chat import TokenizedSample  # noqa: E402

BASE = ["train.max_steps=4", "train.batch_size=4", "train.micro_batch_size=1", "train.anchors_per_seq=6",
        "train.eval_every=2", "train.eval_samples=4", "train.save_every=2", "train.log_every=1",
        "train.tensorboard=false", "drafter.num_layers=2", "drafter.num_taps=3", "drafter.block_size=8",
        "drafter.mask_token_id=127", "target.device=cpu"]


def tiny_samples(n: int = 24, seed: int = 0) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(16, 48, (1,), generator=g))
        prompt = int(torch.randint(2, 8, (1,), generator=g))
        ids = torch.randint(3, 120, (T,), generator=g).tolist()
        out.append(TokenizedSample(str(i), ids, [0] * prompt + [1] * (T - prompt)))
    return out


def run_job(out_dir: str, overrides: list[str] = (), resume: bool | str | None = None, sleep: float = 0.0,
            samples: list | None = ..., overwrite: bool = False, signal_at: int | None = None,
            auto_resume: bool = False) -> Path:
    """`samples=None`: read them from the config's data section (e.g. data.features).
    signal_at: this process sends itself SIGTERM inside its Nth training step of this run."""
    from dflashkit import train as train_mod

    torch.set_num_threads(1)
    real, steps = train_mod.Trainer.step, []

    def step(self, *a, **k):
        if sleep:  # slow each step down so that a test can kill the job mid-run (numerics unchanged)
            time.sleep(sleep)
        out = real(self, *a, **k)
        steps.append(1)
        if len(steps) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    train_mod.Trainer.step = step
    try:
        cfg = load_config(None, [*BASE, f"train.output_dir={out_dir}", *overrides])
        samples = tiny_samples() if samples is ... else samples
        return train_mod.train(cfg, target=make_tiny_target(), samples=samples, resume=resume, overwrite=overwrite,
                               auto_resume=auto_resume)
    finally:
        train_mod.Trainer.step = real


def spawn_rank(rank: int, world: int, port: int, jobs: list[tuple]) -> None:
    """One gloo rank running `jobs` (out_dir, overrides, resume[, {rank: step to signal itself at}])
    one after the other. A job that a signal stops leaves `stopped-rank<R>.json` ({"step": N})."""
    from dflashkit.train import TrainingStopped

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        for out_dir, overrides, resume, *signals in jobs:
            try:
                run_job(out_dir, overrides, resume, signal_at=signals[0].get(rank) if signals else None)
            except TrainingStopped as e:
                (Path(out_dir) / f"stopped-rank{rank}.json").write_text(json.dumps({"step": e.step}))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def file_size_limit(limit: int):
    """ulimit -f for this process in the block (Python ignores SIGXFSZ: a write past it is EFBIG)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def losses(out_dir: str | Path, kind: str = "train", key: str = "loss") -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r[key] for r in rows if r["kind"] == kind}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args()
    run_job(a.out, a.overrides, a.resume or None, a.sleep)
