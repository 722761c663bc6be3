"""The demo's plan: a step count on a CPU (the adapted drafter must not depend on the machine's
speed), a wall clock on a GPU, and either one from the command line, not both."""

from __future__ import annotations

import argparse

import pytest

from dflashkit import demo


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def test_cpu_plan_counts_steps_and_gpu_plan_a_wall_clock():
    cpu, gpu = demo.Plan.for_device(cuda=False), demo.Plan.for_device(cuda=True)
    assert (cpu.train_steps, cpu.train_minutes) == (64, None)
    assert gpu.train_steps is None and gpu.train_minutes > 0


@pytest.mark.parametrize("argv, message", [
    (("--train-steps", "5", "--train-minutes", "1"), "give one of them"),
    (("--train-steps", "0"), "--train-steps must be positive"),
])
def test_bad_fine_tuning_length_is_refused_before_any_work(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        demo.run(parse(*argv, "--out", str(tmp_path / "demo")))
    assert not (tmp_path / "demo").exists()  # refused before the output directory is made


def test_a_second_demo_into_the_same_out_is_refused_at_once(tmp_path, monkeypatch):
    import dflashkit.target as target_mod
    from dflashkit.rundir import output_directory

    def no_model(*a, **k):
        raise AssertionError("a refused demo must load no model")

    monkeypatch.setattr(target_mod, "load_target", no_model)
    out = tmp_path / "demo"
    with output_directory(out, "demo"):  # the first demo, still running
        with pytest.raises(RuntimeError, match=r"is in use by `dflashkit demo` \(pid \d+\)"):
            demo.run(parse("--out", str(out)))
