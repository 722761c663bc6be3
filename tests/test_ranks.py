"""A job of several ranks under faults (gloo on the CPU): a rank killed under
`torchrun --max-restarts` (mid-step, or while a checkpoint is written; each of torchrun's three
rendezvous forms), a rank that stops, which the heartbeat names and the collective timeout ends,
and a full disk while 4 ranks write their shards, the job resumed on 2."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dflashkit.checkpoint import load_drafter, load_training_state
from rank_job import full_disk_rank, stopped_rank
from train_job import losses, run_job

HERE = Path(__file__).parent
STEPS = ["train.max_steps=8", "train.eval_every=4", "train.save_every=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(form: str) -> list[str]:
    """torchrun's options for each rendezvous form (a free port each, for tests that run side by side)."""
    port = _free_port()
    return {"default": ["--master-port", str(port)], "standalone": ["--standalone"],
            "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ranks-test"]}[form]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks") / "uninterrupted"
    run_job(str(out), STEPS)
    return out


@pytest.mark.parametrize("form, fault, saves", [("default", "step:1:5", "train.async_save=false"),
                                               ("standalone", "save:4", "train.async_save=true"),
                                               ("c10d", "step:0:3", "train.async_save=true")])
def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_an_uninterrupted_run(tmp_path, uninterrupted, form, fault,
                                                                                  saves):
    """Killed mid-step, or while a checkpoint is written (in the background: rank 0 has trained
    two more steps when it dies); the restart resumes from the last complete checkpoint."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
           *_rendezvous(form), str(HERE / "rank_job.py"), str(out), fault, *STEPS, saves]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    # one start killed, one restart that resumed from the last checkpoint before the kill
    assert re.search(r"failed \(exitcode: (-9|137)\) local_rank: [01]", log), log[-4000:]
    resumed = {"step:1:5": 4, "save:4": 2, "step:0:3": 2}[fault]
    assert f"resumed from {out / 'checkpoints' / f'step-{resumed:08d}'} at step {resumed}" in log, log[-4000:]
    assert re.search(r"checkpoint \S+step-00000008 saved in \d+\.\d\d s \(the training loop stalled \d+\.\d\d s;", log)
    if fault == "save:4":  # the loop went on past the save that was killed: step 5 was trained in both starts
        assert len(re.findall(r"step 5/8 loss", log)) == 2, log[-4000:]
    assert sorted(losses(out)) == list(range(1, 9))  # nothing lost, nothing logged twice
    assert losses(out) == pytest.approx(losses(uninterrupted), rel=1e-5)
    want, got = load_drafter(uninterrupted / "final").state_dict(), load_drafter(out / "final").state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_stopped_rank_is_named_and_the_collective_timeout_ends_the_job(tmp_path):
    """Rank 1 stops (SIGSTOP) inside step 3. Rank 0 keeps its progress line coming, names rank 1
    as silent, and fails when its collective has waited train.dist_timeout: a non-zero exit,
    which torchrun answers with a restart."""
    logs = tmp_path / "log"
    ctx = mp.spawn(stopped_rank, args=(2, _free_port(), str(tmp_path / "run"), str(logs),
                                       [*STEPS, "train.dist_timeout=10"]), nprocs=2, join=False)
    rank0, rank1 = ctx.processes
    try:
        rank0.join(timeout=180)
        assert rank0.exitcode not in (None, 0), "rank 0 still waits, or ended as if nothing happened"
    finally:
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join()
    text = Path(f"{logs}.rank0").read_text()
    warnings = re.findall(r"step 3 has waited (\d+) s on rank 0: rank 1 silent for (\d+) s", text)
    assert warnings, text[-3000:]
    assert "train.dist_timeout" in text
    waited = [int(w) for w, _ in warnings]
    assert max(waited) < 10 + 60  # the timeout ended the wait (generous: 2 shared cores)
    assert len(re.findall(r"^train: 2/8 step", text, re.M)) >= 2, text[-3000:]  # the progress line kept coming
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 2


def test_a_full_disk_while_4_ranks_write_their_shards_is_one_line_and_2_ranks_resume_as_uninterrupted(
        tmp_path, uninterrupted):
    """4 ranks save step 2 in shards, in the background; rank 1 then reaches the file-size limit
    while it writes its shard of step 4: every rank fails with one line naming that shard and the
    cause, and latest.json still names step 2. The same command (--auto-resume) on 2 ranks resumes
    it (DCP reshards) with the same global batch and data position: the 4 ranks' steps 1-2 and the
    2 ranks' steps 3-8 have the losses and the final weights of an uninterrupted run."""
    out = tmp_path / "run"
    mp.spawn(full_disk_rank, args=(4, _free_port(), str(out), STEPS, 4), nprocs=4)
    pattern = (rf"{out}/checkpoints/\.step-00000004\.\d+\.[0-9a-f]{{8}}\.tmp/state/__1_0\.distcp: cannot be written: "
               r"the file-size limit is reached \(ulimit -f\) \(EFBIG\); free space or raise the limit, then run the "
               r"command again")
    for rank in range(4):
        assert re.fullmatch(pattern, (out / f"error-rank{rank}.txt").read_text()), rank
    assert json.loads((out / "latest.json").read_text())["step"] == 2
    shards = out / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in (shards / "state").glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert load_training_state(shards)["world_size"] == 4
    mp.spawn(full_disk_rank, args=(2, _free_port(), str(out), STEPS, None), nprocs=2)
    assert not list((out / "checkpoints").glob(".*.tmp"))
    assert sorted(losses(out)) == list(range(1, 9))
    assert losses(out) == pytest.approx(losses(uninterrupted), rel=1e-5)
    want, got = load_drafter(uninterrupted / "final").state_dict(), load_drafter(out / "final").state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
