"""The trainer: schedule, data order, multi-process equivalence, exact resume after kill -9, and a
short run of the real pipeline (`dflashkit train`) on the SmolLM2 testbed."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dflashkit.checkpoint import load_drafter, load_training_state
from dflashkit.config import load_config
from dflashkit.drafter import default_target_layer_ids
from dflashkit.train import Dist, built_ahead, lr_factor, step_items
from train_job import BASE, file_size_limit, losses, run_job, spawn_rank

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, jobs: list[tuple[str, list[str], bool | str | None]]) -> None:
    mp.spawn(spawn_rank, args=(world, _free_port(), jobs), nprocs=world, join=True)


def test_warmup_then_cosine():
    total, warmup = 100, 4
    assert [lr_factor(s, total, warmup) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, total, warmup) == 1.0
    assert lr_factor(52, total, warmup) == pytest.approx(0.5)
    assert lr_factor(99, total, warmup) == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))


def test_global_batch_is_the_same_on_any_number_of_processes():
    train_idx = list(range(10, 40, 3))  # 10 sequences: steps 0..4 cross two epoch boundaries
    for step in range(5):
        one = [x for g in step_items(step, 4, 1, Dist(), train_idx, 0) for x in g]
        two = [x for r in range(2) for g in step_items(step, 4, 2, Dist(r, 2, r), train_idx, 0) for x in g]
        assert one == two and [p for p, _ in one] == list(range(4 * step, 4 * step + 4))
    stream = [i for s in range(5) for g in step_items(s, 4, 1, Dist(), train_idx, 0) for _, i in g]
    assert sorted(stream[:10]) == sorted(stream[10:20]) == train_idx  # each epoch: a permutation
    assert stream[:10] != stream[10:20]
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        step_items(0, 5, 1, Dist(0, 2, 0), train_idx, 0)


def test_two_gloo_processes_match_one_and_resume_onto_fsdp(tmp_path):
    one = tmp_path / "one"
    run_job(str(one), ["train.micro_batch_size=2"])
    ref = losses(one)
    assert sorted(ref) == [1, 2, 3, 4] and all(math.isfinite(v) for v in ref.values())
    # DDP, two ranks, same global batch of 4 (2 per rank, micro-batches of 1: accumulation differs too);
    # then FSDP2, two ranks, resumed from the single-process checkpoint of step 2.
    # Then DDP again, SIGTERM reaching rank 1 alone, inside step 3 (no checkpoint is due there): both
    # ranks stop after that step with one checkpoint, and a resume ends as the uninterrupted run.
    stopped = tmp_path / "stopped"
    _spawn(2, [(str(tmp_path / "ddp"), [], None),
               (str(tmp_path / "fsdp"), ["train.parallel=fsdp"], str(one / "checkpoints" / "step-00000002")),
               (str(stopped), [], None, {1: 3}), (str(stopped), [], True)])
    assert [json.loads((stopped / f"stopped-rank{r}.json").read_text()) for r in (0, 1)] == [{"step": 3}] * 2
    assert losses(stopped) == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "ddp") == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "ddp", "eval", "tau_sim") == pytest.approx(losses(one, "eval", "tau_sim"), rel=1e-6)
    got = losses(tmp_path / "fsdp")
    assert sorted(got) == [3, 4]
    assert got == pytest.approx({k: ref[k] for k in (3, 4)}, rel=1e-5)
    a = load_training_state(one / "checkpoints" / "step-00000004")["params"]
    b = load_drafter(tmp_path / "fsdp" / "final").state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    # Checkpoints of several ranks are sharded (each rank wrote its part; sums of every shard), and
    # resume on another number of processes: the 2 ranks' step 2 in one process, same losses after.
    shards = tmp_path / "ddp" / "checkpoints" / "step-00000002"
    assert "params" not in load_training_state(shards) and (shards / "state" / ".metadata").is_file()
    sums = (shards / "state" / "SHA256SUMS").read_text()
    assert "__0_0.distcp" in sums and "__1_0.distcp" in sums and ".metadata" in sums
    run_job(str(tmp_path / "two-to-one"), [], str(shards))
    assert losses(tmp_path / "two-to-one") == pytest.approx({k: ref[k] for k in (3, 4)}, rel=1e-5)


def test_offline_feature_cache_trains_like_online_features(tmp_path):
    from dflashkit.data.features import extract_features
    from train_job import make_tiny_target, tiny_samples

    cache = tmp_path / "features"
    extract_features(make_tiny_target(), tiny_samples(), [1, 2, 3], cache, dtype="float32", shard_size=300)
    run_job(str(tmp_path / "online"), ["train.max_steps=2", "train.eval_every=1000"])
    run_job(str(tmp_path / "offline"), ["train.max_steps=2", "train.eval_every=1000", f"data.features={cache}"],
            samples=None)
    assert losses(tmp_path / "offline") == pytest.approx(losses(tmp_path / "online"), rel=1e-5)
    with pytest.raises(ValueError, match="train.probes: probes need features computed online"):
        run_job(str(tmp_path / "probes"), ["train.probes=suites", f"data.features={cache}"], samples=None)


def test_kill9_then_resume_gives_the_same_losses(tmp_path):
    steps = ["train.max_steps=6"]
    ref_dir = tmp_path / "ref"
    run_job(str(ref_dir), steps)
    ref = losses(ref_dir)
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "train_job.py"), str(out), "--sleep", "0.4", *steps], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = out / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and json.loads(latest.read_text())["step"] >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be killed"
    time.sleep(0.5)  # somewhere inside the steps after the checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < 6
    run_job(str(out), steps, resume=True)
    got = losses(out)
    assert sorted(got) == list(range(1, 7))  # nothing lost, nothing logged twice
    assert got == pytest.approx(ref, rel=1e-6)
    a, b = load_drafter(ref_dir / "final"), load_drafter(out / "final")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=k)


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_gives_the_same_losses(tmp_path):
    """A pre-empted job (SIGTERM, here sent from inside step 3, so not timed) saves the step it was
    in, though no checkpoint was due, and stops; `--resume` then ends as an uninterrupted run."""
    from dflashkit.train import TrainingStopped

    steps = ["train.max_steps=6", "train.save_every=4"]
    ref_dir = tmp_path / "ref"
    run_job(str(ref_dir), steps)
    # the run directory records the effective config, which loads back as the one run
    assert load_config(ref_dir / "config.yaml") == load_config(None, [*BASE, f"train.output_dir={ref_dir}", *steps])
    assert (ref_dir / "config.yaml").read_text().startswith("# dflashkit ")
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "stopped"
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM after step 3.*--resume") as e:
        run_job(str(out), steps, signal_at=3, auto_resume=True)  # nothing to resume yet: a fresh start
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the usual handlers are back
    assert json.loads((out / "latest.json").read_text())["step"] == 3 and not (out / "final").exists()
    run_job(str(out), steps, auto_resume=True)  # the same command again: it resumes
    assert losses(out) == pytest.approx(losses(ref_dir), rel=1e-6)  # nothing lost, nothing logged twice


def test_a_full_disk_is_one_line_naming_the_file_and_auto_resume_recovers(tmp_path, monkeypatch):
    """The file-size limit reached while step 4's checkpoint writes its training state, or no
    space left when step 5's metrics line is appended: one line naming the file being written and
    the cause, no half-written checkpoint left; the same command with --auto-resume continues from
    the last checkpoint and ends as an uninterrupted run."""
    import builtins
    import errno

    from dflashkit import train as train_mod
    from dflashkit.checkpoint import NoRoomError

    steps = ["train.max_steps=6", "train.save_every=2", "train.eval_every=100"]
    ref = tmp_path / "ref"
    run_job(str(ref), steps)
    weights = (ref / "final" / "model.safetensors").stat().st_size  # a training state is about 3x that
    publish = train_mod.publish_checkpoint

    def limited(out_dir, step, *a):
        if step != 4:
            return publish(out_dir, step, *a)
        with file_size_limit(2 * weights):
            return publish(out_dir, step, *a)

    monkeypatch.setattr(train_mod, "publish_checkpoint", limited)
    out = tmp_path / "limit"
    with pytest.raises(NoRoomError) as e:
        run_job(str(out), steps, auto_resume=True)
    assert re.fullmatch(rf"{out}/checkpoints/\.step-00000004\.\d+\.[0-9a-f]{{8}}\.tmp/training_state\.pt: cannot be "
                        r"written: the file-size limit is reached \(ulimit -f\) \(EFBIG\); .*", str(e.value)), str(e.value)
    assert json.loads((out / "latest.json").read_text())["step"] == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    monkeypatch.undo()
    run_job(str(out), steps, auto_resume=True)
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6)

    def full_at_step_5(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        if Path(path).name == "metrics.jsonl" and mode == "a":
            write = f.write

            def failing(text: str) -> int:
                if text.startswith('{"step": 5,'):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return write(text)

            f.write = failing
        return f

    monkeypatch.setattr(train_mod, "open", full_at_step_5, raising=False)
    out = tmp_path / "full"
    with pytest.raises(NoRoomError, match=rf"^{out}/metrics\.jsonl: cannot be written: no space left on the device "
                                          r"\(ENOSPC\)"):
        run_job(str(out), steps, auto_resume=True)
    monkeypatch.undo()
    run_job(str(out), steps, auto_resume=True)
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6)


def test_a_signal_while_the_data_loads_stops_before_the_first_step(tmp_path, monkeypatch):
    from dflashkit import train as train_mod

    real = train_mod.Batcher.__init__

    def init(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        real(self, *a, **k)

    monkeypatch.setattr(train_mod.Batcher, "__init__", init)
    # Nothing saved: the message names what works (--resume has no checkpoint to resume from).
    with pytest.raises(train_mod.TrainingStopped, match="SIGTERM before its first step.*--auto-resume.*--overwrite") as e:
        run_job(str(tmp_path / "run"), ["train.max_steps=6"])
    assert e.value.step == 0 and not (tmp_path / "run" / "latest.json").exists()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="earlier run that saved no checkpoint .*; --auto-resume or --overwrite"):
        run_job(str(tmp_path / "run"), ["train.max_steps=6"])
    with pytest.raises(FileNotFoundError, match="latest.json does not exist .*; --auto-resume starts afresh"):
        run_job(str(tmp_path / "run"), ["train.max_steps=6"], resume=True)
    run_job(str(tmp_path / "run"), ["train.max_steps=6"], auto_resume=True)  # no checkpoint: afresh
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="--auto-resume decides"):
        run_job(str(tmp_path / "run"), ["train.max_steps=6"], resume=True, auto_resume=True)


def test_cli_train_stopped_by_a_signal_exits_128_plus_its_number(tiny_cli_data, tmp_path, capsys, monkeypatch):
    from dflashkit import train as train_mod

    real = train_mod.Trainer.step

    def step(self, *a, **k):
        out = real(self, *a, **k)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C inside step 1
        return out

    monkeypatch.setattr(train_mod.Trainer, "step", step)
    target, data = tiny_cli_data
    rc = _train_cli(target, data, tmp_path / "run", "train.max_steps=4", "train.save_every=100")
    err = capsys.readouterr().err
    assert rc == 130 and "stopped by SIGINT after step 1" in err and "Traceback" not in err, err
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 1


@pytest.mark.slow
def test_real_pipeline_on_smollm2_cli(tmp_path):
    """`dflashkit train` end to end: tokenized JSONL -> online features from SmolLM2 -> drafter."""
    from dflashkit.cli import main
    from dflashkit.data.chat import load_tokenizer, tokenize_conversation

    tok = load_tokenizer()
    convs = [("Write a function that adds two numbers.", "def add(a, b):\n    return a + b\n"),
             ("Reverse a string in Python.", "def reverse(s):\n    return s[::-1]\n"),
             ("Square every item of a list.", "def squares(xs):\n    return [x * x for x in xs]\n"),
             ("Return the maximum of a list.", "def biggest(xs):\n    return max(xs)\n"),
             ("Count the vowels in a word.", "def vowels(w):\n    return sum(c in 'aeiou' for c in w)\n"),
             ("Check whether a number is even.", "def is_even(n):\n    return n % 2 == 0\n")]
    path = tmp_path / "tok.jsonl"
    with open(path, "w") as f:
        for i, (q, a) in enumerate(convs):
            s = tokenize_conversation(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                      max_length=128, id=str(i))
            f.write(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
    out = tmp_path / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["train", f"data.tokenized={path}", f"train.output_dir={out}", "train.max_steps=6", "train.batch_size=2",
                   "train.micro_batch_size=2", "train.anchors_per_seq=16", "train.eval_every=3", "train.eval_samples=1",
                   "train.log_every=1", "train.lr=2e-3", "drafter.num_layers=1", "target.device=cpu"])
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    train_loss = losses(out)
    assert sorted(train_loss) == list(range(1, 7))
    assert train_loss[6] < train_loss[1]  # it learns (five sequences seen three times)
    tau = losses(out, "eval", "tau_sim")
    assert sorted(tau) == [3, 6] and all(1.0 <= t <= 16.0 for t in tau.values())
    drafter = load_drafter(out / "final")
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids == default_target_layer_ids(30, 5)
    assert (out / "best" / "model.safetensors").is_file() and (out / "curves.png").stat().st_size > 10_000
    assert int.from_bytes((out / "curves.png").read_bytes()[16:20], "big") == 1500  # 3 panels: no confidence head


def test_time_budget_fits_the_schedule_to_the_steps_that_fit(tmp_path):
    """With train.time_budget_s the run stops near the budget and the cosine ends at that step."""
    from train_job import run_job

    out = run_job(str(tmp_path / "b"), ["train.max_steps=null", "train.time_budget_s=3", "train.eval_every=1000",
                                         "train.save_every=1000"], sleep=0.05)
    steps = losses(out)
    last = max(steps)
    assert 2 < last < 400  # fitted from the first timed step, far below the provisional 1000
    lrs = losses(out, key="lr")
    # The cosine ends at the fitted end, not at the provisional 1000 steps (where, a few dozen steps
    # in, the rate would still be near its peak). Not "almost zero": when steps run slower than
    # measured, the last re-fit ends the run a few steps short of the schedule it was on.
    assert lrs[last] < 0.25 * max(lrs.values())


# ---- the run directory, divergence, the mask token ---------------------------------------------


def test_a_used_directory_is_refused_locked_and_pruned_by_step(tmp_path):
    import fcntl

    from dflashkit.train import save_checkpoint

    out = tmp_path / "run"
    run_job(str(out), ["train.max_steps=2", "train.eval_every=1000"])
    first = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"holds an earlier run .*--resume .*--overwrite"):
        run_job(str(out), ["train.max_steps=2"])
    assert (out / "metrics.jsonl").read_text() == first  # untouched
    with open(out / ".lock", "a") as held:  # another run holds the directory
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match=r"in use by `dflashkit train` \(pid \d+\)"):
            run_job(str(out), ["train.max_steps=2"], resume=True)
    (out / ".latest.json.999999999.tmp").write_text("{")  # a temp file of a killed writer
    run_job(str(out), ["train.max_steps=2", "train.eval_every=1000"], overwrite=True)
    assert not (out / ".latest.json.999999999.tmp").exists()
    assert sorted(losses(out)) == [1, 2]  # the new run's log only

    # Pruning goes by step number and keeps the checkpoint just written (what latest.json names).
    old = out / "checkpoints" / "step-00000500"
    old.mkdir()
    drafter = load_drafter(out / "final")
    save_checkpoint(out, 10, drafter, {"step": 10}, keep_last=1)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000010"]
    save_checkpoint(out, 11, drafter, {"step": 11}, keep_last=2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000010", "step-00000011"]
    assert json.loads((out / "latest.json").read_text())["checkpoint"] == "checkpoints/step-00000011"


def test_divergence_stops_the_run_and_keeps_the_last_finite_checkpoints(tmp_path, monkeypatch):
    from dflashkit import train as train_mod

    real = train_mod.Trainer.step
    calls = []

    def poisoned(self, *a, **k):  # the weights blow up before the third step
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                for m in self.master:
                    m.mul_(float("inf"))
        return real(self, *a, **k)

    monkeypatch.setattr(train_mod.Trainer, "step", poisoned)
    out = tmp_path / "run"
    with pytest.raises(train_mod.DivergedError, match=r"diverged at step 3: non-finite loss"):
        run_job(str(out), ["train.max_steps=4", "train.save_every=1", "train.eval_every=2"])
    assert json.loads((out / "latest.json").read_text())["step"] == 2
    assert json.loads((out / "best.json").read_text())["step"] == 2
    for d in (out / "best", out / "checkpoints" / "step-00000002"):
        assert all(torch.isfinite(v).all() for v in load_drafter(d).state_dict().values())
    assert not (out / "final").exists() and not (out / "checkpoints" / "step-00000003").exists()


@pytest.fixture(scope="module")
def tiny_cli_data(tmp_path_factory):
    """A tiny random target with SmolLM2's tokenizer on disk, and a tokenized file for it."""
    from datahelpers import save_tiny_target

    root = tmp_path_factory.mktemp("cli")
    target = save_tiny_target(root / "model")
    g = torch.Generator().manual_seed(0)
    with open(root / "tok.jsonl", "w") as f:
        for i in range(12):
            ids = torch.randint(20, 40000, (40,), generator=g).tolist()
            f.write(json.dumps({"id": str(i), "input_ids": ids, "loss_mask": [0] * 8 + [1] * 32}) + "\n")
    return target, root / "tok.jsonl"


