"""DSpark (drafter family): the Markov-biased loss and the confidence head's, against a plain
computation over full logits with the reference's Markov head; its metrics; training from scratch
and from a DFlash drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_drafter, make_tiny_family, rows_decode_as_alone
from dflashkit.config import Config, DrafterSettings
from dflashkit.drafter import training_hidden, upgraded
from dflashkit.objective import (IGNORE, LossSettings, block_loss, calibration_report, micro_batch, pad_anchors,
                                 slot_weights)


def _batch(target, drafter, anchors=((2, 9, 21), (5, 14)), T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (len(anchors), T), generator=g)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[0, 12:14] = False
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    final = target.forward(ids, [target.num_layers - 1], logits=False).features
    a, valid = pad_anchors([torch.tensor(x) for x in anchors])
    return micro_batch(ids, lm, torch.ones_like(lm), feats, a, valid, drafter.config.block_size, final,
                       drafter.config.sample_from_anchor)


def _reference(drafter, target, mb, settings):
    """The DSpark loss the plain way: [slots, vocab] logits for every slot, speculators' Markov head
    (its `block_bias`) on the drafter's weights, autograd through everything."""
    from speculators.models.dspark.model_definitions import MarkovHead as RefMarkov

    cfg, W = drafter.config, target.model.get_output_embeddings().weight.detach()
    B, V, first = cfg.block_size, W.shape[0], int(cfg.sample_from_anchor)
    hidden = training_hidden(drafter, target.embed, mb.input_ids, mb.features, mb.anchors, mb.ctx_valid)
    hb = hidden.view(-1, B, hidden.shape[-1])
    # The token before each slot's label (position a + k + first - 1), the anchor at the least.
    pos = (mb.anchors[..., None] + torch.arange(B) + first - 1).maximum(mb.anchors[..., None])
    prev = mb.input_ids.gather(1, pos.flatten(1).clamp(max=mb.input_ids.shape[1] - 1)).view(-1, B)
    m = drafter.markov()
    ref = RefMarkov(verifier_vocab_size=V, draft_vocab_size=V, markov_rank=m.rank, hidden_size=hb.shape[-1],
                    head_type=m.kind)
    # The reference's parameters *are* the drafter's: gradients land on the drafter.
    for name, p in m.named_parameters():
        *path, leaf = name.split(".")
        mod = ref
        for part in path:
            mod = getattr(mod, part)
        delattr(mod, leaf)
        setattr(mod, leaf, p)
    logits = (hidden @ W.T).view(-1, B, V) + ref.block_bias(prev_token_ids=prev, hidden_states=hb)
    labels = mb.labels.view(-1, B)
    valid = labels != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE).view(-1, B)
    tpos = (mb.anchors[..., None] + torch.arange(B) + first - 1).clamp(min=0).flatten(1)
    target_logits = torch.stack([mb.final_hidden[i, tpos[i]] for i in range(len(tpos))]).view(-1, B, hidden.shape[-1]) @ W.T
    per = ce
    if settings.loss == "kl":
        T = settings.kl_temperature
        pt = torch.softmax(target_logits / T, -1)
        kl = T * T * (pt * (pt.log() - torch.log_softmax(logits / T, -1))).sum(-1)
        per = (1 - settings.kl_weight) * ce + settings.kl_weight * kl
    k = torch.arange(B, dtype=torch.float32) + first
    w = torch.where(k >= 1, torch.exp(-(k - 1) / settings.gamma), 0.0).expand_as(ce) * valid
    overlap = torch.minimum(torch.softmax(logits, -1), torch.softmax(target_logits, -1)).sum(-1).detach()
    emb = m.markov_w1.weight[prev]
    conf = drafter.confidence()(torch.cat([hb, emb], -1))
    bce = F.binary_cross_entropy_with_logits(conf, overlap.clamp(0, 1), reduction="none")
    loss = ((w * per)[valid].sum() + settings.confidence_alpha * (w * bce)[valid].sum()) / w[valid].sum()
    return loss, logits.detach(), overlap, torch.sigmoid(conf.detach())


