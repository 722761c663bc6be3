"""The drafter family (DFlash, DFlash 2, DSpark): one backbone, modules declared by the config."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_family
from dflashkit import family
from dflashkit.decode.cache import drafter_cache
from dflashkit.drafter import DFlashDrafter, DrafterConfig, draft_block, training_hidden, upgraded
from dflashkit.family import block_conv
from dflashkit.objective import (LossSettings, block_loss, block_predecessors, micro_batch, pad_anchors,
                                 selector_terms)


def test_block_conv_is_causal_inside_each_block_only():
    torch.manual_seed(0)
    B, H, k, G = 4, 8, 2, 2
    x = torch.randn(1, 3 * B, H)
    delta, base = torch.randn(1, 3 * B, k, G), torch.randn(k, H)
    y = block_conv(x, delta, base, B, H // G)
    x2 = x.clone()
    x2[:, B + 2] += 1.0  # block 1, position 2: moves positions 2 and 3 of block 1, nothing else
    changed = (block_conv(x2, delta, base, B, H // G) - y).abs().amax(-1)[0] > 0
    assert changed.nonzero().flatten().tolist() == [B + 2, B + 3]
    # A block drafted shorter at inference is the prefix of the full block's convolution.
    torch.testing.assert_close(block_conv(x[:, :3], delta[:, :3], base, 3, H // G), y[:, :3])


def test_fresh_dflash2_computes_its_backbone(tiny_target):
    """Convolutions start as the identity: DFlash 2 from a DFlash drafter drafts as it did."""
    base = make_tiny_drafter(tiny_target)
    from dflashkit.config import DrafterSettings

    up = upgraded(base, DrafterSettings(kind="dflash2", selector_rank=8, selector_top_k=4))
    assert up.config.kind == "dflash2" and up.config.conv_kernel_size == 2
    ids = torch.randint(3, 120, (1, 30))
    feats = tiny_target.forward(ids, base.config.target_layer_ids, logits=False).features
    anchors = torch.tensor([[4, 11, 20]])
    torch.testing.assert_close(training_hidden(up, tiny_target.embed, ids, feats, anchors),
                               training_hidden(base, tiny_target.embed, ids, feats, anchors))


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_family_parity(tiny_target, kind):
    """Training-path and inference-path hidden states of a block agree with every module random."""
    drafter = make_tiny_family(tiny_target, kind)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 40))
    anchor = 17
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    B = drafter.config.block_size
    h_train = training_hidden(drafter, tiny_target.embed, ids, feats, torch.tensor([[3, anchor, 29]]))[:, B:2 * B]
    cache = drafter_cache(drafter)
    draft_block(drafter, tiny_target.embed, cache, feats[:, :9], ids[:, 9])
    h_inf = draft_block(drafter, tiny_target.embed, cache, feats[:, 9:anchor], ids[:, anchor])
    torch.testing.assert_close(h_inf, h_train, atol=2e-5, rtol=1e-4)
    if kind == "dflash2":  # the selector's scores of the block, teacher-forced, from either path
        sel = drafter.selector()
        preds = block_predecessors(ids, torch.tensor([[anchor]]), B)[0]
        cands = tiny_target.lm_head(h_train[0]).topk(4, -1).indices
        torch.testing.assert_close(sel(h_inf[0], preds[:, None], cands), sel(h_train[0], preds[:, None], cands),
                                   atol=2e-5, rtol=1e-4)


def test_dflash2_loss_and_metrics(tiny_target):
    drafter = make_tiny_family(tiny_target, "dflash2")
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    anchors, valid = pad_anchors([torch.tensor([2, 7, 12]), torch.tensor([5, 9])])
    mb = micro_batch(ids, lm, torch.ones_like(lm), feats, anchors, valid, drafter.config.block_size)
    out = block_loss(drafter, tiny_target.embed, tiny_target.model.get_output_embeddings().weight.detach(), mb, LossSettings())
    out.loss_sum.backward()
    sel = drafter.selector()
    assert sel.hidden_projection.weight.grad.abs().sum() > 0 and sel.successor_codebook.grad.abs().sum() > 0
    assert drafter.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0
    x = out.extra
    assert 0 <= x["selector_hits"] <= x["recall_hits"] <= x["rows"] == len(mb.label_rows)
    no_sel = block_loss(drafter, tiny_target.embed, tiny_target.model.get_output_embeddings().weight.detach(), mb,
                        LossSettings(selector_alpha=0.0))
    assert out.loss_sum > no_sel.loss_sum  # the K-way cross-entropy is added


def test_family_config_round_trip_and_errors():
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=128, num_target_layers=6,
                        target_layer_ids=[1, 3], mask_token_id=127, block_size=8)
    from dataclasses import replace

    d2 = replace(cfg, conv_kernel_size=2, selector_rank=8, selector_top_k=4)
    j = d2.to_json_dict()
    assert j["architectures"] == ["DFlash2DraftModel"] and j["dflash_config"]["selector_top_k"] == 4
    assert DrafterConfig.from_json_dict(j) == d2
    assert "conv_kernel_size" not in cfg.to_json_dict()["dflash_config"]
    with pytest.raises(ValueError, match="selector_top_k"):
        replace(cfg, selector_rank=8, selector_top_k=500)
    with pytest.raises(ValueError, match="conv_group_size"):
        replace(cfg, conv_kernel_size=2, conv_group_size=24)
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        replace(cfg, enable_confidence_head=True, confidence_head_with_markov=True)
    bad = {**j, "dflash_config": {**j["dflash_config"], "selector_top_k": "16"}}
    with pytest.raises(ValueError, match="config.json: 'dflash_config.selector_top_k'"):
        DrafterConfig.from_json_dict(bad)


def _plain_scores(self, hidden, predecessors, candidates):
    """The selector's transition scores in plain autograd: gathered codebook rows and a matmul."""
    pred = self.predecessor_codebook[predecessors.long()]
    context = pred * self.hidden_projection(hidden).unsqueeze(-2).to(pred.dtype)
    return context @ self.successor_codebook[candidates.long()].transpose(-1, -2)


