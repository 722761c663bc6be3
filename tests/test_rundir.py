"""Output directories with an owner: one run at a time (a lock that names its holder), temp files
named uniquely and cleaned on start, and `--overwrite` that removes only what dflashkit wrote and
never follows a link."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from datahelpers import save_tiny_target
from dflashkit.checkpoint import temp_path
from dflashkit.cli import main as cli_main
from dflashkit.data.chat import is_tokenized_file
from dflashkit.export import is_export_dir
from dflashkit.rundir import MANIFEST, output_directory, output_path, replace_dir
from train_job import run_job


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    model = save_tiny_target(root / "model")
    g = torch.Generator().manual_seed(0)
    rows = [{"id": str(i), "input_ids": torch.randint(20, 40000, (24,), generator=g).tolist(),
             "loss_mask": [0] * 8 + [1] * 16} for i in range(4)]
    (root / "tok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = [{"id": str(i), "messages": [{"role": "user", "content": f"Question {i}"},
                                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(4)]
    (root / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
    return model, root


def test_temp_names_are_unique_and_only_dead_writers_files_are_cleaned(tmp_path):
    a, b = temp_path(tmp_path / "x.json"), temp_path(tmp_path / "x.json")
    assert a != b and all(re.fullmatch(rf"\.x\.json\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", p.name) for p in (a, b))
    dead = tmp_path / ".x.json.999999999.0badf00d.tmp"
    older = tmp_path / ".y.json.999999999.tmp"  # as earlier versions named them
    live = tmp_path / f".x.json.{os.getppid()}.0badf00d.tmp"  # a writer that still runs
    sub = tmp_path / "checkpoints"
    sub.mkdir()
    stale_dir = sub / ".step-00000002.999999999.0badf00d.tmp"
    stale_dir.mkdir()
    for p in (dead, older, live):
        p.write_text("{")
    with output_directory(tmp_path, "train", temp_dirs=("checkpoints",)):
        pass
    assert not dead.exists() and not older.exists() and not stale_dir.exists() and live.exists()


def test_replace_dir_leaves_no_temp_directory_when_the_write_fails(tmp_path):
    final = tmp_path / "final"

    def fail(p):
        p.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_dir(final, fail)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["extract", "tokenize", "export"])
def test_a_second_run_into_a_held_output_fails_at_once_naming_the_holder(tiny_data, tmp_path, capsys, command):
    model, root = tiny_data
    out = tmp_path / "out"
    overrides = [f"target.path={model}", "target.device=cpu", "drafter.num_taps=2"]
    if command == "extract":
        held, argv = output_directory(out, "extract"), ["--input", str(root / "tok.jsonl"), "--out", str(out)]
    elif command == "tokenize":
        out = tmp_path / "tok.jsonl"
        held = output_path(out, "tokenize", is_tokenized_file, "a tokenized file")
        argv = ["--input", str(root / "answers.jsonl"), "--out", str(out)]
    else:
        held = output_path(out, "export", is_export_dir, "a drafter directory")
        argv, overrides = [str(_bundled()), "--out", str(out)], []
    with held:
        rc = cli_main([command, *argv, *overrides])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"{out} is in use by `dflashkit {command}` (pid {os.getpid()})" in err, err
    assert cli_main([command, *argv, *overrides]) == 0, capsys.readouterr().err  # free again
    if command == "export":  # the lock is beside what is handed on, not in it
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def _bundled():
    from dflashkit.demo import bundled_drafter_dir

    return bundled_drafter_dir()


STEPS = ["train.max_steps=1", "train.eval_every=1000", "train.save_every=1"]


def test_overwrite_removes_only_what_dflashkit_wrote_and_never_follows_a_link(tmp_path):
    out = tmp_path / "run"
    run_job(str(out), STEPS)
    assert {"config.yaml", "final", "checkpoints", "metrics.jsonl"} <= set(json.loads((out / MANIFEST).read_text())["files"])
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    os.rename(out / "final", tmp_path / "old-final")
    (out / "final").symlink_to(precious, target_is_directory=True)  # a user's link where final/ was
    (out / "notes.txt").write_text("mine")  # a file the run never wrote
    run_job(str(out), STEPS, overwrite=True)
    assert (precious / "keep.txt").read_text() == "mine" and (out / "notes.txt").read_text() == "mine"
    assert not (out / "final").is_symlink() and (out / "final" / "model.safetensors").is_file()

    # A directory whose config.yaml is the user's own: --overwrite refuses and removes nothing.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    (mine / "tb").mkdir()
    with pytest.raises(ValueError, match=r"config\.yaml, tb were not written by dflashkit .* leaves them alone"):
        run_job(str(mine), STEPS, overwrite=True)
    assert (mine / "config.yaml").read_text() == "my: settings\n" and (mine / "tb").is_dir()


def test_a_malformed_manifest_is_one_line_naming_it(tmp_path):
    (tmp_path / MANIFEST).write_text('{"files": ["../etc"]}')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / MANIFEST))}: expected"):
        with output_directory(tmp_path, "train"):
            pass


def test_a_file_where_an_output_directory_goes_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    for held in (output_directory(tmp_path / "afile", "extract"),
                 output_path(tmp_path / "afile" / "x.jsonl", "tokenize", is_tokenized_file, "a tokenized file")):
        with pytest.raises(ValueError, match=r"afile: expected a directory \(or none yet\), but it or a folder above it is a file"):
            with held:
                pass


def test_a_refused_run_leaves_the_lock_naming_the_run_it_was_refused_by(tmp_path):
    """A fresh run into a directory that holds an earlier run is refused, and the lock file goes on
    naming that run; one that did run names itself. A link where the lock goes is refused, and what
    it points to is left as it was."""
    out = tmp_path / "run"
    run_job(str(out), STEPS)
    earlier = "`dflashkit train` (pid 4242)\n"
    (out / ".lock").write_text(earlier)  # the run that wrote the directory, as another process
    with pytest.raises(ValueError, match="holds an earlier run"):
        run_job(str(out), STEPS)
    assert (out / ".lock").read_text() == earlier
    with output_directory(out, "eval"):
        pass
    assert (out / ".lock").read_text() == f"`dflashkit eval` (pid {os.getpid()})\n"

    linked = tmp_path / "linked"
    linked.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    (linked / ".lock").symlink_to(precious)
    with pytest.raises(ValueError, match=r"linked/\.lock: a symbolic link where dflashkit's lock file goes"):
        with output_directory(linked, "train"):
            pass
    assert precious.read_text() == "mine\n"


def test_auto_resume_without_a_checkpoint_names_itself_when_it_starts_afresh(tmp_path, caplog):
    """--auto-resume over a run that saved no checkpoint starts afresh; the log says that
    --auto-resume removed the earlier run's files, not --overwrite, which was never given."""
    out = tmp_path / "run"
    with output_directory(out, "train") as owned:  # what a run stopped before its first step leaves
        owned.record(["config.yaml"])
        (out / "config.yaml").write_text("# an earlier run\n")
    with caplog.at_level("WARNING", logger="dflashkit.train"):
        run_job(str(out), STEPS, auto_resume=True)
    assert "--auto-resume: removing the earlier run in" in caplog.text and "--overwrite" not in caplog.text
    assert (out / "final" / "model.safetensors").is_file()


