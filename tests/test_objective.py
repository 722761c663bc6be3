"""The training objective: anchors, masks, labels, the loss and noise (docs/conventions.md), and regression tests
for the conventions' mistakes 2 (fc fed the label layer), 3 (noise before the label split), 4 (a loss other
than the recipe) and 6 (context that leaks the anchor's own or later positions)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_drafter
from dflashkit import masks
from dflashkit.config import Config, load_config
from dflashkit.drafter import training_hidden
from dflashkit.objective import (IGNORE, LossSettings, block_labels, block_loss, check_label_sources, dpace_weights,
                                 head_losses, micro_batch, pad_anchors, sample_anchors, slot_weights)
from dflashkit.train import Batcher


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models on a shared 2-core machine: more threads only contend.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(target, drafter, T=40, anchors=((3, 17, 29),), seed=0, loss_mask=None, final=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (len(anchors), T), generator=g)
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    fh = target.forward(ids, [target.num_layers - 1], logits=False).features if final else None
    a, valid = pad_anchors([torch.tensor(x) for x in anchors])
    lm = torch.ones_like(ids, dtype=torch.bool) if loss_mask is None else loss_mask
    return micro_batch(ids, lm, torch.ones_like(lm), feats, a, valid, drafter.config.block_size, fh)


# ---- anchors, labels, masks ------------------------------------------------------------------


def test_anchor_candidates_and_uniform_sampling():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.bool)
    every = sample_anchors(mask, 100)
    assert every.tolist() == [1, 2, 7]  # p and p+1 both supervised
    counts = torch.zeros(10)
    for s in range(600):
        pick = sample_anchors(mask, 2, torch.Generator().manual_seed(s))
        assert len(pick) == 2 and len(set(pick.tolist())) == 2 and pick.tolist() == sorted(pick.tolist())
        counts[pick] += 1
    assert counts[[0, 3, 4, 5, 6, 8, 9]].sum() == 0
    assert (counts[[1, 2, 7]] / 600 - 2 / 3).abs().max() < 0.08  # uniform without replacement


def test_labels_are_same_position_and_masked():
    T, B = 12, 4
    ids = torch.arange(100, 100 + T)[None]
    lm = torch.ones(1, T, dtype=torch.bool)
    lm[0, 6] = False
    anchors, valid = pad_anchors([torch.tensor([0, 4, 9])], multiple=4)
    lab = block_labels(ids, lm, anchors, valid, B).view(-1, B)
    assert lab[0].tolist() == [IGNORE, 101, 102, 103]  # slot k predicts ids[a + k]: no shift
    assert lab[1].tolist() == [IGNORE, 105, IGNORE, 107]  # loss_mask 0 at position 6
    assert lab[2].tolist() == [IGNORE, 110, 111, IGNORE]  # position 12 lies past the sequence
    assert (lab[3] == IGNORE).all()  # padding block


def test_mask_semantics_anchor_strict_bidirectional_isolated_sliding():
    B, T = 4, 12
    anchors = torch.tensor([[3, 8]])
    ctx_valid = torch.ones(1, T, dtype=torch.bool)
    ctx_valid[0, 11] = False  # padding
    layout = masks.training_layout(anchors, B, ctx_valid)
    full = masks.dense_mask(layout, None)[0, 0]  # [8 queries, T + 8 keys]
    win = masks.dense_mask(layout, 3)[0, 0]
    for j, a in enumerate([3, 8]):
        for k in range(B):
            q = j * B + k
            assert full[q, :a].all() and not full[q, a:T].any()  # context strictly before the anchor
            assert full[q, T + j * B: T + (j + 1) * B].all()  # its whole block, both directions
            other = [T + i for i in range(2 * B) if i // B != j]
            assert not full[q, other].any()  # never another block
            assert win[q, :T].nonzero().flatten().tolist() == list(range(max(0, a - 3), a))  # sliding bound
    assert not full[:, 11].any()  # padding is visible to nobody


# ---- mistake 6: no leak of the anchor's own or later positions --------------------------------


def test_context_features_at_or_after_anchor_never_reach_the_block(tiny_target):
    drafter = make_tiny_drafter(tiny_target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    mb = _batch(tiny_target, drafter, anchors=((5, 17, 29),))
    B, a, j = drafter.config.block_size, 17, 1
    run = lambda f: tiny_target.lm_head(training_hidden(drafter, tiny_target.embed, mb.input_ids, f, mb.anchors))[:, j * B:(j + 1) * B]  # noqa: E731
    base = run(mb.features)
    later = mb.features.clone()
    later[:, a:] += 10 * torch.randn_like(later[:, a:])  # the anchor's own features and everything after
    torch.testing.assert_close(run(later), base, rtol=0, atol=0)
    before = mb.features.clone()
    before[:, a - 1] += 10  # the last visible context position must matter (the test can fail)
    assert (run(before) - base).abs().max() > 1e-3


# ---- mistake 4: the default loss is the recipe ----------------------------------------------


def _recipe_by_hand(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> float:
    """The recipe: hard CE, weight exp(-(k-1)/gamma) on slot k >= 1, normalised by the sum of weights."""
    total = norm = 0.0
    for j in range(logits.shape[0]):
        for k in range(1, logits.shape[1]):
            y = int(labels[j, k])
            if y == IGNORE:
                continue
            z = logits[j, k].detach().double()
            w = math.exp(-(k - 1) / gamma)
            total += w * float(torch.logsumexp(z, 0) - z[y])
            norm += w
    return total / norm


def test_default_config_is_the_recipe():
    tc = Config().train
    s = LossSettings.from_config(tc, 16)
    assert (s.loss, s.gamma, tc.feature_noise) == ("ce", 7.0, 0.0)
    assert (LossSettings.from_config(tc, 10).gamma, LossSettings.from_config(tc, 8).gamma) == (5.0, 4.0)
    assert (tc.lr, tc.weight_decay, tc.warmup_ratio, tc.grad_clip, tc.anchors_per_seq) == (6e-4, 0.0, 0.04, 1.0, 512)
    assert slot_weights(4, 7.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


def test_default_loss_equals_hand_computed_recipe(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    lm = torch.ones(2, 40, dtype=torch.bool)
    lm[0, 20:23] = False
    lm[1, :6] = False
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 33), (6, 30)), loss_mask=lm, final=True)
    W = tiny_target.model.get_output_embeddings().weight
    settings = LossSettings.from_config(Config().train, drafter.config.block_size)
    out = block_loss(drafter, tiny_target.embed, W, mb, settings)
    B = drafter.config.block_size
    h = training_hidden(drafter, tiny_target.embed, mb.input_ids, mb.features, mb.anchors)
    logits = tiny_target.lm_head(h).view(-1, B, tiny_target.vocab_size)
    want = _recipe_by_hand(logits, mb.labels.view(-1, B), gamma=settings.gamma)
    assert float(out.loss_sum / out.weight_sum) == pytest.approx(want, rel=1e-5)
    # The known-bad recipe of docs/conventions.md (mistake 4) (70 % soft KL at T=2, gamma=10) is a different number.
    bad = block_loss(drafter, tiny_target.embed, W, mb, LossSettings(loss="kl", gamma=10.0, kl_weight=0.7, kl_temperature=2.0))
    assert abs(float(bad.loss_sum / bad.weight_sum) - want) > 1e-2


def test_chunked_head_matches_dense_autograd():
    torch.manual_seed(0)
    N, H, V, T = 13, 16, 50, 2.0
    W = torch.randn(V, H)
    h = torch.randn(N, H, requires_grad=True)
    th = torch.randn(N, H)
    y = torch.randint(0, V, (N,))
    a, b = torch.rand(N), torch.rand(N)
    ce, kl, top = head_losses(h, W, y, th, T, chunk_rows=4)
    ((a * ce).sum() + (b * kl).sum()).backward()
    h2 = h.detach().clone().requires_grad_()
    z, zt = h2 @ W.T, th @ W.T
    ce2 = torch.nn.functional.cross_entropy(z, y, reduction="none")
    kl2 = T * T * (torch.softmax(zt / T, -1) * (torch.log_softmax(zt / T, -1) - torch.log_softmax(z / T, -1))).sum(-1)
    ((a * ce2).sum() + (b * kl2).sum()).backward()
    torch.testing.assert_close(ce, ce2.detach())
    torch.testing.assert_close(kl, kl2.detach())
    assert top.tolist() == z.argmax(-1).tolist()
    torch.testing.assert_close(h.grad, h2.grad)
    with pytest.raises(ValueError, match="frozen"):
        head_losses(h, W.requires_grad_(), y)


def _full_logits_reference(drafter, target, mb, settings):
    """The loss of `block_loss` computed the plain way: [slots, vocab] logits for every slot, autograd."""
    B, V = drafter.config.block_size, target.vocab_size
    W = target.model.get_output_embeddings().weight.detach()
    logits = training_hidden(drafter, target.embed, mb.input_ids, mb.features, mb.anchors, mb.ctx_valid) @ W.T
    labels = mb.labels.view(-1, B)
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(logits.view(-1, V), labels.flatten(), reduction="none").view(-1, B)
    if settings.loss == "dpace":
        w = dpace_weights(ce, valid, settings.dpace_alpha)
    else:
        w = slot_weights(B, settings.gamma).expand_as(ce) * valid
    per = ce
    if settings.loss == "kl":  # the target's distribution over position p comes from its final hidden state at p - 1
        T = settings.kl_temperature
        prev = (mb.anchors[..., None] + torch.arange(B) - 1).clamp(0, mb.input_ids.shape[1] - 1).flatten(1)
        target_logits = torch.stack([mb.final_hidden[i, prev[i]] for i in range(len(prev))]) @ W.T
        pt = torch.softmax(target_logits.view(-1, B, V) / T, -1)
        kl = T * T * (pt * (pt.log() - torch.log_softmax(logits.view(-1, B, V) / T, -1))).sum(-1)
        per = (1 - settings.kl_weight) * ce + settings.kl_weight * kl
    loss = (w * per)[valid].sum() / w[valid].sum()
    hit = (logits.view(-1, B, V).argmax(-1) == labels) & valid
    return loss, hit


@pytest.mark.parametrize("loss", ["ce", "kl", "dpace"])
def test_block_loss_in_row_chunks_equals_full_logits(tiny_target, loss):
    """Values and gradients of the chunked head equal the loss over full [slots, vocab] logits."""
    drafter = make_tiny_drafter(tiny_target)
    lm = torch.ones(2, 40, dtype=torch.bool)
    lm[0, 20:23] = False
    lm[1, :6] = False
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 35), (6, 30)), loss_mask=lm, final=True)
    W = tiny_target.model.get_output_embeddings().weight.detach()
    settings = LossSettings(loss=loss, gamma=4.0, kl_weight=0.6, kl_temperature=2.0, dpace_alpha=0.3)
    n_rows = len(mb.label_rows)
    grads = []
    for chunk in (3, n_rows):  # ragged chunks; one chunk
        drafter.zero_grad()
        out = block_loss(drafter, tiny_target.embed, W, mb, settings, chunk_rows=chunk)
        got = out.loss_sum / out.weight_sum
        got.backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters()})
    drafter.zero_grad()
    want, hit = _full_logits_reference(drafter, tiny_target, mb, settings)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(grads[0][n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
        torch.testing.assert_close(grads[1][n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    B = drafter.config.block_size
    assert out.slot_correct.tolist() == hit.sum(0).float().tolist()
    lead = hit[:, 1:].long().cumprod(-1).sum(-1) + 1
    assert out.accept_len.tolist() == lead.tolist()
    assert out.slot_count.tolist() == (mb.labels.view(-1, B) != IGNORE).sum(0).float().tolist()


def test_trainer_runs_the_head_in_default_chunks(tiny_target, monkeypatch):
    """The trainer's step (loss, gradients, accuracy) never holds more than HEAD_CHUNK_LOGITS logits."""
    import dflashkit.objective as obj
    from dflashkit.train import Trainer

    V = tiny_target.vocab_size
    monkeypatch.setattr(obj, "HEAD_CHUNK_LOGITS", 5 * V)  # 5 rows per chunk
    chunks = []
    real = obj._head_chunk

    def spy(h, *a, **k):
        chunks.append(h.shape[0])
        return real(h, *a, **k)

    monkeypatch.setattr(obj, "_head_chunk", spy)
    drafter = make_tiny_drafter(tiny_target)
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 29),))
    W = tiny_target.model.get_output_embeddings().weight
    trainer = Trainer(drafter, tiny_target.embed, W, Config().train, 10, device=torch.device("cpu"), dtype=torch.float32)
    stats = trainer.step([mb], 1)
    n_rows = len(mb.label_rows)
    assert n_rows > 10 and chunks == [5] * (n_rows // 5) + ([n_rows % 5] if n_rows % 5 else [])
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0


def test_compiled_head_tails_equal_eager():
    """The GPU compiles the elementwise tails of the head; compiled (here by the CPU backend of
    inductor) they give the eager values, gradients in bf16 included."""
    import dflashkit.objective as obj

    g = torch.Generator().manual_seed(0)
    z, zt = (torch.randn(6, 300, generator=g).to(torch.bfloat16) for _ in range(2))
    y = torch.randint(0, 300, (6,), generator=g)
    for fn, args in ((obj._ce_chunk, (z, y, True)), (obj._kl_chunk, (z, zt, 2.0, True)), (obj._overlap_chunk, (z, zt))):
        got, want = torch.compile(fn, dynamic=True)(*args), fn(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dpace_weights_follow_the_paper():
    ce = torch.tensor([[0.0, math.log(2), math.log(4), 0.3]])
    valid = torch.tensor([[False, True, True, False]])
    w = dpace_weights(ce, valid, alpha=0.5)
    q1, q2 = 0.5 * 0.5 + 0.5, 0.5 * 0.25 + 0.5  # smoothed confidences of slots 1 and 2
    assert w.tolist()[0] == pytest.approx([0.0, q1 + q1 * q2, q1 * q2, 0.0])


def test_dpace_loss_uses_detached_confidence_weights(tiny_target):
    drafter = make_tiny_drafter(tiny_target)
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 35),))
    W = tiny_target.model.get_output_embeddings().weight
    out = block_loss(drafter, tiny_target.embed, W, mb, LossSettings(loss="dpace", dpace_alpha=0.5))
    B = drafter.config.block_size
    logits = tiny_target.lm_head(training_hidden(drafter, tiny_target.embed, mb.input_ids, mb.features, mb.anchors))
    labels = mb.labels.view(-1, B)
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.flatten().clamp(min=0),
                                           reduction="none").view(-1, B)
    w = dpace_weights(ce, valid, 0.5)
    assert float(out.loss_sum / out.weight_sum) == pytest.approx(float((w * ce)[valid].sum() / w[valid].sum()), rel=1e-5)
    assert not out.weight_sum.requires_grad  # weights shape the gradient, they get none
    out.loss_sum.backward()
    assert drafter.fc.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()


