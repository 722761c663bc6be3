"""The most important test of the project: the drafter's training path and inference path agree.

For the same sequence and anchor, the training-path logits of a block (whole context, many
blocks, training mask) equal the inference-path logits (KV cache filled with the context up to
the anchor, block at positions anchor..anchor+B-1)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_drafter
from dflashkit import masks
from dflashkit.decode.cache import drafter_cache
from dflashkit.drafter import DFlashDrafter, draft_block, drafter_config_for_target, training_hidden
from dflashkit.vocab import default_mask_token_id

SLIDING = ["sliding_attention", "full_attention"]


def _paths(drafter, target, ids, anchor, other_anchors=(3, 29), cache_steps=(0,)):
    """Return (training-path hidden of the block at `anchor`, inference-path hidden)."""
    B = drafter.config.block_size
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    anchors = torch.tensor([[*other_anchors[:1], anchor, *other_anchors[1:]]])
    h_train = training_hidden(drafter, target.embed, ids, feats, anchors)
    j = 1 if other_anchors else 0
    h_train = h_train[:, j * B:(j + 1) * B]
    cache = drafter_cache(drafter)
    # Fill the cache in chunks (as decoding rounds do), drafting a throw-away block each time.
    cuts = [*cache_steps, anchor]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        h_inf = draft_block(drafter, target.embed, cache, feats[:, lo:hi], ids[:, hi])
    assert cache.lengths == [anchor]
    return h_train, h_inf


@pytest.mark.parametrize("layer_types,window", [(None, None), (SLIDING, 6)])
def test_parity_tiny(tiny_target, layer_types, window):
    drafter = make_tiny_drafter(tiny_target, layer_types=layer_types, sliding_window=window)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 40))
    h_train, h_inf = _paths(drafter, tiny_target, ids, anchor=17, cache_steps=(0, 5, 11))
    torch.testing.assert_close(tiny_target.lm_head(h_inf)[:, 1:], tiny_target.lm_head(h_train)[:, 1:], atol=2e-5, rtol=1e-4)


def test_shifted_block_positions_break_parity(tiny_target, monkeypatch):
    """Mistake 1 (block positions one step too late at evaluation time) must be caught."""
    drafter = make_tiny_drafter(tiny_target)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 40))
    h_train, h_ok = _paths(drafter, tiny_target, ids, anchor=17)
    real_forward = DFlashDrafter.forward

    def late(self, block_emb, ctx, block_pos, *a, **k):
        return real_forward(self, block_emb, ctx, block_pos + 1, *a, **k)

    monkeypatch.setattr(DFlashDrafter, "forward", late)
    cache = drafter_cache(drafter)
    h_late = draft_block(drafter, tiny_target.embed, cache, tiny_target.forward(ids, drafter.config.target_layer_ids).features[:, :17], ids[:, 17])
    assert torch.allclose(h_ok, h_train, atol=2e-5)
    assert (h_late - h_train).abs().max() > 1e-3


def test_inference_block_starts_at_bonus_position(tiny_target, monkeypatch):
    """The block's slot 0 sits at the bonus token's own position = number of cached context tokens."""
    drafter = make_tiny_drafter(tiny_target)
    seen = {}
    real_forward = DFlashDrafter.forward

    def spy(self, block_emb, ctx, block_pos, ctx_pos, *a, **k):
        seen["block"], seen["ctx"] = block_pos.clone(), ctx_pos.clone()
        return real_forward(self, block_emb, ctx, block_pos, ctx_pos, *a, **k)

    monkeypatch.setattr(DFlashDrafter, "forward", spy)
    ids = torch.randint(3, 120, (1, 12))
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids).features
    draft_block(drafter, tiny_target.embed, drafter_cache(drafter), feats[:, :9], ids[:, 9])
    assert seen["ctx"].tolist() == [list(range(9))]
    assert seen["block"].tolist() == [list(range(9, 9 + drafter.config.block_size))]
    assert masks.block_positions(torch.tensor([[4, 20]]), 3).tolist() == [[4, 5, 6, 20, 21, 22]]


@pytest.mark.slow
@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention", "sliding_attention"], 24)])
def test_parity_smollm2(smollm2, layer_types, window):
    tok = smollm2.tokenizer
    mask_id = default_mask_token_id(tok, smollm2.vocab_size)
    torch.manual_seed(3)
    cfg = drafter_config_for_target(smollm2.config, mask_id, num_layers=3, layer_types=layer_types, sliding_window=window)
    drafter = DFlashDrafter(cfg)
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = tok(text, return_tensors="pt").input_ids
    anchor = ids.shape[1] - 20
    h_train, h_inf = _paths(drafter, smollm2, ids, anchor=anchor, other_anchors=(5, anchor + 3), cache_steps=(0, 8, 15))
    lt, li = smollm2.lm_head(h_train)[:, 1:], smollm2.lm_head(h_inf)[:, 1:]
    torch.testing.assert_close(li, lt, atol=1e-4, rtol=1e-4)
    assert (li.argmax(-1) == lt.argmax(-1)).all()
