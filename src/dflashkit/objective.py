"""The DFlash training objective (docs/conventions.md): anchors, block labels, the loss and feature noise.

* Anchors: positions `p` with `loss_mask[p]` and `loss_mask[p + 1]`, at most `anchors_per_seq`
  per sequence, drawn uniformly without replacement (then sorted, so that neighbouring blocks
  share most of their visible context: FlexAttention then skips more tiles).
* Labels: slot `k >= 1` of the block at anchor `a` predicts `input_ids[a + k]`, the token at the
  slot's own position (no shift); slot 0 has no loss; a slot is masked where `loss_mask` is 0
  or the position lies past the sequence.
* Loss (default, "ce"): hard cross-entropy with slot weight `exp(-(k - 1) / gamma)`, normalised
  by the sum of the weights of the slots that carry a label. Options: "kl" (KL to the target's
  distribution, whose logits come from the target's *final* hidden state through its LM head,
  mixed with hard CE by `kl_weight`) and "dpace" (D-PACE: detached weights from the drafter's own
  confidence, arXiv 2605.18810 eq. 7-9). Never silently different from the recipe.
* Noise: added to the features entering `fc` only; labels come from token ids and KL targets from
  a tensor that is split off before the noise.

The LM head is frozen and big (Qwen3: 151936 x 4096): `head_losses` runs it in row chunks, never
holding [rows, vocab] logits for all rows, and computes the gradient w.r.t. the hidden states in
the same pass, so the head's matmul is never recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.drafter import default_gamma, training_hidden
from dflashkit.masks import block_positions

IGNORE = -100  # label of a slot without loss


# ---- anchors and labels ------------------------------------------------------------------


def anchor_candidates(loss_mask: Tensor) -> Tensor:
    """[T] -> positions p with loss_mask[p] and loss_mask[p + 1] (a block there has >= 1 label)."""
    m = loss_mask.bool()
    return (m[:-1] & m[1:]).nonzero().squeeze(1)


def sample_anchors(loss_mask: Tensor, max_anchors: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to `max_anchors` anchor positions of one sequence, uniformly without replacement, sorted."""
    cand = anchor_candidates(loss_mask)
    if len(cand) > max_anchors:
        pick = torch.randperm(len(cand), generator=generator)[:max_anchors]
        cand = cand[pick].sort().values
    return cand


def replay_rounds(accepted: dict[int, int], spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(τ of the decoding rounds, τ at every answer position). A round at p commits τ(p) tokens,
    clipped at the answer's end; the first round starts at the answer's first token (the bonus
    that the prefill produced)."""
    rounds, positions = [], []
    for a, e in spans:
        for p in range(a, e - 1):
            positions.append(min(accepted[p] + 1, e - 1 - p))
        p = a
        while p < e - 1:
            tau = min(accepted[p] + 1, e - 1 - p)
            rounds.append(tau)
            p += tau
    return rounds, positions


def anchor_runs(anchors: list[int]) -> list[tuple[int, int]]:
    """Sorted anchor positions -> answer spans (a, e) as `replay_rounds` takes them: each run of
    consecutive anchors a .. e-2 (an anchor has a supervised next token, so its span ends at e-1)."""
    spans: list[tuple[int, int]] = []
    for p in anchors:
        if spans and p == spans[-1][1] - 1:
            spans[-1] = (spans[-1][0], p + 2)
        else:
            spans.append((p, p + 2))
    return spans


def pad_anchors(anchor_lists: list[Tensor], multiple: int = 1) -> tuple[Tensor, Tensor]:
    """Stack per-sequence anchors into [b, n] (n rounded up to `multiple`) plus a validity mask.
    Padding blocks sit at position 0: they see only themselves and carry no label."""
    n = max([1, *(len(a) for a in anchor_lists)])
    n = -(-n // multiple) * multiple
    anchors = torch.zeros(len(anchor_lists), n, dtype=torch.long)
    valid = torch.zeros(len(anchor_lists), n, dtype=torch.bool)
    for i, a in enumerate(anchor_lists):
        anchors[i, : len(a)] = a
        valid[i, : len(a)] = True
    return anchors, valid


def block_labels(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int,
                 anchor_first: bool = False) -> Tensor:
    """Labels [b, n * B]: slot k of block j at index j * B + k holds input_ids[a_j + k], or IGNORE
    for slot 0, padding blocks, positions past the sequence and positions with loss_mask 0.
    anchor_first (DSpark's layout): slot k holds input_ids[a_j + k + 1], slot 0 included."""
    b, T = input_ids.shape
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device) + int(anchor_first)  # [b, n, B]
    inside = pos < T
    idx = pos.clamp(max=T - 1).flatten(1)
    tok = input_ids.gather(1, idx).view_as(pos)
    ok = inside & loss_mask.bool().gather(1, idx).view_as(pos) & anchor_valid[..., None]
    if not anchor_first:
        ok[..., 0] = False
    return torch.where(ok, tok, IGNORE).flatten(1)


def block_predecessors(input_ids: Tensor, anchors: Tensor, block_size: int, anchor_first: bool = False) -> Tensor:
    """[b, n * B]: the token before each slot's label, teacher-forced (the anchor for the first
    slot that drafts): input_ids[a + k - 1] (slot 0: the anchor itself), anchor-first
    input_ids[a + k]. What the selector and the Markov head condition on."""
    T = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device) - int(not anchor_first)
    return input_ids.gather(1, pos.clamp(0, T - 1).flatten(1).maximum(anchors.repeat_interleave(block_size, 1)))