# ---- mistake 2: fc never fed the layer the labels come from ----------------------------------


def test_kl_target_layer_must_not_be_an_fc_input():
    check_label_sources([1, 9, 17, 25, 33], 36, "kl")
    check_label_sources([1, 9, 35], 36, "ce")  # hard labels are token ids: nothing to leak
    with pytest.raises(ValueError, match="final hidden state.*fc"):
        check_label_sources([1, 9, 35], 36, "kl")


def _feature_cache_samples(tiny_target, layers, n=3, T=24):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(3, 120, (T,), generator=g)
        f = tiny_target.forward(ids[None], layers, logits=False).features[0]
        out.append(SimpleNamespace(id=str(i), input_ids=ids, loss_mask=torch.ones(T, dtype=torch.bool), features=f))
    return out


def _batcher(tiny_target, drafter, samples, layer_ids, **train):
    cfg = load_config(None, [f"train.{k}={v}" for k, v in train.items()])
    return Batcher(samples, layer_ids, tiny_target, drafter.config, cfg.train, 2048, torch.device("cpu"), torch.float32)


def test_fc_gets_exactly_the_taps_and_kl_targets_the_final_layer(tiny_target):
    drafter = make_tiny_drafter(tiny_target)  # taps [1, 2, 3] of 6 layers
    last = tiny_target.num_layers - 1
    cache_layers = [last, 3, 0, 2, 1]  # a cache in another order, holding more layers
    samples = _feature_cache_samples(tiny_target, cache_layers)
    mb = _batcher(tiny_target, drafter, samples, cache_layers, loss="kl", anchors_per_seq=4).build([(0, 0)])
    T = len(samples[0].input_ids)
    taps = tiny_target.forward(samples[0].input_ids[None], drafter.config.target_layer_ids, logits=False).features
    final = tiny_target.forward(samples[0].input_ids[None], [last], logits=False).features
    torch.testing.assert_close(mb.features[:, :T], taps)
    torch.testing.assert_close(mb.final_hidden[:, :T], final)
    # Labels come from token ids: slot k of anchor a is input_ids[a + k].
    B = drafter.config.block_size
    a = int(mb.anchors[0, 0])
    assert mb.labels[0, 1:B].tolist() == [int(x) for x in samples[0].input_ids[a + 1: a + B]][: B - 1] + [IGNORE] * max(0, a + B - T)
    with pytest.raises(ValueError, match="layers \\[5\\] are needed"):
        _batcher(tiny_target, drafter, samples, [3, 0, 2, 1], loss="kl")