def test_selector_loss_and_gradients_equal_plain_autograd(monkeypatch):
    """`selector_terms` through the selector's chunked edge scores (their own backward, the codebook's
    gradient by index_add_) equals the plain formulation: loss, pick, and every gradient; and
    decoding's lattice shape ([b, S, K] predecessors) scores alike."""
    torch.manual_seed(0)
    V, H, r, K, N = 40, 12, 6, 4, 37
    monkeypatch.setattr(family, "EDGE_CHUNK", 5 * K * r)  # 8 chunks, the last one short
    sel = family.CandidateSelector(V, H, r, K, std=0.5)
    h = torch.randn(N, H, requires_grad=True)
    preds = torch.randint(0, V, (N,))
    preds[:12] = 3  # a predecessor repeated over many rows
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
    ids[:, 1] = torch.where((ids == 7).any(-1), ids[:, 1], 7)  # a candidate of every row
    labels = torch.where(torch.arange(N) % 2 == 0, ids[:, 2], torch.randint(0, V, (N,)))  # half hit the top-K
    ids = torch.cat([ids, labels[:, None]], 1)
    logits = torch.randn(N, K + 1, requires_grad=True)
    w = torch.rand(N)

    def run():
        ce, pick, extra = selector_terms(sel, h, preds, labels, ids, logits)
        params = [h, logits, *sel.parameters()]
        grads = torch.autograd.grad((w * ce).sum(), params)
        lattice = sel(h[:6].view(2, 3, H), ids[:6, :K].view(2, 3, K), ids[6:12, :K].view(2, 3, K))
        return ce, pick, extra["selector_hits"], grads, lattice

    fast = run()
    monkeypatch.setattr(family.CandidateSelector, "forward", _plain_scores)
    plain = run()
    assert fast[2] > 0 and torch.equal(fast[1], plain[1])
    torch.testing.assert_close(fast[0], plain[0])
    torch.testing.assert_close(fast[4], plain[4])
    for a, b in zip(fast[3], plain[3]):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b)
