"""The search for the longest sequence that fits a memory budget (`benchmarks/bench_train.py
--max-seq`)."""

from __future__ import annotations

from dflashkit.bench.memory import bisect_longest


def test_bisect_longest_finds_the_limit_below_and_above_a_wrong_prediction():
    for limit, start in [(128_768, 176_768), (200_064, 176_768), (50_048, 176_768)]:
        calls = []

        def fits(T: int) -> bool:
            calls.append(T)
            return T <= limit

        r = bisect_longest(fits, start, known_fit=6144, mult=64, tries=20)
        assert r["fits"] <= limit < r["fails_at"] and r["fails_at"] - r["fits"] <= 64, (limit, r)
        assert r["tried"] == calls and len(calls) <= 20


def test_bisect_longest_reports_what_it_knows_when_tries_run_out():
    r = bisect_longest(lambda T: T <= 100_000, 176_768, known_fit=6144, mult=64, tries=3)
    assert r["fits"] is None or r["fits"] <= 100_000
    assert r["fails_at"] > 100_000 and len(r["tried"]) == 3