# ---- mistake 3: noise never reaches labels or target logits ---------------------------------


def test_feature_noise_reaches_fc_inputs_only(tiny_target, monkeypatch):
    drafter = make_tiny_drafter(tiny_target)
    samples = _feature_cache_samples(tiny_target, [1, 2, 3, tiny_target.num_layers - 1])
    layers = [1, 2, 3, tiny_target.num_layers - 1]
    clean = _batcher(tiny_target, drafter, samples, layers, loss="kl", anchors_per_seq=4).build([(7, 1)])
    noisy = _batcher(tiny_target, drafter, samples, layers, loss="kl", anchors_per_seq=4, feature_noise=5.0).build([(7, 1)])
    assert torch.equal(clean.labels, noisy.labels) and torch.equal(clean.anchors, noisy.anchors)
    assert torch.equal(clean.final_hidden, noisy.final_hidden)
    assert (noisy.features - clean.features).std() > 2.0
    # held-out evaluation (tau_sim) sees the clean features the drafter will be served with
    held_out = _batcher(tiny_target, drafter, samples, layers, loss="kl", anchors_per_seq=4,
                        feature_noise=5.0).build([(7, 1)], held_out=True)
    assert torch.equal(held_out.features, clean.features)
    seen = []
    import dflashkit.objective as obj

    real = obj.head_losses

    def spy(hidden, weight, labels, target_hidden=None, *a, **k):
        seen.append((labels.clone(), target_hidden.clone()))
        return real(hidden, weight, labels, target_hidden, *a, **k)

    monkeypatch.setattr(obj, "head_losses", spy)
    W = tiny_target.model.get_output_embeddings().weight
    settings = LossSettings(loss="kl")
    block_loss(drafter, tiny_target.embed, W, clean, settings)
    block_loss(drafter, tiny_target.embed, W, noisy, settings)
    assert torch.equal(seen[0][0], seen[1][0]) and torch.equal(seen[0][1], seen[1][1])


