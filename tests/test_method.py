"""The decoding method as one typed object, and an engine built from its parts."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_target
from dflashkit.decode.engine import Engine, Parts
from dflashkit.decode.loop import generate_batch
from dflashkit.method import Method


def test_method_of_the_api_and_cli_spellings():
    ar, dflash, tree = Method.of("ar"), Method.of("dflash", budget=32), Method.of("ddtree", 8, None)
    assert (ar.drafts, ar.chain, ar.tree_budget, ar.label) == (False, True, None, None)
    assert (dflash.drafts, dflash.chain, dflash.tree_budget, dflash.label) == (True, True, None, "dflash")
    assert dflash == Method("dflash")  # a budget means nothing to a chain: one method, one cost-aware key
    assert (tree.drafts, tree.chain, tree.tree_budget, tree.label) == (True, False, 8, "ddtree-8")
    assert [m.widest(16) for m in (ar, dflash, tree)] == [1, 16, 9]
    assert Method.of(tree) is tree


@pytest.mark.parametrize("args,message", [
    (("beam",), "method: expected one of"), (("ddtree",), "node budget >= 1"),
    (("ddtree", 8, 0), r"top_k \(DDTree's candidates per slot\).*got 0")])
def test_method_refuses_what_it_cannot_decode(args, message):
    with pytest.raises(ValueError, match=message):
        Method.of(*args)


def test_a_method_object_decodes_as_its_spelling():
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    prompts = [torch.randint(3, 120, (9,)), torch.randint(3, 120, (5,))]
    by_name = generate_batch(Engine(target, drafter), prompts, max_new_tokens=10, method="ddtree", budget=6)
    by_object = generate_batch(Engine(target, drafter), prompts, max_new_tokens=10, method=Method("ddtree", 6))
    assert [g.tokens for g in by_object] == [g.tokens for g in by_name]
    assert [g.accept_lengths for g in by_object] == [g.accept_lengths for g in by_name]


def test_engine_runs_the_parts_it_is_built_from():
    """The draft step and the commit's device work an engine runs are the ones its `Parts` made
    from its own eager step and cache (the static engine's CUDA graphs come in this way)."""
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    calls = {"draft": 0, "commit": 0, "commit_caches": []}

    def graph_draft(step, key):
        def counted(*args):
            calls["draft"] += 1
            return step(*args)
        return counted, step

    def graph_commit(cache):
        calls["commit_caches"].append(cache)

        def counted(*args):
            calls["commit"] += 1
            return cache.apply(*args)
        return counted

    engine = Engine(target, drafter, parts=Parts(graph_draft=graph_draft, graph_commit=graph_commit, slot_bucket=64))
    plain = Engine(target, drafter)
    prompts = [torch.randint(3, 120, (9,))]
    got = generate_batch(engine, prompts, max_new_tokens=12, method="ddtree", budget=6)[0]
    assert got.tokens == generate_batch(plain, prompts, max_new_tokens=12, method="ddtree", budget=6)[0].tokens
    assert calls["commit_caches"] == [engine.cache] and engine.slot_bucket == 64
    assert calls["commit"] == got.rounds  # every round's commit through the parts
    assert calls["draft"] == got.rounds - 1  # and every draft but the first (the prompt's context, eagerly: no small_pass)