def _refused(argv: list[str], capsys, what: str) -> None:
    assert cli_main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflashkit")]
    assert len(err) == 1 and what in err[0] and "replaces only its own earlier output" in err[0], err


def test_a_handed_on_output_replaces_only_an_earlier_output_of_its_command(tiny_data, tmp_path, capsys):
    """tokenize --out the conversations it reads, export --out a model's directory, check-features
    --json a file of the user's: one line each, exit 1, before any work, everything left byte for
    byte; an earlier output of the same command is replaced."""
    import shutil

    model, root = tiny_data
    answers = tmp_path / "answers.jsonl"
    shutil.copy(root / "answers.jsonl", answers)
    before = answers.read_bytes()
    _refused(["tokenize", "--input", str(answers), "--out", str(answers), f"target.path={model}"], capsys,
             f"{answers}: not a tokenized file")
    assert answers.read_bytes() == before
    out = tmp_path / "tok.jsonl"
    for _ in range(2):  # its own output, replaced
        assert cli_main(["tokenize", "--input", str(answers), "--out", str(out), f"target.path={model}"]) == 0
    capsys.readouterr()

    target = tmp_path / "target"
    shutil.copytree(model, target)
    files = {p.name: p.read_bytes() for p in target.iterdir()}
    _refused(["export", str(_bundled()), "--out", str(target)], capsys, f"{target}: not an empty directory or a drafter's")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    for _ in range(2):
        assert cli_main(["export", str(_bundled()), "--out", str(tmp_path / "exported")]) == 0
    capsys.readouterr()

    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    _refused(["check-features", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(notes)], capsys,
             f"{notes}: not a check-features report")
    assert notes.read_text() == '{"mine": true}\n'