# ---- back-ends ----------------------------------------------------------------------------


def test_dense_training_mask_is_one_additive_tensor_for_all_layers(tiny_target, monkeypatch):
    """SDPA would convert a boolean mask on every layer and keep each copy for backward."""
    import dflashkit.drafter as dr

    drafter = make_tiny_drafter(tiny_target)
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 29),))
    seen = []
    real = dr.attend
    monkeypatch.setattr(dr, "attend", lambda q, k, v, mask, gqa, **kw: seen.append(mask) or real(q, k, v, mask, gqa, **kw))
    h = training_hidden(drafter, tiny_target.embed, mb.input_ids, mb.features, mb.anchors, backend="sdpa")
    assert len(seen) == drafter.config.num_hidden_layers and all(m is seen[0] for m in seen)
    assert seen[0].dtype == mb.features.dtype
    rule = masks.dense_mask(masks.training_layout(mb.anchors, drafter.config.block_size, mb.ctx_valid), None)
    assert torch.equal(seen[0] == 0, rule) and bool((seen[0][~rule] == float("-inf")).all())
    with torch.no_grad():
        ids = dr.block_token_ids(mb.input_ids.gather(1, mb.anchors), drafter.config.block_size, drafter.config.mask_token_id)
        T = mb.input_ids.shape[1]
        boolean = drafter(tiny_target.embed(ids), mb.features, masks.block_positions(mb.anchors, drafter.config.block_size),
                          torch.arange(T)[None], {"full_attention": rule})
    torch.testing.assert_close(h.detach(), boolean)


