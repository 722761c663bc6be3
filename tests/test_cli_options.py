"""Every option value is checked at the edge: a value its type refuses (nan, inf, 0, out of range)
is one line naming the option, exit status 1, before anything loads."""

from __future__ import annotations

import pytest

from dflashkit.cli import main

NO_TARGET = "target.path=/nonexistent/model"  # anything that got past the options would fail on it

CASES = [
    (["regenerate", "--out", "o.jsonl", "--timeout", "nan"], "--timeout", "a finite number > 0", "nan"),
    (["regenerate", "--out", "o.jsonl", "--timeout", "inf"], "--timeout", "a finite number > 0", "inf"),
    (["regenerate", "--out", "o.jsonl", "--concurrency", "0"], "--concurrency", "an integer >= 1", "0"),
    (["regenerate", "--out", "o.jsonl", "--retries", "-1"], "--retries", "an integer >= 0", "-1"),
    (["regenerate", "--out", "o.jsonl", "--backend", "http", "--url", "localhost:8000/v1"], "--url",
     "an http:// or https:// URL such as http://127.0.0.1:8000/v1", "localhost:8000/v1"),
    (["extract", "--input", "t.jsonl", "--out", "f", "--shard-size", "0"], "--shard-size", "an integer >= 1", "0"),
    (["check-features", "a", "b", "--limit", "-5"], "--limit", "an integer >= 1", "-5"),
    (["check-features", "a", "b", "--min-cosine", "nan"], "--min-cosine", "a number in [-1, 1]", "nan"),
    (["doctor", "d", "--limit", "0"], "--limit", "an integer >= 1", "0"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature", "a finite number >= 0", "nan"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p", "a number in (0, 1]", "1.5"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens", "an integer >= 1", "0"),
    (["generate", "--prompt", "hi", "--method", "ddtree", "--budget", "0"], "--budget", "an integer >= 1", "0"),
]


@pytest.mark.parametrize("argv,option,expected,value", CASES, ids=[f"{c[0][0]} {c[1]} {c[3]}" for c in CASES])
def test_a_refused_option_value_is_one_line_naming_the_option(argv, option, expected, value, capsys, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([*argv, NO_TARGET])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"dflashkit {argv[0]}: error: argument {option}: expected {expected}, got '{value}'" in err, err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_an_unknown_option_names_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--bogus", NO_TARGET])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("dflashkit train: error: unrecognized arguments: --bogus"), err
    assert len(err.strip().splitlines()) == 1
