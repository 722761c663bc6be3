"""The optional modules of the drafter family: one DFlash backbone (`drafter.py`), and what a
checkpoint's config declares on top of it.

* DFlash 2 (Inco AI with Z Lab): `BlockConv`, a grouped dynamic depthwise convolution around each
  attention and MLP sublayer (`conv_kernel_size`, `conv_group_size`), and `CandidateSelector`,
  low-rank edge scores between consecutive block tokens over the unary head's top-K
  (`selector_rank`, `selector_top_k`).
* DSpark (DeepSeek): `MarkovHead`, a low-rank logit bias from the token drafted before
  (`markov_rank`, `markov_head_type`), and `ConfidenceHead`, each position's acceptance probability
  (`enable_confidence_head`, `confidence_head_with_markov`).

Tensor names are the reference ones (speculators' `dflash2` and `dspark` models): an export loads
there unchanged. Every module here computes on the block stream only, never on the context.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MARKOV_KINDS = ("vanilla", "gated", "rnn")
T = TypeVar("T")


class Declared(NamedTuple):
    """An optional module's tensors (`pattern`), the config field whose value makes the module
    exist (`field`), what it is, and the fields its tensors' shapes follow."""

    pattern: re.Pattern[str]
    field: str
    what: str
    shaped_by: tuple[str, ...]


# Disjoint patterns, in the order problems are reported (a module before its parts).
DECLARED = (
    Declared(re.compile(r"layers\.\d+\.(attention|mlp)_conv\."), "conv_kernel_size", "block convolutions",
             ("conv_kernel_size", "conv_group_size")),
    Declared(re.compile(r"candidate_selector\."), "selector_rank", "a candidate selector", ("selector_rank",)),
    Declared(re.compile(r"markov_head\.markov_w[12]\."), "markov_rank", "a Markov head", ("markov_rank",)),
    Declared(re.compile(r"markov_head\."), "markov_head_type",
             "the Markov head's gate ('gated') or joint ('rnn') projection", ("markov_rank",)),
    Declared(re.compile(r"confidence_head\."), "enable_confidence_head", "a confidence head",
             ("confidence_head_with_markov", "markov_rank")),
)


def declared_by(tensor: str) -> Declared | None:
    """The optional module a tensor name belongs to; None for the backbone's tensors."""
    return next((d for d in DECLARED if d.pattern.match(tensor)), None)