@pytest.mark.parametrize("kind,first,loss", [("vanilla", True, "ce"), ("gated", False, "kl"), ("rnn", True, "kl")])
def test_dspark_loss_and_gradients_equal_full_logits(tiny_target, kind, first, loss):
    """Chunked, the biased head's loss and every gradient (W1, W2, the gate / joint projection, the
    confidence head, the backbone) equal autograd over full logits with the reference's head."""
    drafter = make_tiny_family(tiny_target, "dspark", family=dict(markov_head_type=kind, sample_from_anchor=first))
    mb = _batch(tiny_target, drafter)
    W = tiny_target.model.get_output_embeddings().weight.detach()
    settings = LossSettings(loss=loss, gamma=4.0, kl_weight=0.6, kl_temperature=1.5, confidence_alpha=0.7)
    out = block_loss(drafter, tiny_target.embed, W, mb, settings, chunk_rows=5)
    (out.loss_sum / out.weight_sum).backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    want, logits, overlap, conf = _reference(drafter, tiny_target, mb, settings)
    want.backward()
    torch.testing.assert_close(out.loss_sum / out.weight_sum, want.detach(), rtol=1e-5, atol=1e-6)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    heads = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             *{"gated": ["markov_head.gate_proj.weight"], "rnn": ["markov_head.joint_proj.weight"]}.get(kind, [])]
    assert all(got[n].abs().sum() > 0 for n in heads)
    # Metrics: the biased argmax is what accept_len counts; Σ min(p, q) and the confidence their sums.
    B, labels = drafter.config.block_size, mb.labels.view(-1, drafter.config.block_size)
    valid = labels != IGNORE
    hit = (logits.argmax(-1) == labels) & valid
    lead = 1 + hit[:, 1 - int(first):].long().cumprod(-1).sum(-1)
    assert out.accept_len.tolist() == lead.tolist()
    assert float(out.extra["overlap_sum"]) == pytest.approx(float(overlap[valid].sum()), rel=1e-5)
    assert float(out.extra["conf_sum"]) == pytest.approx(float(conf[valid].sum()), rel=1e-5)
    assert float(out.calibration[:, 0].sum()) == valid.sum()
    assert float(out.calibration[:, 2].sum()) == hit.sum()


def test_anchor_first_slot_zero_drafts_and_counts(tiny_target):
    """Anchor-first: slot 0 carries the label a + 1, the first weight, and τ reaches B + 1; the
    held-out histogram has room for it."""
    from dflashkit.train import Trainer

    drafter = make_tiny_family(tiny_target, "dspark")
    B = drafter.config.block_size
    mb = _batch(tiny_target, drafter)
    a = int(mb.anchors[0, 0])
    assert mb.labels[0, :B].tolist() == mb.input_ids[0, a + 1: a + B + 1].tolist()
    assert slot_weights(B, 4.0, anchor_first=True)[0] == 1.0
    trainer = Trainer(drafter, tiny_target.embed, tiny_target.model.get_output_embeddings().weight, Config().train, 10,
                      device=torch.device("cpu"), dtype=torch.float32)
    ev = trainer.evaluate([(mb, True)])
    assert len(ev["accept_hist"]) == B + 1 and len(ev["slot_acc"]) == B
    for k in ("tau_unbiased", "tau_overlap", "conf_bce", "conf_mean", "overlap_mean", "ece_hit", "ece_overlap"):
        assert math.isfinite(ev[k]), k
    assert sum(r["count"] for r in ev["reliability"]) == len(mb.label_rows)


def test_calibration_report_bins_and_ece():
    sums = torch.zeros(10, 4)
    sums[2] = torch.tensor([4, 4 * 0.25, 1, 4 * 0.3])  # 4 rows at 0.25: 1 hit, overlap 0.3
    sums[9] = torch.tensor([6, 6 * 0.95, 6, 6 * 0.9])
    r = calibration_report(sums)
    assert r["reliability"][2] == {"bin": [0.2, 0.3], "predicted": 0.25, "hit": 0.25, "overlap": 0.3, "count": 4}
    assert r["ece_hit"] == pytest.approx(0.6 * 0.05)
    assert r["ece_overlap"] == pytest.approx(0.4 * 0.05 + 0.6 * 0.05)