def _train_cli(target, data, out, *extra) -> int:
    """`dflashkit train` in this process (a CLI process costs seconds of imports): its exit status."""
    from dflashkit.cli import main

    return main(["train", f"target.path={target}", f"data.tokenized={data}", f"train.output_dir={out}",
                 "train.max_steps=2", "train.batch_size=2", "train.anchors_per_seq=8", "train.eval_samples=2",
                 "train.eval_every=1", "train.tensorboard=false", "drafter.num_layers=1", "drafter.num_taps=2",
                 "target.device=cpu", *extra])


def test_cli_refuses_a_stop_token_as_mask_and_a_diverging_run_exits_nonzero(tiny_cli_data, tmp_path, capsys, caplog):
    target, data = tiny_cli_data
    rc = _train_cli(target, data, tmp_path / "mask", "drafter.mask_token_id=2")
    err = capsys.readouterr().err
    assert rc == 1 and "mask_token_id 2 is a BOS/EOS/PAD/stop token" in err, err
    assert "Traceback" not in err + caplog.text and not (tmp_path / "mask" / "final").exists()
    rc = _train_cli(target, data, tmp_path / "nan", "train.lr=1e30")
    err = capsys.readouterr().err
    assert rc == 1 and "training diverged at step 1" in err, err
    assert not (tmp_path / "nan" / "best").exists() and not (tmp_path / "nan" / "final").exists()