def test_flex_block_mask_equals_create_block_mask():
    """The tile counts of the dense rule give FlexAttention exactly the tiles that its own
    `create_block_mask` over `visible` gives: which to skip, which to mask, which to run whole,
    in the same order, for queries and (backward) keys; ragged rows, padding, sliding windows."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    B, T, n = 16, 700, 40
    anchors = torch.stack([torch.sort(300 + torch.randperm(T - B - 300, generator=g)[:n]).values for _ in range(2)])
    anchors[1, 25:] = anchors[1, 24]  # a short row, repeated last anchor (padding blocks)
    ctx_valid = torch.ones(2, T, dtype=torch.bool)
    ctx_valid[1, 500:] = False
    layout = masks.training_layout(anchors, B, ctx_valid)
    qa, qb, kp, kb = layout.q_anchor, layout.q_block, layout.k_pos, layout.k_block
    for window in (None, 200):
        ours = masks.flex_block_mask(layout, window)
        ref = fa.create_block_mask(lambda b, h, q, k: masks.visible(qa[b, q], qb[b, q], kp[b, k], kb[b, k], window),
                                   B=2, H=None, Q_LEN=qa.shape[1], KV_LEN=kp.shape[1], device="cpu")
        assert ours.shape == ref.shape
        for side in ("kv", "full_kv", "q", "full_q"):
            num, idx = getattr(ref, f"{side}_num_blocks"), getattr(ref, f"{side}_indices")
            assert torch.equal(getattr(ours, f"{side}_num_blocks"), num), side
            got = getattr(ours, f"{side}_indices")
            assert got.shape == idx.shape and got.dtype == idx.dtype
            for row in range(2):
                for tile in range(num.shape[-1]):
                    k = int(num[row, 0, tile])  # past the count, the order is unspecified
                    assert torch.equal(got[row, 0, tile, :k], idx[row, 0, tile, :k]), (side, row, tile)
        assert 0 < int(ours.kv_num_blocks.sum()) and 0 < int(ours.full_kv_num_blocks.sum())  # both kinds occur


def test_flex_and_dense_attention_agree(tiny_target):
    if masks.BlockMask is None:
        pytest.skip("FlexAttention is not available in this torch")
    drafter = make_tiny_drafter(tiny_target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    lm = torch.ones(2, 40, dtype=torch.bool)
    mb = _batch(tiny_target, drafter, anchors=((3, 17, 29), (5, 6)), loss_mask=lm)
    with torch.no_grad():  # FlexAttention has no CPU backward; the forward is the reference kernel
        dense = training_hidden(drafter, tiny_target.embed, mb.input_ids, mb.features, mb.anchors, backend="sdpa")
        flex = training_hidden(drafter, tiny_target.embed, mb.input_ids, mb.features, mb.anchors, backend="flex")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-4)