def test_dspark_from_a_dflash_drafter_trains(tiny_target):
    """A DFlash drafter upgraded to DSpark (its bonus-first layout kept, the Markov bias zero) drafts
    as before at first; a short overfit run lowers its loss, the Markov head's W2 leaving zero."""
    from dflashkit.train import Trainer

    base = make_tiny_drafter(tiny_target)
    with pytest.raises(ValueError, match="sample_from_anchor"):
        upgraded(base, DrafterSettings(kind="dspark", markov_rank=8, sample_from_anchor=True))
    drafter = upgraded(base, DrafterSettings(kind="dspark", markov_rank=8))
    assert drafter.config.kind == "dspark" and not drafter.config.sample_from_anchor
    mb = _batch(tiny_target, drafter, anchors=((2, 9, 21),))
    W = tiny_target.model.get_output_embeddings().weight
    first = block_loss(drafter, tiny_target.embed, W.detach(), mb, LossSettings())
    plain = block_loss(base, tiny_target.embed, W.detach(), mb, LossSettings())
    assert first.accept_len.tolist() == plain.accept_len.tolist()
    tcfg = Config(train={"lr": 1e-2, "warmup_ratio": 0.0}).train
    trainer = Trainer(drafter, tiny_target.embed, W, tcfg, 6, device=torch.device("cpu"), dtype=torch.float32)
    losses = [trainer.step([mb], 1)["loss"] for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.5
    assert drafter.markov().markov_w2.weight.abs().sum() > 0


DSPARK = ["drafter.kind=dspark", "drafter.markov_rank=8", "drafter.markov_head_type=rnn", "train.max_steps=2",
          "train.micro_batch_size=2", "train.eval_every=1000", "train.save_every=1000"]


def test_dspark_trains_in_every_mode(tmp_path):
    """From scratch (anchor-first): online and offline features, the optimiser state on the host,
    and two gloo ranks under DDP and under FSDP2 (each family head its own unit) train alike; the
    held-out calibration reaches best.json."""
    import json

    from dflashkit.data.features import extract_features
    from test_train import _spawn
    from train_job import losses, make_tiny_target, run_job, tiny_samples

    one = run_job(str(tmp_path / "one"), [*DSPARK, "train.eval_every=2"])
    ref = losses(one)
    assert sorted(ref) == [1, 2] and all(math.isfinite(v) for v in ref.values())
    best = json.loads((one / "best.json").read_text())
    assert set(best["calibration"]) == {"ece_hit", "ece_overlap", "reliability"}
    assert losses(run_job(str(tmp_path / "host"), [*DSPARK, "train.optimizer_state=host"])) == ref
    cache = tmp_path / "features"
    extract_features(make_tiny_target(), tiny_samples(), [1, 2, 3, 5], cache, dtype="float32", shard_size=300)
    offline = run_job(str(tmp_path / "offline"), [*DSPARK, f"data.features={cache}"], samples=None)
    assert losses(offline) == pytest.approx(ref, rel=1e-5)
    # DFlash 2's selector, like DSpark's heads, runs after the drafter's forward: under FSDP2 too.
    dflash2 = [*DSPARK[3:], "drafter.kind=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4"]
    ref2 = losses(run_job(str(tmp_path / "one2"), dflash2))
    _spawn(2, [(str(tmp_path / "ddp"), DSPARK, None), (str(tmp_path / "fsdp"), [*DSPARK, "train.parallel=fsdp"], None),
               (str(tmp_path / "fsdp2"), [*dflash2, "train.parallel=fsdp"], None)])
    assert losses(tmp_path / "ddp") == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "fsdp") == pytest.approx(ref, rel=1e-5)
    assert losses(tmp_path / "fsdp2") == pytest.approx(ref2, rel=1e-5)


def test_confidence_target_layer_must_not_be_an_fc_input():
    from dflashkit.objective import check_label_sources

    check_label_sources([1, 9, 35], 36, "ce")
    with pytest.raises(ValueError, match="the confidence head takes its target .* layer 35"):
        check_label_sources([1, 9, 35], 36, "ce", confidence=True)


# ---- decoding ---------------------------------------------------------------------------------