def block_conv(x: Tensor, delta: Tensor, base: Tensor, block: int, group: int) -> Tensor:
    """A causal depthwise convolution inside each block of `block` positions.

    x [b, n * block, H]; delta [b, n * block, k, G] (a per-position kernel for each group of `group`
    channels); base [k, H]. Output position t is sum over taps j of x[t - j] * (base[j] + delta[t, j]),
    where a tap that reaches before its block's first position reads zero."""
    b, q, H = x.shape
    k, G = base.shape[0], H // group
    xs = x.view(b, q // block, block, G, group)
    ds = delta.view(b, q // block, block, k, G, 1)
    coef = base.to(xs.dtype).view(k, G, group)
    out = xs * (coef[0] + ds[:, :, :, 0])
    if min(k, block) > 1:  # tap j reads a slice of one copy of x with k - 1 zeros before each block
        padded = F.pad(xs, (0, 0, 0, 0, k - 1, 0))  # [b, n, k - 1 + block, G, group]
        for j in range(1, min(k, block)):
            out = out + padded[:, :, k - 1 - j:k - 1 - j + block] * (coef[j] + ds[:, :, :, j])
    return out.view(b, q, H)


class BlockConv(nn.Module):
    """The two convolutions around one sublayer (input side, output side), their per-position
    kernels both projected from the sublayer's input. Identity at initialisation: a fresh DFlash 2
    layer computes what its DFlash layer does."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """x [b, q, H] (the normed sublayer input) -> (its convolution, the output side's kernel)."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return block_conv(x, kernels[..., 0, :, :], self.base_kernel[0], block, self.group_size), kernels[..., 1, :, :]

    def finish(self, y: Tensor, delta: Tensor, block: int) -> Tensor:
        return block_conv(y, delta, self.base_kernel[1], block, self.group_size)


# Elements of the candidates' codebook rows [rows, K, r] held at once by `_EdgeScores` (with their fp32
# gradient rows, 192 MiB in bf16: well under the LM head's chunk of logits; 15 chunks at SmolLM2's 123k rows).
EDGE_CHUNK = 1 << 25


class _EdgeScores(torch.autograd.Function):
    """context [M, P, r], codebook S [V, r], candidates [M, K] -> [M, P, K] = context @ S[c]^T. The
    candidates' rows S[c] [m, K, r] exist one row chunk at a time and are never saved: backward's
    d context is an `embedding_bag` of them, S's gradient (each candidate's Σ_p g[m, p, k]
    context[m, p]) one fp32 `index_add_` per chunk: the frequent tokens are candidates of most rows,
    and indexing's own backward would sum their repeats one after another."""

    @staticmethod
    def forward(ctx, context: Tensor, codebook: Tensor, candidates: Tensor) -> Tensor:
        M, P, r = context.shape
        chunk = max(1, EDGE_CHUNK // (candidates.shape[1] * r))
        out = context.new_empty(M, P, candidates.shape[1])
        for s in range(0, M, chunk):
            torch.bmm(context[s:s + chunk], codebook[candidates[s:s + chunk]].transpose(1, 2), out=out[s:s + chunk])
        ctx.save_for_backward(context, codebook, candidates)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        context, codebook, candidates = ctx.saved_tensors
        (M, P, K), r = g.shape, context.shape[-1]
        g = g.to(context.dtype)
        d_context = d_codebook = None
        if ctx.needs_input_grad[0]:  # row (m, p): Σ_k g[m, p, k] S[c[m, k]]
            bags = candidates[:, None].expand(M, P, K).reshape(M * P, K)
            d_context = F.embedding_bag(bags, codebook, per_sample_weights=g.reshape(M * P, K), mode="sum").view(M, P, r)
        if ctx.needs_input_grad[1]:
            d_codebook = torch.zeros(codebook.shape, dtype=torch.float32, device=codebook.device)
            for s in range(0, M, ctx.chunk):  # [m, K, r]: each candidate's row of the gradient
                rows = torch.bmm(g[s:s + ctx.chunk].transpose(1, 2), context[s:s + ctx.chunk])
                d_codebook.index_add_(0, candidates[s:s + ctx.chunk].flatten(), rows.flatten(0, 1).float())
            d_codebook = d_codebook.to(codebook.dtype)
        return d_context, d_codebook, None


class CandidateSelector(nn.Module):
    """Edge scores over the unary head's top-K: score(p -> c | h) = unary[c] + <P[p] * W h, S[c]>,
    P and S codebooks of rank r over the vocabulary, W a projection of the slot's hidden state."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, std: float = 0.02) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters(std)

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    def forward(self, hidden: Tensor, predecessors: Tensor, candidates: Tensor) -> Tensor:
        """The transition scores <P[p] * W h, S[c]>: hidden [..., H], predecessors [..., P] (token
        ids), candidates [..., K] (token ids) -> [..., P, K]: every predecessor against every candidate
        of the same slot (training: P = 1, the gold token before; decoding: the previous slot's K)."""
        # An embedding's backward sums a token's repeats in parallel (advanced indexing's runs them one by one).
        pred = F.embedding(predecessors.long(), self.predecessor_codebook)  # [..., P, r]
        context = pred * self.hidden_projection(hidden).unsqueeze(-2).to(pred.dtype)
        lead = context.shape[:-2]
        scores = _EdgeScores.apply(context.flatten(0, -3) if lead else context[None], self.successor_codebook,
                                   candidates.long().flatten(0, -2) if lead else candidates.long()[None])
        return scores.view(*lead, *scores.shape[-2:])

    def scores(self, unary: Tensor, hidden: Tensor, predecessors: Tensor, candidates: Tensor) -> Tensor:
        """The edge scores (fp32) that the selector's K-way choice is over: each candidate's unary
        logit unary [..., K] plus its transition score from each predecessor -> [..., P, K]."""
        return unary.float().unsqueeze(-2) + self(hidden, predecessors, candidates).float()

    def lattice(self, hidden: Tensor, unary: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        """Decoding's lattice over a drafted block (`decode.tree.Lattice`): hidden [b, S, H] and unary
        logits [b, S, V] of the drafting slots, first [b] the token before slot 1 (the bonus) ->
        (each slot's unary top-K candidates [b, S, K], log-probs [b, S, K, K]: row p of slot s over
        slot s's candidates after candidate p of slot s-1, slot 0's rows all after `first`). The
        predecessors are training's (`objective.block_predecessors`: the token before each slot),
        here every candidate of the slot before."""
        top, cand = unary.topk(self.top_k, dim=-1)  # [b, S, K]
        preds = torch.cat([first[:, None, None].expand(-1, 1, self.top_k), cand[:, :-1]], 1)  # [b, S, K]
        return cand, torch.log_softmax(self.scores(top, hidden, preds, cand), -1)


class MarkovHead(nn.Module):
    """A logit bias on each block position from the token before it: W2 W1[prev] (`vanilla`),
    gated by the position's hidden state (`gated`), or read from a small recurrent state carried
    along the block (`rnn`)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W1 small, W2 zero: a fresh head biases nothing, so a DSpark drafter made from a DFlash
        drafter drafts as it did."""
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: Tensor) -> Tensor:
        return self.markov_w1(prev.long())

    def step(self, emb: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One position: emb [..., r] of the token before, hidden [..., H], the recurrent state
        (`rnn` only; None at a block's first position) -> (the bias's low-rank input [..., r], the
        state after)."""
        if self.kind == "vanilla":
            return emb, None
        hidden = hidden.to(emb.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], -1))) * emb, None
        state = emb.new_zeros(emb.shape) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return torch.tanh(out), state

    def block_inputs(self, emb: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced: emb [n, B, r], hidden [n, B, H] -> the bias's low-rank inputs [n, B, r]
        (a loop over the block's positions for `rnn` only)."""
        if self.kind != "rnn":
            return self.step(emb, hidden, None)[0]
        state, outs = None, []
        for k in range(emb.shape[1]):
            out, state = self.step(emb[:, k], hidden[:, k], state)
            outs.append(out)
        return torch.stack(outs, 1)

    def bias(self, low_rank: Tensor) -> Tensor:
        return self.markov_w2(low_rank)

    def forward(self, prev: Tensor, hidden: Tensor, head: Callable[[Tensor, Tensor, Tensor], T]) -> T:
        """Teacher-forced blocks: prev [n, B] (the token before each position), hidden [n, B, H] ->
        head(u [n, B, r] the bias's low-rank inputs, the embedding of prev [n, B, r], W2 [V, r]).
        The head runs inside this forward so that it sees the module's gathered weights where FSDP2
        shards it (W2's gradient comes back through `head`'s autograd)."""
        emb = self.embed(prev)
        return head(self.block_inputs(emb, hidden), emb, self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """A position's acceptance probability, as a logit, from its hidden state (and the Markov
    embedding of the token before it)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)