@pytest.mark.slow
def test_rounds_replayed_on_probes_equal_online_dflash(smollm2, tmp_path):
    """Probes (the target's own greedy answers to prompts it never trains on): the decoding rounds
    that training replays on them give, in fp32, exactly the τ of online DFlash decoding of those
    prompts; the mean acceptance over anchors (tau_sim) is a different, larger number."""
    from dflashkit.config import load_config
    from dflashkit.data.chat import tokenize_conversation
    from dflashkit.data.prompts import load_suite
    from dflashkit.decode.loop import generate, make_engine
    from dflashkit.demo import bundled_drafter_dir
    from dflashkit.evaluate import eval_prompts
    from dflashkit.train import train
    from dflashkit.vocab import stop_token_ids

    prompts = tmp_path / "chat.jsonl"  # what a user would serve: probes from a prompt file (train.probes)
    prompts.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in load_suite("chat", 2)))
    # A small training set (a fifth held out: 1), short: at lr 1e-12 what it holds does not matter.
    chats = [[{"role": "user", "content": f"Add {i} and {i + 1}."}, {"role": "assistant", "content": f"It is {2 * i + 1}."}]
             for i in range(5)]
    samples = [tokenize_conversation(smollm2.tokenizer, c, max_length=128, id=str(i)) for i, c in enumerate(chats)]
    cfg = load_config(None, [f"train.output_dir={tmp_path / 'run'}", f"drafter.init_from={bundled_drafter_dir()}",
                             "train.max_steps=1", "train.lr=1e-12", "train.batch_size=2", "train.micro_batch_size=2",
                             "train.eval_every=1", "train.eval_samples=1", "train.tensorboard=false", "target.device=cpu",
                             f"train.probes={prompts}", "data.max_new_tokens=16"])
    run = train(cfg, target=smollm2, samples=samples)
    best = json.loads((run / "best.json").read_text())
    drafter = load_drafter(run / "best", smollm2)
    stop = stop_token_ids(smollm2.tokenizer, smollm2.model.generation_config)
    taus = [t for p in eval_prompts(load_suite("chat", 2), smollm2.tokenizer)
            for t in generate(make_engine(smollm2, drafter, "hf"), p.ids, max_new_tokens=16, method="dflash",
                              stop_ids=stop).accept_lengths]
    online = sum(taus) / len(taus)
    assert online > 1.2  # the bundled drafter: rounds of several tokens, not a trivial τ = 1
    assert best["tau_rounds_probes"]["chat"] == pytest.approx(online, abs=1e-9)