def slot_weights(block_size: int, gamma: float, device: torch.device | str | None = None,
                 anchor_first: bool = False) -> Tensor:
    """[B]: 0 for slot 0, exp(-(k - 1) / gamma) for slot k >= 1 (anchor-first: exp(-k / gamma), every slot)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device) + int(anchor_first)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)


def dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE slot weights [m, B] from per-slot CE [m, B] (detached).

    q_i = exp(-CE_i) (the drafter's confidence in the label), smoothed q~_i = (1 - alpha) q_i + alpha,
    w_j = sum over labelled m >= j of prod_{i <= m} q~_i: the chance of reaching slot m times the
    length still to gain. Unlabelled slots pass the product through and get weight 0."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"train.dpace_alpha: expected a value in (0, 1], got {alpha}")
    q = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha
    reach = torch.cumprod(torch.where(valid, q, torch.ones_like(q)), dim=-1)
    reach = torch.where(valid, reach, torch.zeros_like(reach))
    w = reach.flip(-1).cumsum(-1).flip(-1)
    return torch.where(valid, w, torch.zeros_like(w))


def add_feature_noise(features: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Gaussian noise on the `fc` input. Call it on the tap features only, after any label or
    target-logit tensor has been split off (docs/conventions.md, mistake 3)."""
    if std <= 0:
        return features
    dev = generator.device if generator is not None else features.device
    noise = torch.randn(features.shape, generator=generator, dtype=torch.float32, device=dev)
    return (features.float() + std * noise.to(features.device)).to(features.dtype)


def check_label_sources(tap_ids: list[int], num_target_layers: int, loss: str, confidence: bool = False) -> None:
    """`fc` must never see the layer the labels come from (docs/conventions.md, mistake 2). Hard labels are
    token ids; KL targets, and a confidence head's (Σ min(p, q)), are the LM head of the target's final
    hidden state, i.e. layer L - 1."""
    last = num_target_layers - 1
    if (loss == "kl" or confidence) and last in tap_ids:
        use = "train.loss='kl' takes its target logits" if loss == "kl" else "the confidence head takes its target"
        raise ValueError(
            f"{use} from the target's final hidden state (layer {last}), "
            f"but drafter.target_layer_ids {tap_ids} feeds that layer to fc: the drafter would copy its answer "
            f"from its input. Drop layer {last} from the taps (the default taps end at L - 3).")


# ---- the LM head in chunks ----------------------------------------------------------------


