"""Export round trips: reference format (+ the trust_remote_code model file) and vLLM speculators."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_drafter, make_tiny_family
from dflashkit.checkpoint import CheckpointError, load_drafter
from dflashkit.cli import main
from dflashkit.decode.cache import drafter_cache
from dflashkit.drafter import DFlashDrafter, block_token_ids, draft_block, training_hidden
from dflashkit.export import (AUTO_MAP, export_reference, export_speculators, from_speculators_layer_ids,
                              load_speculators, remote_code_source, to_speculators_layer_ids)

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return make_tiny_drafter(tiny_target, **SLIDING)


def _logits(drafter, target, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(3, 120, (2, 40))
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    with torch.no_grad():
        return target.lm_head(training_hidden(drafter, target.embed, ids, feats, torch.tensor([[4, 17], [9, 25]])))


def _assert_same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_reference_round_trip(drafter, tiny_target, tmp_path):
    out = export_reference(drafter, tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "dflash.py", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == AUTO_MAP == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert (out / "dflash.py").read_bytes() == remote_code_source()
    back = load_drafter(out)
    assert back.config == drafter.config
    _assert_same_tensors(drafter, back)
    assert torch.equal(_logits(drafter, tiny_target), _logits(back, tiny_target))
    # exporting an exported drafter again is stable (auto_map is not carried into our config)
    again = json.loads((export_reference(back, tmp_path / "again") / "config.json").read_text())
    assert again == cfg


def test_remote_code_model_matches_drafter(drafter, tiny_target, tmp_path):
    """The exported dflash.py, loaded the way Transformers users load published drafters, computes
    the same hidden states as our drafter's inference path (sliding layer included)."""
    from transformers import AutoModel

    from dflashkit.assets.dflash_model import extract_context_feature

    out = export_reference(drafter, tmp_path / "ref")
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True)
    assert type(remote).__name__ == "DFlashDraftModel" and remote.target_layer_ids == [1, 2, 3]
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (2, 30))
    c, B = 17, drafter.config.block_size  # context longer than the sliding window (6)
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids).features
    # the model file's tap helper agrees with ours: tap k = output_hidden_states[k + 1]
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(extract_context_feature(hs, remote.target_layer_ids), feats, atol=1e-6, rtol=0)
    with torch.no_grad():
        ours = draft_block(drafter, tiny_target.embed, drafter_cache(drafter), feats[:, :c], ids[:, c])
        emb = tiny_target.embed(block_token_ids(ids[:, c:c + 1], B, remote.mask_token_id))
        theirs = remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1))
        torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-5)
        remote.sliding_window = 1000  # control: without the window the sliding layer sees more context
        assert (remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1)) - ours).abs().max() > 1e-4


def test_speculators_layer_ids_are_hidden_state_indices(tiny_target):
    """speculators' aux ids index output_hidden_states (ours + 1). Known cases, and the semantic check."""
    assert to_speculators_layer_ids([1, 9, 17, 25, 33], 36) == [2, 10, 18, 26, 34]  # Qwen3-8B, 5 taps
    assert from_speculators_layer_ids([2, 10, 18, 26, 34]) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="last layer"):
        to_speculators_layer_ids([1, 35], 36)
    ids = torch.randint(3, 120, (1, 12))
    ours = [0, 2, 4]
    feats = tiny_target.forward(ids, ours).features
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    aux = to_speculators_layer_ids(ours, tiny_target.num_layers)
    torch.testing.assert_close(torch.cat([hs[i] for i in aux], -1), feats, atol=1e-6, rtol=0)


def test_speculators_round_trip(drafter, tiny_target, tmp_path):
    out = export_speculators(drafter, tmp_path / "spec", verifier="org/tiny-llama", verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4]  # taps [1, 2, 3] shifted by one
    assert cfg["mask_token_id"] == 127 and cfg["block_size"] == 8 and cfg["draft_vocab_size"] == 128
    assert cfg["sliding_window_non_causal"] is True
    assert cfg["layer_types"] == SLIDING["layer_types"] and cfg["sliding_window"] == 6
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == 64
    assert not {"dflash_config", "block_size", "auto_map"} & layer.keys()
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"][0]["speculative_tokens"] == 7
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    assert set(load_file(str(out / "model.safetensors"))) == set(drafter.state_dict())
    back = load_speculators(out)
    assert back.config == drafter.config
    _assert_same_tensors(drafter, back)
    assert torch.equal(_logits(drafter, tiny_target), _logits(back, tiny_target))