def _ref_heads(drafter):
    """speculators' Markov and confidence heads holding the drafter's weights."""
    from speculators.models.dspark.model_definitions import ConfidenceHead as RefConf, MarkovHead as RefMarkov

    m, c = drafter.markov(), drafter.confidence()
    V, H = m.markov_w1.weight.shape[0], drafter.config.hidden_size
    ref = RefMarkov(verifier_vocab_size=V, draft_vocab_size=V, markov_rank=m.rank, hidden_size=H, head_type=m.kind)
    ref.load_state_dict(m.state_dict())
    conf = RefConf(c.proj.in_features)
    conf.load_state_dict(c.state_dict())
    return ref, conf


def _spark(tiny_target, kind, b=2, S=4, seed=0):
    from dflashkit.decode.markov import MarkovDraft

    drafter = make_tiny_family(tiny_target, "dspark", family=dict(markov_head_type=kind))
    with torch.no_grad():  # a bias strong enough to move the argmax
        drafter.markov().markov_w2.weight.mul_(30.0)
    g = torch.Generator().manual_seed(seed)
    V, H = tiny_target.vocab_size, drafter.config.hidden_size
    unary, hidden = torch.randn(b, S, V, generator=g), torch.randn(b, S, H, generator=g)
    first = torch.randint(3, V, (b,), generator=g)
    return drafter, MarkovDraft(unary, hidden, first, drafter.markov(), drafter.confidence(), True)


def _biased(ref, spark, row, path):
    """Reference: the biased logits of slot len(path) after the bonus and `path`."""
    prev = torch.tensor([[int(spark.first[row]), *path]])
    bias = ref.block_bias(prev_token_ids=prev, hidden_states=spark.hidden[row, None, :len(path) + 1])
    return spark.unary[row, len(path)] + bias[0, -1]


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@torch.no_grad()
def test_markov_chain_is_the_sequential_argmax_scored_by_confidence(tiny_target, kind):
    from dflashkit.decode.markov import markov_chain

    drafter, spark = _spark(tiny_target, kind)
    ref, conf = _ref_heads(drafter)
    trees = markov_chain(spark)
    moved = 0
    for row in range(2):
        path = []
        for s in range(spark.unary.shape[1]):
            path.append(int(_biased(ref, spark, row, path).argmax()))
            moved += path[-1] != int(spark.unary[row, s].argmax())
        assert trees.tokens[row].tolist() == path
        prev = torch.tensor([int(spark.first[row]), *path[:-1]])
        c = conf(torch.cat([spark.hidden[row], ref.markov_w1(prev)], -1))
        torch.testing.assert_close(trees.scores[row], F.logsigmoid(c).cumsum(0))
    assert moved  # the bias changed some argmax: the chain is not the unary one


