"""The held-out split for tau_sim is drawn suite by suite when sample ids carry suite labels."""

from __future__ import annotations

from dflashkit.train import held_out_groups, sample_group, split_eval


def test_sample_group_strips_the_trailing_number():
    assert [sample_group(i) for i in ("builtin-math-00017", "HumanEval/3", "code-03", "x_7", "plain")] == [
        "builtin-math", "HumanEval", "code", "x", "plain"]


def test_split_is_balanced_over_suites():
    ids = [f"big-{i}" for i in range(50)] + [f"small-{i}" for i in range(10)]
    train, held = split_eval(len(ids), 10, seed=0, ids=ids)
    assert sorted(train + held) == list(range(60)) and len(held) == 10
    groups = held_out_groups(ids, held)
    assert {g: len(v) for g, v in groups.items()} == {"big": 5, "small": 5}  # a random draw gives ~8 / 2
    assert split_eval(len(ids), 10, seed=0, ids=ids) == (train, held)  # deterministic


def test_split_without_suite_labels_is_the_plain_random_one():
    n = 60
    plain = split_eval(n, 10, seed=3)
    assert split_eval(n, 10, seed=3, ids=[f"id{i}x" for i in range(n)]) == plain  # every id its own group
    assert split_eval(n, 10, seed=3, ids=[f"one-{i}" for i in range(n)]) == plain  # a single suite
    assert held_out_groups([f"one-{i}" for i in range(n)], plain[1]) == {}
