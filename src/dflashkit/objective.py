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


def check_label_sources(tap_ids: list[int], num_target_layers: int, loss: str) -> None:
    """`fc` must never see the layer the labels come from (docs/conventions.md, mistake 2). Hard labels are
    token ids; KL targets are the LM head of the target's final hidden state, i.e. layer L - 1."""
    last = num_target_layers - 1
    if loss == "kl" and last in tap_ids:
        raise ValueError(
            f"train.loss='kl' takes its target logits from the target's final hidden state (layer {last}), "
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


@lru_cache(maxsize=None)
def _fused(fn, cuda: bool):
    # On GPU the elementwise tail (upcast, logsumexp, softmax - onehot) is fused into few passes
    # over the [chunk, vocab] logits; elsewhere eager is the reference.
    return torch.compile(fn, dynamic=True) if cuda else fn


def head_candidates(logits: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Rows of logits [c, V] -> the unary top-k's ids then the label's, [c, k + 1], and their logits."""
    ids = torch.cat([logits.topk(k, dim=-1).indices, labels[:, None]], 1)
    return ids, logits.gather(1, ids).float()


def _head_chunk(h: Tensor, weight: Tensor, labels: Tensor, target_h: Tensor | None, temperature: float,
                out: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None], cand: tuple[Tensor, Tensor]) -> None:
    """One row chunk into `out` = views of (CE, argmax, KL, d CE / d h, d KL / d h); None where not
    wanted; and into `cand` = (candidate ids [c, K], their logits), K = 0 for none. The chunk's
    [c, V] logits and their gradient die on return, before the next chunk's."""
    ce, top, kl, g_ce, g_kl = out
    ce_fn, kl_fn = _fused(_ce_chunk, h.is_cuda), _fused(_kl_chunk, h.is_cuda)
    logits = h @ weight.T
    if cand[0].shape[1]:
        cand[0][:], cand[1][:] = head_candidates(logits, labels, cand[0].shape[1] - 1)
    ce[:], top[:], d = ce_fn(logits, labels, g_ce is not None)
    if g_ce is not None:
        torch.mm(d, weight, out=g_ce)
    if target_h is not None:
        del d  # the KL pass needs a second [c, V] (the target's logits): drop the CE gradient first
        kl[:], dk = kl_fn(logits, target_h @ weight.T, temperature, g_kl is not None)
        if g_kl is not None:
            torch.mm(dk, weight, out=g_kl)


# Logits held at once by the head: rows per chunk = HEAD_CHUNK_LOGITS // vocab (1766 rows of
# Qwen3's 151936). Each chunk holds its logits and their gradient ([c, V] each, 2 x 512 MiB in
# bf16 there): that transient sits on top of every saved activation, at the peak of the step.
HEAD_CHUNK_LOGITS = 1 << 28


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None,
                temperature: float, chunk: int, top_k: int):
        n = hidden.shape[0]
        want_grad = ctx.needs_input_grad[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        top = torch.empty(n, dtype=torch.long, device=hidden.device)
        kl = torch.empty(n if target_hidden is not None else 0, dtype=torch.float32, device=hidden.device)
        g_ce = torch.empty_like(hidden) if want_grad else None
        g_kl = torch.empty_like(hidden) if want_grad and target_hidden is not None else None
        k = top_k + 1 if top_k else 0
        cand = (torch.empty(n, k, dtype=torch.long, device=hidden.device),
                torch.empty(n, k, dtype=torch.float32, device=hidden.device))
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            part = lambda t: None if t is None else t[s:e]  # noqa: E731
            _head_chunk(hidden[s:e], weight, labels[s:e], part(target_hidden), temperature,
                        (ce[s:e], top[s:e], part(kl), part(g_ce), part(g_kl)), (cand[0][s:e], cand[1][s:e]))
        ctx.save_for_backward(g_ce, g_kl, weight, cand[0])
        ctx.mark_non_differentiable(top, cand[0])
        return ce, kl, top, *cand

    @staticmethod
    def backward(ctx, d_ce: Tensor, d_kl: Tensor, _d_top: Tensor, _d_ids: Tensor, d_cand: Tensor | None):
        g_ce, g_kl, weight, ids = ctx.saved_tensors
        grad = g_ce.float() * d_ce[:, None]
        if g_kl is not None:
            grad = grad + g_kl.float() * d_kl[:, None]
        if d_cand is not None and ids.shape[1]:  # d logit[c] / d h = W[c]: a weighted sum of the candidates' rows
            grad = grad + F.embedding_bag(ids, weight, per_sample_weights=d_cand.to(weight.dtype), mode="sum").float()
        return grad.to(g_ce.dtype), None, None, None, None, None, None


def head_losses(hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None = None,
                temperature: float = 1.0, chunk_rows: int | None = None, top_k: int = 0) -> tuple[Tensor, ...]:
    """Frozen LM head `weight` [V, H] on `hidden` [N, H] in row chunks.

    Returns per-row CE [N] (fp32), per-row T^2-scaled KL to softmax(target_hidden @ W^T) [N] (empty
    without `target_hidden`), the argmax [N], and with top_k > 0 the selector's candidates
    (`head_candidates`: the top-k's ids then the label's [N, top_k + 1], and their logits, fp32).
    Differentiable w.r.t. `hidden` only."""
    if weight.requires_grad:
        raise ValueError("head_losses: the LM head is the target's and stays frozen (weight.requires_grad must be False)")
    chunk = chunk_rows or max(1, HEAD_CHUNK_LOGITS // weight.shape[0])
    out = _ChunkedHead.apply(hidden, weight, labels, target_hidden, float(temperature), chunk, top_k)
    return out if top_k else out[:3]


# ---- one micro-batch ------------------------------------------------------------------------


@dataclass
class LossSettings:
    loss: str = "ce"  # "ce" | "kl" | "dpace"
    gamma: float = 7.0
    kl_weight: float = 1.0
    kl_temperature: float = 1.0
    dpace_alpha: float = 0.5
    selector_alpha: float = 1.0  # DFlash 2: weight of the selector's K-way cross-entropy

    @classmethod
    def from_config(cls, train_cfg, block_size: int) -> "LossSettings":
        gamma = train_cfg.gamma if train_cfg.gamma is not None else default_gamma(block_size)
        return cls(train_cfg.loss, gamma, train_cfg.kl_weight, train_cfg.kl_temperature, train_cfg.dpace_alpha,
                   train_cfg.selector_loss_alpha)


@dataclass
class MicroBatch:
    """Everything one forward pass needs; built on the host (`micro_batch`), moved with `.to`."""

    input_ids: Tensor  # [b, T]
    ctx_valid: Tensor  # [b, T] bool, False on right padding
    features: Tensor  # [b, T, n_taps * H] fc input (noise, if any, already added)
    anchors: Tensor  # [b, n]
    labels: Tensor  # [b, n * B], IGNORE where no loss
    label_rows: Tensor  # [N] flat indices of the labelled slots (known on the host: no device sync)
    final_hidden: Tensor | None = None  # [b, T, H] target's final hidden state ("kl" only; never noised)

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


# The family's training metrics, each a ratio of two sums over a step (or a held-out pass).
FAMILY_METRICS = {"dflash2": {"recall": ("recall_hits", "rows"),  # unary top-K holds the label
                              "selector_acc": ("selector_hits", "recall_hits"),  # teacher-forced, where it can be right
                              "tau_unary": ("unary_accept", "blocks")}}  # DFlash's chain of unary argmaxes


def family_sums(kind: str) -> list[str]:
    """The sums `LossOut.extra` holds for a drafter of `kind`, in a fixed order (for one all-reduce)."""
    return sorted({n for pair in FAMILY_METRICS.get(kind, {}).values() for n in pair})


def family_metrics(kind: str, sums: dict[str, float]) -> dict[str, float]:
    return {m: sums[a] / max(sums[b], 1e-12) for m, (a, b) in FAMILY_METRICS.get(kind, {}).items()}


def block_loss(drafter, embed, head_weight: Tensor, mb: MicroBatch, settings: LossSettings,
               backend: str = "sdpa", chunk_rows: int | None = None) -> LossOut:
    """Forward one micro-batch through the training path and the chunked LM head. accept_len is
    what decoding gets: DFlash 2's selector walk (its predecessor the label before, exact while
    the walk matches), else the unary argmax."""
    cfg = drafter.config
    B, first = cfg.block_size, int(cfg.sample_from_anchor)
    hidden = training_hidden(drafter, embed, mb.input_ids, mb.features, mb.anchors, mb.ctx_valid, backend)
    labels, rows = mb.labels.flatten(), mb.label_rows
    h = hidden.flatten(0, 1).index_select(0, rows)
    target_h = _kl_targets(mb, rows, B, first) if settings.loss == "kl" else None
    selector = getattr(unwrap(drafter), "candidate_selector", None)
    ce, kl, top, *cand = head_losses(h, head_weight, labels[rows], target_h, settings.kl_temperature, chunk_rows,
                                     cfg.selector_top_k if selector is not None else 0)
    slot = rows % B
    if settings.loss == "dpace":
        grid_ce = torch.zeros(labels.numel(), device=ce.device).index_copy_(0, rows, ce.detach()).view(-1, B)
        valid = (labels != IGNORE).view(-1, B)
        w = dpace_weights(grid_ce, valid, settings.dpace_alpha).flatten()[rows]
    else:
        w = slot_weights(B, settings.gamma, ce.device, bool(first))[slot]
    per_row = ce if settings.loss != "kl" else (1 - settings.kl_weight) * ce + settings.kl_weight * kl
    extra: dict[str, Tensor] = {}
    if selector is not None:
        preds = block_predecessors(mb.input_ids, mb.anchors, B, bool(first)).flatten()[rows]
        sel_ce, top, extra = selector_terms(selector, h, preds, labels[rows], *cand)
        per_row = per_row + settings.selector_alpha * sel_ce
        extra["unary_accept"] = _accept(extra.pop("unary_hit"), rows, labels.numel(), B, first).sum().float()
    hit = top == labels[rows]
    accept = _accept(hit, rows, labels.numel(), B, first)
    block_valid = (labels.view(-1, B) != IGNORE).any(-1)
    if extra:
        extra["blocks"] = block_valid.sum().float()
    return LossOut(
        loss_sum=(w * per_row).sum(),
        weight_sum=w.sum().detach(),
        slot_correct=torch.zeros(B, device=ce.device).index_add_(0, slot, hit.float()),  # bincount would sync
        slot_count=torch.zeros(B, device=ce.device).index_add_(0, slot, torch.ones_like(ce)),
        accept_len=accept,
        block_valid=block_valid,
        extra=extra,
    )


def _kl_targets(mb: MicroBatch, rows: Tensor, B: int, first: int) -> Tensor:
    if mb.final_hidden is None:
        raise ValueError("train.loss='kl' needs the target's final hidden state (online features, or a feature "
                         "cache that holds the last layer)")
    # The target's distribution over the token at position p comes from its hidden state at p - 1.
    prev = (block_positions(mb.anchors, B) - 1 + first).clamp(min=0).flatten()
    seq = torch.arange(mb.anchors.shape[0], device=rows.device).repeat_interleave(mb.labels.shape[1])
    return mb.final_hidden[seq[rows], prev[rows]]


def _accept(hit: Tensor, rows: Tensor, n: int, B: int, first: int) -> Tensor:
    """Per block, 1 + the leading drafting slots whose token hit (hit [N] over the labelled rows)."""
    match = torch.zeros(n, dtype=torch.bool, device=rows.device).index_copy_(0, rows, hit).view(-1, B)
    return 1 + match[:, 1 - first:].long().cumprod(-1).sum(-1)


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
    scores = unary + selector(h, preds[:, None], ids)[:, 0].float()
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