def _ce_chunk(logits: Tensor, labels: Tensor, want_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-row CE, argmax and d CE / d logits (softmax - onehot, in the logits' dtype)."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, labels[:, None]).squeeze(1)
    top = z.argmax(-1)
    if not want_grad:
        return ce, top, None
    # softmax - onehot in one [c, V] buffer of the logits' dtype: the softmax (in place when eager,
    # one fused pass when compiled), then the label column alone, p_label - 1 = exp(-CE) - 1 in
    # fp32. A full-width one-hot, or a scatter into fp32, would hold more [c, V] buffers.
    d = (z - lse[:, None]).exp_().to(logits.dtype)
    return ce, top, d.scatter_(1, labels[:, None], (torch.exp(-ce) - 1).to(d.dtype)[:, None])


def _kl_chunk(logits: Tensor, target_logits: Tensor, temperature: float, want_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Per-row T^2 * KL(p_target || p_drafter) at temperature T, and its gradient T (p_d - p_t).
    Written through the two log-normalisers only, so that compiled it holds no fp32 [c, V] buffer."""
    s, t = logits.float() / temperature, target_logits.float() / temperature
    lse_s, lse_t = torch.logsumexp(s, -1, keepdim=True), torch.logsumexp(t, -1, keepdim=True)
    pt = torch.exp(t - lse_t)
    kl = temperature**2 * (pt * ((t - lse_t) - (s - lse_s))).sum(-1)
    if not want_grad:
        return kl, None
    return kl, (temperature * (torch.exp(s - lse_s) - pt)).to(logits.dtype)


def _overlap_chunk(logits: Tensor, target_logits: Tensor) -> Tensor:
    """Per-row Σ_v min(q_v, p_v) at temperature 1 (q the drafter's, p the target's): through the
    log-normalisers, so that compiled it is one pass with no fp32 [c, V] buffer."""
    s, t = logits.float(), target_logits.float()
    return torch.exp(torch.minimum(s - torch.logsumexp(s, -1, keepdim=True), t - torch.logsumexp(t, -1, keepdim=True))).sum(-1)


@lru_cache(maxsize=None)
def _fused(fn, cuda: bool):
    # On GPU the elementwise tail (upcast, logsumexp, softmax - onehot) is fused into few passes
    # over the [chunk, vocab] logits; elsewhere eager is the reference.
    return torch.compile(fn, dynamic=True) if cuda else fn


def head_candidates(logits: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Rows of logits [c, V] -> the unary top-k's ids then the label's, [c, k + 1], and their logits."""
    ids = torch.cat([logits.topk(k, dim=-1).indices, labels[:, None]], 1)
    return ids, logits.gather(1, ids).float()


@dataclass
class _Bias:
    """DSpark's part of one row chunk: the Markov bias's low-rank inputs u [c, r] and W2 [V, r]
    (logits = h W^T + u W2^T, u = None without a Markov head), the loss's coefficients of each
    row's (CE, KL) [c, 2], and views of (Σ min(p, q) [c], the unbiased argmax [c], d loss / d u
    [c, r]); dw2 [V, r] (fp32) sums W2's gradient over the chunks."""

    u: Tensor | None
    w2: Tensor | None
    coef: Tensor
    overlap: Tensor
    top_plain: Tensor
    g_u: Tensor | None
    dw2: Tensor | None


def _head_chunk(h: Tensor, weight: Tensor, labels: Tensor, target_h: Tensor | None, temperature: float,
                out: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None], cand: tuple[Tensor, Tensor],
                bias: _Bias | None = None) -> None:
    """One row chunk into `out` = views of (CE, argmax, KL, d CE / d h, d KL / d h); None where not
    wanted; and into `cand` = (candidate ids [c, K], their logits), K = 0 for none. With `bias`
    (DSpark) the logits carry the Markov bias, d CE / d h holds the gradient of the chunk's share
    of the loss (Σ coef · (CE, KL)) and d KL / d h is None. The chunk's [c, V] logits and their
    gradient die on return, before the next chunk's."""
    ce, top, kl, g_ce, g_kl = out
    ce_fn, kl_fn = _fused(_ce_chunk, h.is_cuda), _fused(_kl_chunk, h.is_cuda)
    logits = h @ weight.T
    if bias is not None:
        bias.top_plain[:] = logits.argmax(-1)
        if bias.u is not None:
            logits = logits.addmm_(bias.u.to(logits.dtype), bias.w2.T.to(logits.dtype))
    if cand[0].shape[1]:
        cand[0][:], cand[1][:] = head_candidates(logits, labels, cand[0].shape[1] - 1)
    ce[:], top[:], d = ce_fn(logits, labels, g_ce is not None)
    if bias is not None and g_ce is not None:
        g_ce.zero_()
        _chunk_grad(d, bias.coef[:, 0], weight, g_ce, bias)
    elif g_ce is not None:
        torch.mm(d, weight, out=g_ce)
    if target_h is None:
        return
    del d  # the target's pass needs a second [c, V] (its logits): drop the CE gradient first
    target_logits = target_h @ weight.T
    if bias is not None:
        bias.overlap[:] = _fused(_overlap_chunk, h.is_cuda)(logits, target_logits)
    if kl is None:
        return
    kl[:], dk = kl_fn(logits, target_logits, temperature, g_ce is not None)
    if bias is not None and g_ce is not None:
        _chunk_grad(dk, bias.coef[:, 1], weight, g_ce, bias)
    elif g_kl is not None:
        torch.mm(dk, weight, out=g_kl)


def _chunk_grad(d: Tensor, coef: Tensor, weight: Tensor, g_h: Tensor, bias: _Bias) -> None:
    """Gradient rows d [c, V] (d loss_row / d logits), scaled by each row's coefficient, into
    d / d h, d / d u and W2's sum: dW2 += d^T u."""
    d = d * coef[:, None].to(d.dtype)
    g_h.addmm_(d, weight)
    if bias.u is not None and bias.g_u is not None:
        bias.g_u.addmm_(d, bias.w2.to(d.dtype))
        bias.dw2.addmm_(d.T.float(), bias.u.float())


# Logits held at once by the head: rows per chunk = HEAD_CHUNK_LOGITS // vocab (1766 rows of
# Qwen3's 151936). Each chunk holds its logits and their gradient ([c, V] each, 2 x 512 MiB in
# bf16 there): that transient sits on top of every saved activation, at the peak of the step.
HEAD_CHUNK_LOGITS = 1 << 28


class _ChunkedHead(torch.autograd.Function):
    """Per-row mode (`coef` None): CE and KL per row are differentiable w.r.t. hidden. Summed mode
    (DSpark, `coef` [N, 2]): the last output, loss = Σ_rows coef · (CE, KL), is differentiable
    w.r.t. hidden, u and W2; W2's gradient sums over every row, so the rows' coefficients come in
    before the pass and the gradient is complete when it ends."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None,
                temperature: float, chunk: int, top_k: int, u: Tensor | None = None, w2: Tensor | None = None,
                coef: Tensor | None = None, want_kl: bool = True):
        n, dev = hidden.shape[0], hidden.device
        summed = coef is not None
        want_grad = ctx.needs_input_grad[0] or (summed and any(ctx.needs_input_grad[7:9]))
        want_kl = target_hidden is not None and want_kl
        ce = torch.empty(n, dtype=torch.float32, device=dev)
        top = torch.empty(n, dtype=torch.long, device=dev)
        kl = torch.empty(n if want_kl else 0, dtype=torch.float32, device=dev)
        g_ce = torch.empty_like(hidden) if want_grad else None
        g_kl = torch.empty_like(hidden) if want_grad and want_kl and not summed else None
        k = top_k + 1 if top_k else 0
        cand = (torch.empty(n, k, dtype=torch.long, device=dev), torch.empty(n, k, dtype=torch.float32, device=dev))
        bias = None
        if summed:
            bias = _Bias(u, w2, coef, torch.empty(n if target_hidden is not None else 0, device=dev),
                         torch.empty(n, dtype=torch.long, device=dev),
                         torch.zeros_like(u) if want_grad and u is not None else None,
                         torch.zeros(w2.shape, dtype=torch.float32, device=dev) if want_grad and u is not None else None)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            part = lambda t: None if t is None else t[s:e]  # noqa: E731
            part_bias = None if bias is None else _Bias(
                part(u), w2, coef[s:e], bias.overlap[s:e] if target_hidden is not None else None,
                bias.top_plain[s:e], part(bias.g_u), bias.dw2)
            _head_chunk(hidden[s:e], weight, labels[s:e], part(target_hidden), temperature,
                        (ce[s:e], top[s:e], part(kl) if want_kl else None, part(g_ce), part(g_kl)),
                        (cand[0][s:e], cand[1][s:e]), part_bias)
        loss = (coef[:, 0] * ce).sum() + ((coef[:, 1] * kl).sum() if want_kl else 0.0) if summed else ce.new_zeros(())
        ctx.summed, ctx.w2_dtype = summed, None if w2 is None else w2.dtype
        ctx.save_for_backward(g_ce, g_kl, weight, cand[0], *((bias.g_u, bias.dw2) if summed else (None, None)))
        plain = bias.top_plain if summed else top.new_empty(0)
        overlap = bias.overlap if summed else ce.new_empty(0)
        ctx.mark_non_differentiable(top, cand[0], plain, overlap, *((ce, kl) if summed else ()))
        return ce, kl, top, *cand, overlap, plain, loss

    @staticmethod
    def backward(ctx, d_ce: Tensor, d_kl: Tensor, _d_top: Tensor, _d_ids: Tensor, d_cand: Tensor | None,
                 _d_overlap: Tensor, _d_plain: Tensor, d_loss: Tensor):
        g_ce, g_kl, weight, ids, g_u, dw2 = ctx.saved_tensors
        if ctx.summed:  # one scalar upstream: the gradients were complete in the forward pass
            d_u = None if g_u is None else (g_u.float() * d_loss).to(g_u.dtype)
            d_w2 = None if dw2 is None else (dw2 * d_loss).to(ctx.w2_dtype)
            return (g_ce.float() * d_loss).to(g_ce.dtype), None, None, None, None, None, None, d_u, d_w2, None, None
        grad = g_ce.float() * d_ce[:, None]
        if g_kl is not None:
            grad = grad + g_kl.float() * d_kl[:, None]
        if d_cand is not None and ids.shape[1]:  # d logit[c] / d h = W[c]: a weighted sum of the candidates' rows
            grad = grad + F.embedding_bag(ids, weight, per_sample_weights=d_cand.to(weight.dtype), mode="sum").float()
        return grad.to(g_ce.dtype), None, None, None, None, None, None, None, None, None, None


def head_losses(hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None = None,
                temperature: float = 1.0, chunk_rows: int | None = None, top_k: int = 0) -> tuple[Tensor, ...]:
    """Frozen LM head `weight` [V, H] on `hidden` [N, H] in row chunks.

    Returns per-row CE [N] (fp32), per-row T^2-scaled KL to softmax(target_hidden @ W^T) [N] (empty
    without `target_hidden`), the argmax [N], and with top_k > 0 the selector's candidates
    (`head_candidates`: the top-k's ids then the label's [N, top_k + 1], and their logits, fp32).
    Differentiable w.r.t. `hidden` only."""
    _check_frozen(weight)
    chunk = chunk_rows or max(1, HEAD_CHUNK_LOGITS // weight.shape[0])
    out = _ChunkedHead.apply(hidden, weight, labels, target_hidden, float(temperature), chunk, top_k)
    return out[:5] if top_k else out[:3]


@dataclass
class BiasedHead:
    """`biased_head_losses`: per labelled row, fp32 unless ids."""

    loss: Tensor  # scalar Σ coef · (CE, KL), differentiable w.r.t. hidden, u and W2
    ce: Tensor  # [N] CE of the biased logits
    kl: Tensor  # [N] (empty without KL)
    top: Tensor  # [N] argmax of the biased logits (what greedy decoding drafts, teacher-forced)
    top_plain: Tensor  # [N] argmax without the bias
    overlap: Tensor  # [N] Σ_v min(p_v, q_v) at temperature 1, p the target's (empty without target_hidden)


def biased_head_losses(hidden: Tensor, weight: Tensor, labels: Tensor, coef: Tensor, u: Tensor | None = None,
                       w2: Tensor | None = None, target_hidden: Tensor | None = None, want_kl: bool = False,
                       temperature: float = 1.0, chunk_rows: int | None = None) -> BiasedHead:
    """DSpark's head in row chunks: logits = hidden W^T + u W2^T (W frozen [V, H]; u [N, r] and W2
    [V, r] trained; no bias without u), and the loss Σ_rows coef[:, 0] CE + coef[:, 1] KL (coef [N, 2],
    detached: what each row's terms weigh in the loss), with Σ min(p, q) against the target's
    distribution softmax(target_hidden W^T). Never holds [N, V] logits."""
    _check_frozen(weight)
    chunk = chunk_rows or max(1, HEAD_CHUNK_LOGITS // weight.shape[0])
    ce, kl, top, _, _, overlap, plain, loss = _ChunkedHead.apply(
        hidden, weight, labels, target_hidden, float(temperature), chunk, 0, u, w2, coef.detach().float(), want_kl)
    return BiasedHead(loss, ce, kl, top, plain, overlap)


def _check_frozen(weight: Tensor) -> None:
    if weight.requires_grad:
        raise ValueError("head_losses: the LM head is the target's and stays frozen (weight.requires_grad must be False)")


# ---- one micro-batch ------------------------------------------------------------------------


@dataclass
class LossSettings:
    loss: str = "ce"  # "ce" | "kl" | "dpace"
    gamma: float = 7.0
    kl_weight: float = 1.0
    kl_temperature: float = 1.0
    dpace_alpha: float = 0.5
    selector_alpha: float = 1.0  # DFlash 2: weight of the selector's K-way cross-entropy
    confidence_alpha: float = 1.0  # DSpark: weight of the confidence head's BCE

    @classmethod
    def from_config(cls, train_cfg, block_size: int) -> "LossSettings":
        gamma = train_cfg.gamma if train_cfg.gamma is not None else default_gamma(block_size)
        return cls(train_cfg.loss, gamma, train_cfg.kl_weight, train_cfg.kl_temperature, train_cfg.dpace_alpha,
                   train_cfg.selector_loss_alpha, train_cfg.confidence_head_alpha)


@dataclass
class MicroBatch:
    """Everything one forward pass needs; built on the host (`micro_batch`), moved with `.to`."""

    input_ids: Tensor  # [b, T]
    ctx_valid: Tensor  # [b, T] bool, False on right padding
    features: Tensor  # [b, T, n_taps * H] fc input (noise, if any, already added)
    anchors: Tensor  # [b, n]
    labels: Tensor  # [b, n * B], IGNORE where no loss
    label_rows: Tensor  # [N] flat indices of the labelled slots (known on the host: no device sync)
    final_hidden: Tensor | None = None  # [b, T, H] target's final hidden state ("kl", a confidence head; never noised)

    def to(self, device, dtype: torch.dtype | None = None) -> "MicroBatch":
        pin = torch.device(device).type == "cuda"

        def mv(t: Tensor | None, float_: bool = False) -> Tensor | None:
            if t is None:
                return None
            if pin and t.device.type == "cpu":  # a pageable copy would wait for the GPU to drain
                t = t.pin_memory()
            return t.to(device=device, dtype=dtype if float_ and dtype else t.dtype, non_blocking=True)

        return MicroBatch(mv(self.input_ids), mv(self.ctx_valid), mv(self.features, True), mv(self.anchors),
                          mv(self.labels), mv(self.label_rows), mv(self.final_hidden, True))


def micro_batch(input_ids: Tensor, loss_mask: Tensor, ctx_valid: Tensor, features: Tensor, anchors: Tensor,
                anchor_valid: Tensor, block_size: int, final_hidden: Tensor | None = None,
                anchor_first: bool = False) -> MicroBatch:
    labels = block_labels(input_ids, loss_mask & ctx_valid, anchors, anchor_valid, block_size, anchor_first)
    rows = (labels.flatten() != IGNORE).nonzero().squeeze(1)
    return MicroBatch(input_ids, ctx_valid, features, anchors, labels, rows, final_hidden)


@dataclass
class LossOut:
    loss_sum: Tensor  # scalar, differentiable: sum over labelled slots of weight * loss
    weight_sum: Tensor  # scalar: sum of those weights (the normaliser, summed over micro-batches and ranks)
    slot_correct: Tensor  # [B] per slot, how often the token decoding would draft equals the label
    slot_count: Tensor  # [B] labelled slots per slot index
    accept_len: Tensor  # [blocks] 1 + leading drafting slots whose drafted token equals the label (padding blocks included)
    block_valid: Tensor  # [blocks] the block is a real anchor
    # Sums of the family's metrics (`FAMILY_METRICS`: name -> (numerator, denominator)); empty for DFlash.
    extra: dict[str, Tensor] = field(default_factory=dict)
    # A confidence head's reliability sums [CALIBRATION_BINS, 4]: per bin of predicted confidence, the
    # count, Σ confidence, Σ greedy hit (label == drafted token), Σ min(p, q) summed over vocab.
    calibration: Tensor | None = None


# The family's training metrics, each a ratio of two sums over a step (or a held-out pass);
# "confidence": those of a drafter with a confidence head (DSpark's, whose target is Σ min(p, q)).
FAMILY_METRICS = {"dflash2": {"recall": ("recall_hits", "rows"),  # unary top-K holds the label
                              "selector_acc": ("selector_hits", "recall_hits"),  # teacher-forced, where it can be right
                              "tau_unary": ("unary_accept", "blocks")},  # DFlash's chain of unary argmaxes
                  "dspark": {"tau_unbiased": ("plain_accept", "blocks")},  # the argmaxes without the Markov bias
                  "confidence": {"conf_bce": ("conf_bce", "rows"), "conf_mean": ("conf_sum", "rows"),
                                 "overlap_mean": ("overlap_sum", "rows"),  # Σ min(p, q): the head's target
                                 "tau_overlap": ("overlap_accept", "blocks")}}  # the rejection rule's expected τ
CALIBRATION_BINS = 10


def _metric_set(cfg) -> dict[str, tuple[str, str]]:
    conf = FAMILY_METRICS["confidence"] if cfg.enable_confidence_head else {}
    return {**FAMILY_METRICS.get(cfg.kind, {}), **conf}


def family_sums(cfg) -> list[str]:
    """The sums `LossOut.extra` holds for a drafter of config `cfg`, in a fixed order (for one all-reduce)."""
    return sorted({n for pair in _metric_set(cfg).values() for n in pair})


def family_metrics(cfg, sums: dict[str, float]) -> dict[str, float]:
    return {m: sums[a] / max(sums[b], 1e-12) for m, (a, b) in _metric_set(cfg).items()}


def calibration_report(sums: Tensor) -> dict[str, Any]:
    """`LossOut.calibration` sums [bins, 4] -> the reliability table (per bin of predicted
    confidence: mean predicted, mean observed as the greedy hit and as Σ min(p, q), count) and the
    expected calibration error against each: Σ_bins count / total * |mean predicted - mean observed|."""
    count, conf, hit, overlap = sums.double().unbind(-1)
    n = count.clamp(min=1)
    total = max(float(count.sum()), 1.0)
    table = [{"bin": [i / len(count), (i + 1) / len(count)], "predicted": round(float(conf[i] / n[i]), 4),
              "hit": round(float(hit[i] / n[i]), 4), "overlap": round(float(overlap[i] / n[i]), 4),
              "count": int(count[i])} for i in range(len(count))]
    ece = lambda obs: float(((conf - obs).abs()).sum() / total)  # noqa: E731  (count * |mean - mean| = |sum - sum|)
    return {"reliability": table, "ece_hit": ece(hit), "ece_overlap": ece(overlap)}


@dataclass
class _Terms:
    """One head pass over the labelled rows (N): the loss, each row's weight, what decoding would
    draft there (teacher-forced), and the family's sums."""

    loss_sum: Tensor
    weights: Tensor  # [N]
    top: Tensor  # [N]
    extra: dict[str, Tensor]
    calibration: Tensor | None = None


def block_loss(drafter, embed, head_weight: Tensor, mb: MicroBatch, settings: LossSettings,
               backend: str = "sdpa", chunk_rows: int | None = None) -> LossOut:
    """Forward one micro-batch through the training path and the chunked LM head. accept_len is
    what decoding gets: DFlash 2's selector walk, DSpark's Markov-biased argmaxes (their
    predecessor the label before, exact while the walk matches), else the unary argmax."""
    cfg = drafter.config
    B, first = cfg.block_size, int(cfg.sample_from_anchor)
    hidden = training_hidden(drafter, embed, mb.input_ids, mb.features, mb.anchors, mb.ctx_valid, backend)
    labels, rows = mb.labels.flatten(), mb.label_rows
    h = hidden.flatten(0, 1).index_select(0, rows)
    terms_of = _dspark_terms if cfg.kind == "dspark" else _unary_terms
    t = terms_of(unwrap(drafter), hidden, h, mb, settings, head_weight, chunk_rows)
    slot = rows % B
    hit = t.top == labels[rows]
    block_valid = (labels.view(-1, B) != IGNORE).any(-1)
    if t.extra:
        t.extra["blocks"] = block_valid.sum().float()
    return LossOut(
        loss_sum=t.loss_sum,
        weight_sum=t.weights.sum().detach(),
        slot_correct=torch.zeros(B, device=h.device).index_add_(0, slot, hit.float()),  # bincount would sync
        slot_count=torch.zeros(B, device=h.device).index_add_(0, slot, torch.ones_like(t.weights)),
        accept_len=_accept(hit, rows, labels.numel(), B, first),
        block_valid=block_valid,
        extra=t.extra,
        calibration=t.calibration,
    )


def _unary_terms(core, hidden: Tensor, h: Tensor, mb: MicroBatch, settings: LossSettings, head_weight: Tensor,
                 chunk_rows: int | None) -> _Terms:
    """DFlash's CE / KL / D-PACE over the head's logits, plus DFlash 2's selector."""
    cfg = core.config
    B, first = cfg.block_size, int(cfg.sample_from_anchor)
    labels, rows = mb.labels.flatten(), mb.label_rows
    target_h = _final_targets(mb, rows, B, first, "train.loss='kl'") if settings.loss == "kl" else None
    selector = core.selector()
    ce, kl, top, *cand = head_losses(h, head_weight, labels[rows], target_h, settings.kl_temperature, chunk_rows,
                                     cfg.selector_top_k if selector is not None else 0)
    if settings.loss == "dpace":
        w = _dpace_rows(ce, labels, rows, B, settings.dpace_alpha)
    else:
        w = slot_weights(B, settings.gamma, ce.device, bool(first))[rows % B]
    per_row = ce if settings.loss != "kl" else (1 - settings.kl_weight) * ce + settings.kl_weight * kl
    extra: dict[str, Tensor] = {}
    if selector is not None:
        preds = block_predecessors(mb.input_ids, mb.anchors, B, bool(first)).flatten()[rows]
        sel_ce, top, extra = selector_terms(selector, h, preds, labels[rows], *cand)
        per_row = per_row + settings.selector_alpha * sel_ce
        extra["unary_accept"] = _accept_sum(extra.pop("unary_hit"), rows, labels, B, first)
    return _Terms((w * per_row).sum(), w, top, extra)


def _dpace_rows(ce: Tensor, labels: Tensor, rows: Tensor, B: int, alpha: float) -> Tensor:
    grid_ce = torch.zeros(labels.numel(), device=ce.device).index_copy_(0, rows, ce.detach()).view(-1, B)
    valid = (labels != IGNORE).view(-1, B)
    return dpace_weights(grid_ce, valid, alpha).flatten()[rows]


def _dspark_terms(core, hidden: Tensor, h: Tensor, mb: MicroBatch, settings: LossSettings, head_weight: Tensor,
                  chunk_rows: int | None) -> _Terms:
    """DSpark: the loss over the Markov-biased logits (logits = h W^T + W2 u, u from the teacher-forced
    token before each slot: `block_predecessors`), then the confidence head's BCE against Σ min(p, q),
    p the target's distribution at the slot, q the drafter's (biased, detached)."""
    cfg = core.config
    B, first = cfg.block_size, int(cfg.sample_from_anchor)
    labels, rows = mb.labels.flatten(), mb.label_rows
    conf_head = core.confidence()
    want_target = settings.loss == "kl" or conf_head is not None
    why = "train.loss='kl'" if settings.loss == "kl" else "the confidence head's target"
    target_h = _final_targets(mb, rows, B, first, why) if want_target else None
    fixed = slot_weights(B, settings.gamma, h.device, bool(first))[rows % B]
    preds = block_predecessors(mb.input_ids, mb.anchors, B, bool(first)).view(-1, B)

    def head(coef: Tensor):
        def run(u: Tensor | None, emb: Tensor | None, w2: Tensor | None) -> tuple[BiasedHead, Tensor | None]:
            pick = lambda t: None if t is None else t.flatten(0, 1).index_select(0, rows)  # noqa: E731
            return biased_head_losses(h, head_weight, labels[rows], coef, pick(u), w2, target_h, settings.loss == "kl",
                                      settings.kl_temperature, chunk_rows), pick(emb)
        markov = core.markov()
        # Through the head's forward: under FSDP2 it gathers W1 and W2 there.
        return run(None, None, None) if markov is None else markov(preds, hidden.view(-1, B, hidden.shape[-1]), run)

    w = fixed
    if settings.loss == "dpace":  # its weights come from the biased CE: a first pass, without gradients
        with torch.no_grad():
            w = _dpace_rows(head(torch.zeros(len(rows), 2, device=h.device))[0].ce, labels, rows, B, settings.dpace_alpha)
    kl_share = settings.kl_weight if settings.loss == "kl" else 0.0
    out, emb = head(torch.stack([w * (1 - kl_share), w * kl_share], -1))
    extra = {"plain_accept": _accept_sum(out.top_plain == labels[rows], rows, labels, B, first)}
    t = _Terms(out.loss, w, out.top, extra)
    if conf_head is not None:
        _confidence_terms(conf_head, h if emb is None else torch.cat([h, emb.to(h.dtype)], -1), out, fixed,
                          settings.confidence_alpha, mb, t, first)
    return t


def _confidence_terms(conf_head, features: Tensor, out: BiasedHead, weights: Tensor, alpha: float, mb: MicroBatch,
                      t: _Terms, first: int) -> None:
    """The confidence head's BCE (slot-weighted, as the reference keeps it under D-PACE too) into the
    loss; its metrics and reliability sums into `t`."""
    B = mb.labels.shape[1] // mb.anchors.shape[1]
    labels, rows = mb.labels.flatten(), mb.label_rows
    logit = conf_head(features).float()
    bce = F.binary_cross_entropy_with_logits(logit, out.overlap, reduction="none")
    t.loss_sum = t.loss_sum + alpha * (weights * bce).sum()
    conf = torch.sigmoid(logit.detach())
    grid = torch.zeros(labels.numel(), device=conf.device).index_copy_(0, rows, out.overlap).view(-1, B)[:, 1 - first:]
    valid = (labels.view(-1, B) != IGNORE).any(-1)
    t.extra.update(rows=torch.ones_like(bce).sum(), conf_bce=bce.detach().sum(), conf_sum=conf.sum(),
                   overlap_sum=out.overlap.sum(), overlap_accept=((1 + grid.cumprod(-1).sum(-1)) * valid).sum())
    bins = (conf * CALIBRATION_BINS).long().clamp(max=CALIBRATION_BINS - 1)
    cols = torch.stack([torch.ones_like(conf), conf, (out.top == labels[rows]).float(), out.overlap], -1)
    t.calibration = torch.zeros(CALIBRATION_BINS, 4, device=conf.device).index_add_(0, bins, cols)


def _final_targets(mb: MicroBatch, rows: Tensor, B: int, first: int, why: str) -> Tensor:
    if mb.final_hidden is None:
        raise ValueError(f"{why} needs the target's final hidden state (online features, or a feature "
                         "cache that holds the last layer)")
    # The target's distribution over the token at position p comes from its hidden state at p - 1.
    prev = (block_positions(mb.anchors, B) - 1 + first).clamp(min=0).flatten()
    seq = torch.arange(mb.anchors.shape[0], device=rows.device).repeat_interleave(mb.labels.shape[1])
    return mb.final_hidden[seq[rows], prev[rows]]


def _accept(hit: Tensor, rows: Tensor, n: int, B: int, first: int) -> Tensor:
    """Per block, 1 + the leading drafting slots whose token hit (hit [N] over the labelled rows)."""
    match = torch.zeros(n, dtype=torch.bool, device=rows.device).index_copy_(0, rows, hit).view(-1, B)
    return 1 + match[:, 1 - first:].long().cumprod(-1).sum(-1)


def _accept_sum(hit: Tensor, rows: Tensor, labels: Tensor, B: int, first: int) -> Tensor:
    """`_accept` summed over the real blocks (a padding block would count 1)."""
    valid = (labels.view(-1, B) != IGNORE).any(-1)
    return (_accept(hit, rows, labels.numel(), B, first) * valid).sum().float()


def selector_terms(selector, h: Tensor, preds: Tensor, labels: Tensor, ids: Tensor, logits: Tensor
                   ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """DFlash 2's K-way cross-entropy of labelled rows: h [N, H], preds [N] (the token before),
    labels [N], the head's candidates ids / logits [N, K + 1] (top-K, then the label). The label
    takes the K-th place where the top-K misses it. -> (CE [N], the selector's pick [N], sums of
    its metrics)."""
    K = ids.shape[1] - 1
    contains = (ids[:, :K] == labels[:, None]).any(-1)
    ids = torch.cat([ids[:, :K - 1], torch.where(contains, ids[:, K - 1], labels)[:, None]], 1)
    unary = torch.cat([logits[:, :K - 1], torch.where(contains, logits[:, K - 1], logits[:, K])[:, None]], 1)
    scores = selector.scores(unary, h, preds[:, None], ids)[:, 0]  # decoding's edge scores (`CandidateSelector.lattice`)
    target = (ids == labels[:, None]).float().argmax(-1)
    ce = F.cross_entropy(scores, target, reduction="none")
    # Where the top-K misses the label, decoding could not draft it: the pick is then never right.
    pick = torch.where(contains, ids.gather(1, scores.detach().argmax(-1, keepdim=True))[:, 0], -1)
    extra = {"rows": torch.ones_like(ce).sum(), "recall_hits": contains.float().sum(),
             "selector_hits": (pick == labels).float().sum(), "unary_hit": ids[:, 0] == labels}
    return ce, pick, extra


def unwrap(model):
    """The drafter inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return getattr(model, "module", model)