@torch.no_grad()
def test_markov_tree_holds_the_best_prefixes_of_the_biased_conditionals(tiny_target):
    """Against brute force over every prefix (each extending by its own top-3 of its biased
    conditional, the reference's head with its recurrent state along the prefix)."""
    from dflashkit.decode.markov import MarkovDraft, markov_tree

    drafter, spark = _spark(tiny_target, "rnn", S=3)
    spark = MarkovDraft(*spark[:4], None, False)  # scores: the log-probabilities
    ref, _ = _ref_heads(drafter)
    budget, k = 6, 3
    trees = markov_tree(spark, budget, k)
    for row in range(2):
        every = {}

        def grow(path, score):
            if len(path) == spark.unary.shape[1]:
                return
            lp, ids = torch.log_softmax(_biased(ref, spark, row, path), -1).topk(k)
            for v, t in zip(lp.tolist(), ids.tolist()):
                every[(*path, t)] = score + v
                grow([*path, t], score + v)

        grow([], 0.0)
        best = sorted(every, key=lambda p: (-every[p], len(p)))[:budget]
        got = {}
        for i, (p, t) in enumerate(zip(trees.parents[row].tolist(), trees.tokens[row].tolist()), start=1):
            got[i] = (*got.get(p, ()), t)
        assert sorted(got.values()) == sorted(best)
        for i, path in got.items():
            assert float(trees.scores[row, i - 1]) == pytest.approx(every[path], abs=1e-4)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_dspark_greedy_decoding_identical_to_ar(tiny_target, engine):
    """Bonus-first DSpark drafts (chain and tree from the biased conditionals) decode exactly the
    target's greedy tokens, one row and a ragged batch."""
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import generate, generate_batch
    from dflashkit.decode.static import static_engine
    from test_decode import greedy_reference, ragged_prompts

    drafter = make_tiny_family(tiny_target, "dspark", family=dict(sample_from_anchor=False, markov_head_type="rnn"))
    prompts = ragged_prompts(1, lengths=(20, 7))
    refs = [greedy_reference(tiny_target, p, 20) for p in prompts]
    make = (lambda: Engine(tiny_target, drafter)) if engine == "hf" else (lambda: static_engine(tiny_target, drafter, fuse=False))
    for method, budget in (("dflash", None), ("ddtree", 12)):
        assert generate(make(), prompts[0], max_new_tokens=20, method=method, budget=budget).tokens == refs[0]
        got = generate_batch(make(), prompts, max_new_tokens=20, method=method, budget=budget)
        assert [g.tokens for g in got] == refs, method


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 12)])
def test_anchor_first_decoding_drafts_a_whole_block(tiny_target, method, budget):
    """Anchor-first (DSpark's layout): every slot drafts, slot k the token at start + k + 1, so a
    round accepts up to block_size tokens plus the bonus; greedy output equals the target's."""
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import generate
    from test_decode import greedy_reference, ragged_prompts

    drafter = make_tiny_family(tiny_target, "dspark")
    B = drafter.config.block_size
    prompt = ragged_prompts(2, lengths=(15,))[0]
    ref = greedy_reference(tiny_target, prompt, 24)
    engine = Engine(tiny_target, drafter)
    assert engine.block == B + 1
    assert generate(engine, prompt, max_new_tokens=24, method=method, budget=budget).tokens == ref
    # A drafter that predicts the text exactly: every round takes the whole block and the bonus.
    text = [*prompt[0].tolist(), *ref]
    real = Engine._draft_logits

    def oracle(self, feats, bonus, ctx_start, start, n):
        h, logits = real(self, feats, bonus, ctx_start, start, n)
        at = int(start[0]) + 1 + torch.arange(logits.shape[1])
        want = torch.tensor([text[i] if i < len(text) else 0 for i in at.tolist()])
        return h, torch.nn.functional.one_hot(want, logits.shape[-1])[None].float() * 1e4

    engine = Engine(tiny_target, drafter)
    engine.draft_logits = oracle.__get__(engine)
    g = generate(engine, prompt, max_new_tokens=2 * (B + 1) + 1, method=method, budget=budget)
    assert g.tokens == ref[:2 * (B + 1) + 1] and g.accept_lengths[:2] == [B + 1, B + 1]


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 6)])
def test_dspark_sampled_rows_under_the_rejection_rule(tiny_target, method, budget):
    """A DSpark drafter's rounds under the rejection rule (each node's q its biased conditional,
    `accept.markov_tokens`): a greedy row and a sampled row share a batch, each as it decodes
    alone, the greedy one the target's argmax path (docs/conventions.md; exactness:
    tests/test_sampling.py)."""
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import generate

    drafter = make_tiny_family(tiny_target, "dspark", family=dict(markov_head_type="gated"))
    batch = rows_decode_as_alone(lambda: Engine(tiny_target, drafter), method, budget)
    assert batch[0].tokens == generate(Engine(tiny_target), torch.tensor([5, 9, 11, 3]), max_new_tokens=12,
                                       method="ar").tokens


@pytest.mark.parametrize("budget", [None, 8])
@torch.no_grad()
def test_the_confidence_head_decides_how_much_to_verify(tiny_target, budget):
    """Cost-aware drafting keeps the draft's prefix with the most expected tokens per measured
    second; with a confidence head a node's expected acceptance is the product of the confidences
    along its path: confident drafts are verified whole, unconfident ones not past the bonus
    (chains and trees)."""
    from dflashkit.decode import cost
    from dflashkit.decode.engine import Engine

    drafter = make_tiny_family(tiny_target, "dspark")
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 8, 2, 4])]
    curve = cost.CostCurve([1, 2, 4, 8], [1.0, 1.1, 1.2, 1.3])  # a wider pass costs more
    proj = drafter.confidence().proj
    for sure, width in ((12.0, 8), (-12.0, 1)):
        proj.weight.zero_()
        proj.bias.fill_(sure)
        engine = Engine(tiny_target, drafter)
        draft = engine.draft(engine.prefill(prompts, 64).argmax(-1), budget, scored=True)
        if budget is None:  # the running sums of log sigmoid(confidence)
            torch.testing.assert_close(draft.trees.scores, (F.logsigmoid(torch.tensor(sure)) * torch.arange(1, 9)).expand(2, -1))
        assert curve.best_width(cost.tree_expectation(draft.trees.scores)) == width