def test_a_step_builds_its_first_micro_batches_before_training_the_first():
    """With the optimiser's state on the host, the first micro-batches' target forwards run while the
    last update streams: built before the first is handed over, the rest one at a time, in order."""
    built = []
    batches = built_ahead(lambda g: built.append(g) or g * 10, [1, 2, 3, 4, 5], first=3)
    assert built == []
    assert next(batches) == 10 and built == [1, 2, 3]
    assert next(batches) == 20 and next(batches) == 30 and built == [1, 2, 3]
    assert next(batches) == 40 and built == [1, 2, 3, 4]
    assert list(batches) == [50] and built == [1, 2, 3, 4, 5]
    assert list(built_ahead(lambda g: g, [7], first=3)) == [7]


def test_optimizer_state_on_the_host_trains_exactly_as_on_the_device_and_resumes_across(tmp_path, monkeypatch):
    """`train.optimizer_state=host` streams master weights and moments through the device in chunks
    (chunks of a few parameters here, so that the streaming loop runs over many): the same
    arithmetic, so the same losses and weights, and a checkpoint of either resumes in the other."""
    from dflashkit import optim

    monkeypatch.setattr(optim, "CHUNK_BYTES", 40_000)
    dev, host = tmp_path / "device", tmp_path / "host"
    run_job(str(dev), [])
    run_job(str(host), ["train.optimizer_state=host"])
    assert losses(host) == losses(dev)  # bit for bit
    a = load_training_state(dev / "checkpoints" / "step-00000004")
    b = load_training_state(host / "checkpoints" / "step-00000004")
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][k][m], b["optimizer"][k][m]), (k, m)
    mixed = tmp_path / "mixed"  # the device run's step-2 checkpoint, continued with the state on the host
    run_job(str(mixed), ["train.optimizer_state=host"], resume=str(dev / "checkpoints" / "step-00000002"))
    assert losses(mixed) == {k: v for k, v in losses(dev).items() if k > 2}


def test_target_compile_default_is_on_for_attention_targets_off_for_hybrids():
    from conftest import make_tiny_hybrid, make_tiny_target
    from dflashkit.train import compile_target

    dense, hybrid = make_tiny_target(), make_tiny_hybrid()
    assert compile_target(None, dense) and not compile_target(None, hybrid)
    assert compile_target(True, hybrid) and not compile_target(False, dense)
