"""The one rollback: after any sequence of chain and tree commits, every row's cache equals a
fresh prefill of the tokens it committed, for every layer kind (full, sliding named per layer,
sliding without layer types), on both runners."""

from __future__ import annotations

from collections.abc import Collection

import pytest
import torch

from conftest import children, make_tiny_drafter, ragged_trees
from datahelpers import one_thread  # noqa: F401
from dflashkit.decode.cache import KVCache
from dflashkit.decode.engine import Engine
from dflashkit.decode.static import static_engine
from dflashkit.decode.tree import verification
from test_decode import sliding_targets

pytestmark = pytest.mark.usefixtures("one_thread")


def test_commit_moves_each_rows_path_to_its_length():
    kv = KVCache(1)
    kv.start(2, torch.device("cpu"))
    kv.reserve(8)
    kv.write(0, torch.zeros(2, 1, 3, 1), torch.zeros(2, 1, 3, 1), torch.tensor([[0, 1, 2]] * 2))
    kv.advance([3, 1])  # row 0 holds 3 positions, row 1 one
    nodes = torch.arange(10, 14, dtype=torch.float).view(1, 1, 4, 1).repeat(2, 1, 1, 1) + torch.tensor([0, 100.0]).view(2, 1, 1, 1)
    kv.write(0, nodes, nodes, kv.lengths_t[:, None] + torch.arange(4))
    kv.commit([[0, 2, 3], [0, 1]])  # row 0: a tree path, row 1: a chain
    assert kv.lengths == [6, 3] and kv.lengths_t.tolist() == [6, 3]
    assert kv.k[0, 0, 0, 3:6, 0].tolist() == [10, 12, 13]
    assert kv.k[0, 1, 0, 1:3, 0].tolist() == [110, 111]
    kv.keep_rows([1])
    assert kv.lengths == [3] and kv.k.shape[1] == 1 and kv.k[0, 0, 0, 1, 0] == 110


def test_put_rows_fills_idle_rows_and_appends():
    kv, src = KVCache(1), KVCache(1)
    kv.start(2, torch.device("cpu"))
    kv.reserve(4)
    kv.write(0, torch.ones(2, 1, 2, 1), torch.ones(2, 1, 2, 1), torch.tensor([[0, 1]] * 2))
    kv.advance([2, 1])
    src.start(2, torch.device("cpu"))
    src.reserve(100)  # more slots than kv holds: kv grows
    new = torch.tensor([[7.0, 8, 9], [5, 6, 0]]).view(2, 1, 3, 1)
    src.write(0, new, new, torch.tensor([[0, 1, 2]] * 2))
    src.advance([3, 2])
    kv.put_rows(src, [1, 2])  # row 1 taken again, row 2 appended
    assert kv.lengths == [2, 3, 2] and kv.lengths_t.tolist() == [2, 3, 2] and kv.capacity >= 100
    assert kv.k[0, :, 0, :3, 0].tolist() == [[1, 1, 0], [7, 8, 9], [5, 6, 0]] and torch.equal(kv.k, kv.v)


def _random_round(engine, gen: torch.Generator, V: int, idle: Collection[int] = ()):
    """A random tree per row (a chain for some), verified and committed along a random path (idle
    rows commit nothing)."""
    b = engine.batch
    trees = ragged_trees([int(torch.randint(0, 12, (1,), generator=gen)) for _ in range(b)], V, gen)
    bonus = torch.randint(3, V, (b,), generator=gen)
    tokens, depths, anc = verification(bonus, trees)
    engine.draft(bonus)
    engine.verify(tokens, depths, anc)
    paths = []
    for r in range(b):
        path, kids = [0], children(trees, r)
        while kids[path[-1]] and torch.rand(1, generator=gen) < 0.7:
            options = list(kids[path[-1]].values())
            path.append(options[int(torch.randint(len(options), (1,), generator=gen))])
        paths.append(path)
    paths = [[] if i in idle else p for i, p in enumerate(paths)]
    engine.commit(paths)
    return [[int(tokens[i, j]) for j in p] for i, p in enumerate(paths)]


@pytest.mark.parametrize("kind", ["full", "layer_types", "window_only"])
@pytest.mark.parametrize("runner", ["hf", "static"])
def test_cache_after_commits_equals_fresh_prefill(tiny_target, kind, runner):
    target = tiny_target if kind == "full" else sliding_targets()[kind]
    if runner == "static" and kind == "window_only":
        pytest.skip("the static runner serves Llama/Qwen/Gemma-family targets (this one is Mistral)")
    make = Engine if runner == "hf" else (lambda t, d: static_engine(t, d, fuse=False))
    drafter = make_tiny_drafter(target)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 120, (n,), generator=gen) for n in (9, 4, 13)]
    eng = make(target, drafter)
    eng.prefill(prompts, capacity=16)  # small: the cache must grow
    committed = [p.tolist() for p in prompts]
    for _ in range(6):
        for row, new in zip(committed, _random_round(eng, gen, target.vocab_size)):
            row += new
    assert eng.lengths == [len(c) for c in committed]
    fresh = make(target, drafter)
    fresh.prefill([torch.tensor(c) for c in committed], capacity=64)
    for i, n in enumerate(eng.lengths):
        torch.testing.assert_close(eng.cache.k[:, i, :, :n], fresh.cache.k[:, i, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(eng.cache.v[:, i, :, :n], fresh.cache.v[:, i, :, :n], atol=1e-4, rtol=1e-4)
    # and the next token's logits agree with the target's own forward over the committed tokens
    bonus = torch.tensor([5, 6, 7])
    logits = eng.verify(bonus[:, None], torch.zeros(3, 1, dtype=torch.long))[:, 0]
    for i, c in enumerate(committed):
        want = target.model(torch.tensor([c + [int(bonus[i])]])).logits[0, -1]
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)