@pytest.mark.parametrize("engine", ["hf", "static"])
@torch.no_grad()
def test_an_engine_without_the_confidence_head_scores_by_probabilities(tiny_target, engine):
    """Built with confidence=False (bench_batch's '+cost', against '+conf'), an engine scores a
    DSpark chain by the running sums of its biased conditionals' log-probabilities of the chosen
    tokens; by default by the running sums of log sigmoid(confidence). The tokens are the same."""
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import make_engine

    drafter = make_tiny_family(tiny_target, "dspark", family=dict(markov_head_type="gated"))
    ref, conf = _ref_heads(drafter)
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 8, 2, 4])]
    drafts = {}
    for confidence in (True, False):
        e = (Engine(tiny_target, drafter, confidence=confidence) if engine == "hf"
             else make_engine(tiny_target, drafter, "static", confidence=confidence))
        drafts[confidence] = e.draft(e.prefill(prompts, 64).argmax(-1), None, scored=True)
    assert torch.equal(drafts[True].trees.tokens, drafts[False].trees.tokens)
    spark = drafts[False].lattice
    for row in range(2):
        path = drafts[False].trees.tokens[row].tolist()
        lp = [torch.log_softmax(_biased(ref, spark, row, path[:s]), -1)[t] for s, t in enumerate(path)]
        torch.testing.assert_close(drafts[False].trees.scores[row], torch.stack(lp).cumsum(0), rtol=1e-4, atol=1e-4)
        prev = torch.tensor([int(spark.first[row]), *path[:-1]])
        c = F.logsigmoid(conf(torch.cat([spark.hidden[row], ref.markov_w1(prev)], -1))).cumsum(0)
        torch.testing.assert_close(drafts[True].trees.scores[row], c, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(drafts[True].trees.scores, drafts[False].trees.scores, atol=1e-2)


@pytest.mark.parametrize("first", [True, False])
@torch.no_grad()
def test_offline_dspark_tau_equals_online(tiny_target, first):
    """Mistake 8 for DSpark: rounds replayed from cached features (`offline_accepted`: the same
    biased chain and tree, both layouts) are exactly the online greedy rounds. The Markov head holds
    the tiny target's next token after each token (a third of them wrong), so τ varies."""
    from dflashkit.data.features import FeatureSample
    from dflashkit.decode.engine import Engine
    from dflashkit.decode.loop import generate
    from dflashkit.evaluate import offline_accepted, replay_rounds
    from test_decode import greedy_reference

    V = tiny_target.vocab_size
    drafter = make_tiny_family(tiny_target, "dspark", family=dict(
        markov_rank=V, enable_confidence_head=False, confidence_head_with_markov=False, sample_from_anchor=first))
    nxt = tiny_target.model(torch.arange(V)[:, None]).logits[:, -1].argmax(-1)
    nxt = torch.where(torch.arange(V) % 3 == 0, (nxt + 1) % V, nxt)
    drafter.markov().markov_w1.weight.copy_(torch.eye(V))
    drafter.markov().markov_w2.weight.copy_(20 * F.one_hot(nxt, V).T.float())
    labels = [("dflash", "dflash", None), ("ddtree-6", "ddtree", 6)]
    seen = set()
    for prompt in ([5, 9, 11, 3, 40], [7, 8, 2, 60, 61]):
        ids = torch.tensor([prompt])
        seq = torch.tensor(prompt + greedy_reference(tiny_target, ids, 30))
        mask = torch.arange(len(seq)) >= len(prompt)
        item = FeatureSample("x", seq, mask, tiny_target.forward(seq[None], drafter.config.target_layer_ids).features[0])
        acc, spans = offline_accepted(drafter, tiny_target, item, labels, top_k=None)
        for label, method, budget in labels:
            online = generate(Engine(tiny_target, drafter), ids, max_new_tokens=30, method=method, budget=budget)
            assert replay_rounds(acc[label], spans)[0] == online.accept_lengths, (label, prompt)
            seen.update(online.accept_lengths)
    assert len(seen) >= 3


@pytest.mark.parametrize("kind,first", [("rnn", True), ("rnn", False), ("gated", False)])
@torch.no_grad()
def test_dspark_parity_biased_logits_and_confidences(tiny_target, kind, first):
    """For the same context, the training path's Markov-biased logits and confidences of a block
    (teacher-forced predecessors, `MarkovHead.forward`) equal the inference path's (the engine's
    draft pass, `markov.conditionals` along the same tokens, the recurrent state carried from the
    block's first slot, bonus-first too)."""
    from dflashkit.decode.cache import drafter_cache
    from dflashkit.decode.markov import MarkovDraft, conditionals, log_confidence
    from dflashkit.drafter import draft_block
    from dflashkit.objective import block_predecessors

    drafter = make_tiny_family(tiny_target, "dspark", family=dict(markov_head_type=kind, sample_from_anchor=first))
    B, a = drafter.config.block_size, 17
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    W = tiny_target.model.get_output_embeddings().weight
    slots = drafter.config.draft_slots
    h_train = training_hidden(drafter, tiny_target.embed, ids, feats, torch.tensor([[3, a, 29]]))[:, B:2 * B]
    preds = block_predecessors(ids, torch.tensor([[a]]), B, first)  # [1, B]
    train_logits, emb = drafter.markov()(preds, h_train, lambda u, e, w2: (h_train @ W.T + u @ w2.T, e))
    train_conf = F.logsigmoid(drafter.confidence()(torch.cat([h_train, emb], -1)))
    cache = drafter_cache(drafter)
    draft_block(drafter, tiny_target.embed, cache, feats[:, :9], ids[:, 9])
    block = draft_block(drafter, tiny_target.embed, cache, feats[:, 9:a], ids[:, a])
    spark = MarkovDraft.of(drafter, tiny_target.lm_head(block[:, slots.start:]), block, ids[:, a])
    state = spark.state
    for s, k in enumerate(slots):
        logits, e, state = conditionals(spark, s, preds[:, k:k + 1], state)
        torch.testing.assert_close(logits[:, 0], train_logits[:, k], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(log_confidence(spark, s, e, 1)[:, 0], train_conf[:, k], atol=1e-5, rtol=1e-4)


def test_train_upgrades_a_dflash_drafter_to_dspark(tmp_path):
    """`drafter.init_from` a DFlash drafter with `drafter.kind=dspark`: the run trains a DSpark
    drafter of the DFlash drafter's (bonus-first) layout, its backbone the loaded weights."""
    from dflashkit.checkpoint import load_drafter, save_drafter
    from train_job import losses, make_tiny_target, run_job

    target = make_tiny_target()
    base = make_tiny_drafter(target, num_layers=2, num_taps=3, block_size=8)
    save_drafter(base, tmp_path / "dflash")
    out = run_job(str(tmp_path / "run"), ["train.max_steps=2", "train.eval_every=1000", "drafter.kind=dspark",
                                          "drafter.markov_rank=8", f"drafter.init_from={tmp_path / 'dflash'}"])
    assert all(math.isfinite(v) for v in losses(out).values())
    trained = load_drafter(out / "final", target)
    assert trained.config.kind == "dspark" and not trained.config.sample_from_anchor
    assert trained.markov().markov_w2.weight.abs().sum() > 0  # trained from zero
    # The upgrade's start is evaluated, but its confidence head is fresh: best/ is a trained one.
    evals = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert evals == [0, 2] and json.loads((out / "best.json").read_text())["step"] == 2
    # The curves have a fourth panel, the head's reliability diagram: 4 panels of 500 px.
    assert int.from_bytes((out / "curves.png").read_bytes()[16:20], "big") == 2000