def test_speculators_own_classes_read_the_export(drafter, tiny_target, tmp_path):
    """The `speculators` package's own DFlash config and model (the format vLLM serves) read an
    export: the config validates to the drafter's settings, and the model it builds holds exactly
    the exported tensors, names and shapes, besides the verifier-owned ones it never saves."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    verifier = tmp_path / "verifier"  # a local verifier: speculators reads its config, no hub
    tiny_target.model.config.save_pretrained(verifier)
    out = export_speculators(drafter, tmp_path / "spec", verifier=str(verifier), verifier_architectures=["LlamaForCausalLM"])
    cfg = DFlashSpeculatorConfig.from_pretrained(str(out))
    c = drafter.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.draft_vocab_size) == (c.block_size, c.mask_token_id, c.vocab_size)
    assert cfg.aux_hidden_state_layer_ids == to_speculators_layer_ids(c.target_layer_ids, c.num_target_layers)
    assert cfg.transformer_layer_config.num_hidden_layers == c.num_hidden_layers and cfg.sliding_window_non_causal
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention would compile
    model = DFlashDraftModel(cfg)
    assert model.sliding_window_indices == [0] and model.sliding_window == SLIDING["sliding_window"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in model._keys_to_ignore_on_save}
    ours = {k: tuple(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
    assert ours == theirs


def test_load_speculators_foreign_checkpoint(drafter, tmp_path):
    """A checkpoint as speculators writes it: no num_target_layers, verifier tensors beside ours."""
    out = export_speculators(drafter, tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["transformer_layer_config"]["num_target_layers"]
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "embed_tokens.weight": torch.zeros(128, 64)}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="pass num_target_layers"):
        load_speculators(out)
    assert load_speculators(out, num_target_layers=6).config.target_layer_ids == [1, 2, 3]
    cfg["speculators_model_type"] = "eagle3"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"expected one of \['dflash', 'dflash2', 'dspark'\]"):
        load_speculators(out)
    cfg.update(speculators_model_type="dflash", draft_vocab_size=32)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="reduced draft vocabularies"):
        load_speculators(out, num_target_layers=6)


def test_export_cli(drafter, tmp_path, capsys):
    from dflashkit.checkpoint import save_drafter

    src = save_drafter(drafter, tmp_path / "trained")
    assert main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "s"), "--verifier", "v",
                 "--dtype", "bfloat16"]) == 0
    assert load_speculators(tmp_path / "s").fc.weight.dtype == torch.bfloat16
    assert main(["export", str(src), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "dflash.py").is_file() and "num_speculative_tokens = 7" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 1


# ---- the drafter family: DFlash 2 and DSpark -----------------------------------------------------

FAMILY_KINDS = ("dflash2", "dspark")


@pytest.fixture(scope="module")
def family(tiny_target):
    """A tiny drafter of each kind, every family weight random, with a sliding layer."""
    return {kind: make_tiny_family(tiny_target, kind, **SLIDING) for kind in FAMILY_KINDS}


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_reference_round_trip_and_remote_code(family, tiny_target, tmp_path, kind):
    """The reference export of DFlash 2 / DSpark loads back bit for bit, and its dflash.py holds
    every tensor (the heads under their names) and computes our inference path's hidden states,
    DFlash 2's convolutions included."""
    from transformers import AutoModel

    drafter = family[kind]
    out = export_reference(drafter, tmp_path / "ref")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}[kind]]
    back = load_drafter(out)
    assert back.config == drafter.config and back.config.kind == kind
    _assert_same_tensors(drafter, back)
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True)
    assert set(remote.state_dict()) == set(load_file(str(out / "model.safetensors")))
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (2, 30))
    c, B = 17, drafter.config.block_size
    feats = tiny_target.forward(ids, drafter.config.target_layer_ids).features
    with torch.no_grad():
        ours = draft_block(drafter, tiny_target.embed, drafter_cache(drafter), feats[:, :c], ids[:, c])
        emb = tiny_target.embed(block_token_ids(ids[:, c:c + 1], B, remote.mask_token_id))
        torch.testing.assert_close(remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1)), ours, atol=1e-6, rtol=1e-5)
        if kind == "dflash2":  # control: without its convolutions the model computes something else
            for layer in remote.layers:
                del layer.attention_conv, layer.mlp_conv
            assert (remote(emb, feats[:, :c], torch.arange(c + B).expand(2, -1)) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_speculators_round_trip(family, tmp_path, kind):
    drafter = family[kind]
    c = drafter.config
    out = export_speculators(drafter, tmp_path / "spec", verifier="org/tiny-llama")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == cfg["speculators_config"]["algorithm"] == kind
    assert cfg["architectures"] == [{"dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}[kind]]
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is c.sample_from_anchor
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == len(c.draft_slots)
    if kind == "dflash2":
        assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"], cfg["selector_top_k"]) == (2, 16, 8, 4)
    else:
        assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
                cfg["confidence_head_with_markov"], cfg["sample_from_anchor"]) == (8, "vanilla", True, True, True)
    assert "dflash_config" not in cfg["transformer_layer_config"]
    back = load_speculators(out)
    assert back.config == c
    _assert_same_tensors(drafter, back)


def test_speculators_family_fields_default_as_speculators_does(family, tmp_path):
    """A foreign dspark config that leaves fields out means speculators' defaults: markov_rank 0
    with the confidence head reading the Markov embedding (both on by default) is refused in one
    line naming the file and the field; a dflash2 export without its selector is refused."""
    out = export_speculators(family["dspark"], tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    for k in ("enable_confidence_head", "confidence_head_with_markov"):
        del cfg[k]
    cfg["markov_rank"] = 0
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"spec/config.json: .*'confidence_head_with_markov': expected false "
                                              "when markov_rank is 0"):
        load_speculators(out)
    from dataclasses import replace

    no_selector = DFlashDrafter(replace(family["dflash2"].config, selector_rank=None))
    with pytest.raises(ValueError, match="dflash_config.selector_rank is not set: speculators' DFlash2DraftModel"):
        export_speculators(no_selector, tmp_path / "x")


@pytest.fixture(scope="module")
def speculators_models(family, tiny_target, tmp_path_factory):
    """speculators 0.9.0's own DFlash2DraftModel and DSparkDraftModel, each built from our export
    (config.json + model.safetensors) and the tiny verifier's embedding and LM head."""
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    root = tmp_path_factory.mktemp("speculators")
    tiny_target.model.save_pretrained(root / "verifier")  # speculators reads the verifier's weights from here
    classes = {"dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel), "dspark": (DSparkSpeculatorConfig, DSparkDraftModel)}
    models = {}
    for kind, (config_class, model_class) in classes.items():
        out = export_speculators(family[kind], root / kind, verifier=str(root / "verifier"))
        cfg = config_class.from_pretrained(str(out))
        cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention would compile
        model = model_class(cfg)
        missing, unexpected = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
        assert not unexpected and set(missing) == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                                   "verifier_norm.weight"}
        model.load_verifier_weights()
        models[kind] = model.eval()
    return models


def _training_pass(model, drafter, target, T=28, seed=0):
    """The same sequence through speculators' training path (`_backbone_forward`) and ours, with
    a block at every position speculators anchors (all but the last block_size: its anchors are
    then all of them, in order, whatever its random choice). Tokens are distinct, so a token names
    its position. -> (ids [1, T], anchors [1, n], theirs: (hidden, unary logits, the positions
    their targets read the verifier at, aligned loss mask, block indices), ours: hidden [1, n * B, H])."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(120, generator=g)[:T] + 3)[None]
    a = torch.arange(T - drafter.config.block_size)[None]
    feats = target.forward(ids, drafter.config.target_layer_ids, logits=False).features
    # Their targets read the verifier at some positions: hand it one-hot rows that name them.
    model.verifier_norm, model.verifier_lm_head = torch.nn.Identity(), torch.nn.Identity()
    onehot = torch.eye(T, target.hidden_size)[None]
    with torch.no_grad():
        hidden, logits, targets, mask, blocks = model._backbone_forward(
            feats, ids, torch.ones(1, T), onehot, torch.zeros(1, T, dtype=torch.long), max_anchors=a.shape[1])
        ours = training_hidden(drafter, target.embed, ids, feats, a)
    return ids, a, (hidden, logits, targets.argmax(-1), mask, blocks), ours


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_training_layout_matches_speculators(family, speculators_models, tiny_target, kind):
    """speculators' and our training path on the same inputs: the same unary logits (DFlash 2's
    convolutions, a sliding layer), the same labels (DSpark anchor-first: slot k's label is the
    token after anchor + k, slot 0 trained; DFlash 2 bonus-first: the token at anchor + k, slot 0
    not), the same predecessors (the token before each slot's label)."""
    from dflashkit.objective import IGNORE, block_labels, block_predecessors

    drafter, model = family[kind], speculators_models[kind]
    ids, a, (hidden, logits, read, mask, blocks), ours = _training_pass(model, drafter, tiny_target)
    torch.testing.assert_close(ours, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tiny_target.lm_head(ours), logits, atol=1e-5, rtol=1e-5)
    first = drafter.config.sample_from_anchor
    assert first is (kind == "dspark") and model.config.sample_from_anchor is first
    labels = block_labels(ids, torch.ones_like(ids, dtype=torch.bool), a, torch.ones_like(a, dtype=torch.bool),
                          drafter.config.block_size, first)[0]
    position = {int(t): p for p, t in enumerate(ids[0])}
    labelled = labels != IGNORE
    assert torch.equal(labelled, mask[0].bool())  # slot 0 trained anchor-first only
    # Their target at a slot is the verifier read at position p: its prediction of the token at p + 1.
    assert [position[int(t)] for t in labels[labelled]] == (read[0][labelled] + 1).tolist()
    preds = block_predecessors(ids, a, drafter.config.block_size, first)[0]
    block_tokens = ids[0, blocks].view(-1, drafter.config.block_size)
    theirs = (model._predecessor_ids(ids, blocks).flatten() if kind == "dflash2"  # dspark computes them inline:
              else block_tokens.flatten())  # `prev_token_ids = block_tokens` (sample_from_anchor)
    assert torch.equal(preds, theirs)


def test_dflash2_selector_matches_speculators(family, speculators_models, tiny_target):
    """DFlash 2's candidate selector on the same hidden states, predecessors and candidates:
    speculators' `score_candidates` equals our unary logit + transition score, and the selector's
    teacher-forced pick per slot (training's metric, `objective.selector_terms`) equals the pick
    over speculators' training candidates (the label injected at rank K where the top-K misses it)."""
    from speculators.models.dflash2.metrics import selector_training_candidates

    from dflashkit.objective import block_predecessors, head_candidates, selector_terms

    drafter, model = family["dflash2"], speculators_models["dflash2"]
    ids, a, (hidden, logits, _, _, blocks), ours = _training_pass(model, drafter, tiny_target)
    B, K = drafter.config.block_size, drafter.config.selector_top_k
    preds = block_predecessors(ids, a, B)[0]
    h, unary = ours[0], tiny_target.lm_head(ours)[0]
    cands = unary.topk(K, -1).indices
    # A random drafter's top-K rarely holds the real next token: labels that it holds at ranks
    # 0..K-1 in turn, and every third one it misses (the label injected at rank K).
    rows = torch.arange(unary.shape[0])
    labels = torch.where(rows % 3 == 2, unary.argmin(-1), cands.gather(1, (rows % K)[:, None])[:, 0])
    with torch.no_grad():
        theirs = model.candidate_selector.score_candidates(logits, hidden, preds[None], cands[None])[0]
        mine = unary.gather(-1, cands) + drafter.selector()(h, preds[:, None], cands)[:, 0]
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        ids_k, logits_k = head_candidates(unary[rows], labels[rows], K)
        _, pick, _ = selector_terms(drafter.selector(), h[rows], preds[rows], labels[rows], ids_k, logits_k)
        train_ids, _, contains = selector_training_candidates(logits[0, rows].topk(K, -1).indices, labels[rows])
        scores = model.candidate_selector.score_candidates(logits[:, rows], hidden[:, rows], preds[None, rows], train_ids[None])[0]
        their_pick = torch.where(contains, train_ids.gather(1, scores.argmax(-1, keepdim=True))[:, 0], -1)
    assert torch.equal(pick, their_pick) and contains.any() and not contains.all()


def test_dflash2_selector_walk_matches_speculators(family, speculators_models, tiny_target):
    """The greedy walk over the selector's edge scores from the anchor (each slot's pick is the
    next slot's predecessor), by speculators' `candidate_selector.select` and by our selector, over
    the same blocks: the same path. (A reference walk written here; dflashkit's decoding walk over
    the selector's lattice is the one to put in its place once it lands in decode/.)"""
    drafter, model = family["dflash2"], speculators_models["dflash2"]
    ids, a, (hidden, logits, _, _, _), ours = _training_pass(model, drafter, tiny_target)
    B, K = drafter.config.block_size, drafter.config.selector_top_k
    h, unary = ours[0].view(-1, B, ours.shape[-1]), tiny_target.lm_head(ours)[0].view(-1, B, logits.shape[-1])
    their_h, their_unary = hidden[0].view_as(h), logits[0].view_as(unary)
    path, their_path = ids[0, a[0]], ids[0, a[0]]  # the anchor precedes slot 1
    walked, their_walked = [], []
    with torch.no_grad():
        for k in drafter.config.draft_slots:
            cands = unary[:, k].topk(K, -1).indices
            scores = unary[:, k].gather(-1, cands) + drafter.selector()(h[:, k], path[:, None], cands)[:, 0]
            path = cands.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            their_cands, their_scores = model.candidate_selector.select(their_unary[:, k], their_h[:, k], their_path)
            their_path = their_cands.gather(1, their_scores.argmax(-1, keepdim=True))[:, 0]
            walked.append(path)
            their_walked.append(their_path)
    assert torch.equal(torch.stack(walked), torch.stack(their_walked))
    # the selector matters: the walk departs from the unary chain somewhere
    assert not torch.equal(torch.stack(walked), unary[:, 1:].argmax(-1).T)


def test_dspark_heads_match_speculators(family, speculators_models, tiny_target):
    """DSpark's Markov-biased logits (`markov_head.block_bias`) and confidences (`confidence_head`
    over the hidden state and the Markov embedding) from speculators' modules and ours, on the same
    teacher-forced blocks (anchor-first predecessors)."""
    from dflashkit.objective import block_predecessors

    drafter, model = family["dspark"], speculators_models["dspark"]
    ids, a, (hidden, logits, _, _, _), ours = _training_pass(model, drafter, tiny_target)
    B = drafter.config.block_size
    prev = block_predecessors(ids, a, B, True)[0].view(-1, B)
    h = ours[0].view(-1, B, ours.shape[-1])
    markov, confidence = drafter.markov(), drafter.confidence()
    with torch.no_grad():
        emb = markov.embed(prev)
        mine = tiny_target.lm_head(h) + markov.bias(markov.block_inputs(emb, h))
        theirs = logits[0].view_as(mine) + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[0].view_as(h))
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        assert (mine - tiny_target.lm_head(h)).abs().max() > 1e-3  # the bias is not zero
        their_emb = model.markov_head.prev_embeddings(prev)
        torch.testing.assert_close(confidence(torch.cat([h, emb], -1)),
                                   model.confidence_head(torch.cat([hidden[0].view_as(h), their_emb], -1)),
                                   atol=1e-5, rtol=1e-5)


def test_doctor_and_export_report_the_kind(family, tiny_target, tmp_path, capsys):
    """doctor and export name the kind and its declared modules; an anchor-first drafter (DSpark's
    layout) decodes a whole block of drafts and exports in both formats."""
    from dflashkit.checkpoint import save_drafter
    from dflashkit.decode.engine import round_block
    from dflashkit.doctor import OK, doctor

    src = {kind: save_drafter(family[kind], tmp_path / kind) for kind in FAMILY_KINDS}
    kind2 = next(f for f in doctor(src["dflash2"], tiny_target) if f.check == "kind")
    assert kind2.severity == OK and kind2.message.startswith(
        "DFlash 2: block convolutions (conv_kernel_size 2, conv_group_size 16), candidate selector (selector_rank 8, "
        "selector_top_k 4); bonus-first")
    spark = next(f for f in doctor(src["dspark"], tiny_target) if f.check == "kind")
    assert spark.severity == OK and spark.message.startswith(
        "DSpark: Markov head (markov_rank 8, vanilla), confidence head (reads the Markov embedding); anchor-first")
    assert round_block(family["dflash2"], None) == 8
    assert round_block(family["dspark"], None) == 9  # the bonus and block_size drafts
    capsys.readouterr()
    for fmt in ("speculators", "reference"):
        assert main(["export", str(src["dspark"]), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        out = capsys.readouterr().out
        assert "kind: DSpark: Markov head" in out and "num_speculative_tokens = 8" in out
