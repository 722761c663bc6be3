"""Progress off a terminal: one line at a steady interval (count, rate, ETA) and a last one, in a
log file too; tqdm's bar on a terminal."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
from tqdm import tqdm

from datahelpers import CHILD_ENV, save_tiny_target
from dflashkit import progress as progress_module
from dflashkit.progress import INTERVAL_ENV, LineProgress, progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", c)
    return c


def test_a_line_per_interval_with_count_rate_and_eta_then_a_last_line(clock, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "10")
    log = io.StringIO()
    bar = progress(total=100, initial=20, desc="regenerate", unit="prompt", file=log)
    assert isinstance(bar, LineProgress)
    for _ in range(30):  # 3 prompts a second for 10 s, resuming at 20
        clock.now += 1 / 3
        bar.update(1)
    clock.now += 0.01
    bar.update(1)
    lines = log.getvalue().splitlines()
    assert len(lines) == 1, lines  # one line per interval, not one per update
    assert lines[0].startswith("regenerate: 50/100 prompt (50%), 3.00 prompt/s")
    assert "ETA 00:16" in lines[0] and "elapsed 00:10" in lines[0]
    bar.set_postfix(loss="1.25")
    bar.close()
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("regenerate: 51/100 prompt (51%)")
    assert "ETA" not in lines[1] and lines[1].endswith("loss=1.25")


def test_iterating_and_scaled_units(clock, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    log = io.StringIO()
    seen = []
    for x in progress(range(4), desc="decode", unit="sample", file=log):
        seen.append(x)
        clock.now += 1
    assert seen == [0, 1, 2, 3]
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("decode: 1/4 sample (25%)") and lines[-1].startswith("decode: 4/4 sample (100%)")
    log = io.StringIO()
    with progress(total=3_000_000, desc="extract", unit="tok", unit_scale=True, file=log) as bar:
        clock.now += 2
        bar.update(1_500_000)
    assert log.getvalue().splitlines()[0].startswith("extract: 1.50M/3.00M tok (50%), 750k tok/s")


def test_a_stage_that_fails_leaves_the_error_as_its_last_line(clock, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "10")
    log = io.StringIO()
    with pytest.raises(ValueError, match="bad record"):
        with progress(total=5, desc="tokenize", file=log) as bar:
            bar.update(2)
            raise ValueError("bad record")
    with pytest.raises(ValueError, match="bad sample"):
        for i in progress(range(5), desc="check", file=log):
            if i == 2:
                raise ValueError("bad sample")
    assert log.getvalue() == ""


def test_a_terminal_gets_the_bar_and_disable_gets_nothing(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")  # never read on a terminal
    assert isinstance(progress(total=3, file=Terminal()), tqdm)
    quiet = io.StringIO()
    bar = progress(total=3, disable=True, file=quiet)
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_interval_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=f"^{INTERVAL_ENV}: expected a number of seconds > 0, got '{value}'$"):
        progress(total=3, file=io.StringIO())


def test_a_bad_interval_stops_a_command_before_it_starts(monkeypatch, capsys):
    from dflashkit.cli import main

    monkeypatch.setenv(INTERVAL_ENV, "soon")
    assert main(["config", "--plain"]) == 1
    res = capsys.readouterr()
    assert res.out == "" and res.err == f"dflashkit config: error: {INTERVAL_ENV}: expected a number of seconds > 0, got 'soon'\n"


def test_regenerate_into_a_log_file_writes_progress_lines_while_it_runs(tmp_path):
    model = save_tiny_target(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}"}) + "\n" for i in range(12)))
    log = tmp_path / "log"
    with open(log, "w") as f:  # `dflashkit regenerate ... > log 2>&1`: not a terminal
        rc = subprocess.run([sys.executable, "-m", "dflashkit.cli", "regenerate", "--out", str(tmp_path / "out.jsonl"),
                             f"target.path={model}", f"data.prompts={prompts}", "data.max_new_tokens=4",
                             "data.batch_size=2", "target.device=cpu"],
                            stdout=f, stderr=subprocess.STDOUT, env={**CHILD_ENV, INTERVAL_ENV: "0.001"},
                            timeout=300).returncode
    text = log.read_text()
    assert rc == 0, text
    counts = [int(m) for m in re.findall(r"^regenerate: (\d+)/12 prompt \(\d+%\), [\d.]+ prompt/s", text, re.M)]
    # Lines before the end (written while it ran, each with its ETA), in order, then the last one.
    assert counts[-1] == 12 and counts == sorted(counts) and min(counts) < 12, text
    assert re.search(r"^regenerate: \d+/12 .*, ETA \d\d:\d\d$", text, re.M), text
    assert "12 answers written" in text and "Loading weights" not in text  # no carriage-return bars either
