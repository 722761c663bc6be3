"""The engine: the target (+ drafter) state of b sequences, and the four steps of a round.

    prefill(prompts)            -> the target's logits at each row's last prompt token [b, V]
    draft(bonus)                -> the drafter's logits for the B-1 positions after each bonus [b, B-1, V]
                                   (a DFlash 2 drafter's lattice over them) and each row's tree
    verify(tokens, depths, anc) -> the target's logits at each verified node [b, q, V]
    commit(paths)               keeps each row's accepted path (the one rollback, `KVCache.commit`)
    commit_walk(walk) + settle  the same from the acceptance walk on the device, the host's
                                lengths told later (a round's commit in `decode_stream`)

Rows are ragged: each has its own length in the caches (`decode/cache.py`) and, in a round, its
own tree (padded to the batch's largest; padding nodes see only themselves and are never
committed). Engines differ only in how they run the target's layers, a `Runner`:
`HFRunner` (here) runs any Transformers causal LM through its own forward with our cache behind
Transformers' `Cache` interface and the tree rule as a 4-D mask; `decode/static.py` runs its own
layers over the same cache, with CUDA graphs on GPU. The drafter is the one `drafter.py` module
in both, its context in a second `KVCache`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflashkit.decode.accept import Steps
from dflashkit.decode.cache import KVCache, LinearState, drafter_cache, is_chain, to_device
from dflashkit.decode.markov import MarkovDraft, kind_draft, markov_trees
from dflashkit.decode.tree import Lattice, Trees, Walk, causal, draft_trees, verification, visibility
from dflashkit.drafter import DFlashDrafter, draft_step, write_context
from dflashkit.kernels.packed import lm_head
from dflashkit.method import TOP_K
from dflashkit.target import Target

PREFILL_CHUNK = 2048  # prompt tokens per prefill pass: bounds the mask to [chunk, length]
LENGTH_BUCKET = 64  # prompt lengths of small passes are padded to a multiple of this (`Engine.small_pass`)


DRAFT_CHECK_TOLERANCE = 0.1  # `Engine._checked_draft`: bf16 rounding gives ~1e-2, a wrong cache slot ~1


def _relative_error(a: Tensor, b: Tensor) -> float:
    b = b.float()
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-12)).item()


def small(rows: int, length: int, small_pass: int) -> bool:
    """Whether a pass of `rows` x `length` tokens is a small one: a bucket's length, at most
    `small_pass` tokens in all (a CUDA graph per bucket serves it)."""
    return length % LENGTH_BUCKET == 0 and rows * length <= small_pass


def bucket(length: int, geometric: bool = False) -> int:
    """`length` rounded up to a multiple of LENGTH_BUCKET, or (geometric) to LENGTH_BUCKET times a
    power of two: fewer shapes, so that every one can be captured ahead of time (joins)."""
    if geometric:
        return LENGTH_BUCKET << max(0, -(-length // LENGTH_BUCKET) - 1).bit_length()
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


def padded(rows: int, length: int, small_pass: int, geometric: bool = False) -> int:
    """The length a pass over `rows` x `length` tokens runs at: rounded up to its `bucket` when
    that makes it `small`, else as it is. Padding tokens sit past each row's length: never
    committed or seen."""
    bucketed = bucket(length, geometric)
    return bucketed if small(rows, bucketed, small_pass) else length


def widened(feats: Tensor, width: int) -> Tensor:
    """feats [b, c, F] padded with zeros to [b, width, F] (padding rows land past each row's
    context and are never seen)."""
    b, c, f = feats.shape
    return feats if width <= c else torch.cat([feats, feats.new_zeros(b, width - c, f)], 1)


def attention_backends(graph: bool = False) -> Any:
    """The SDPA backends of a decoding pass. cuDNN's attention builds an execution plan for each
    new input shape (milliseconds per layer on an H200), and outside CUDA graphs shapes are new
    all the time (prefills and joins of any length, verification over a growing cache): there it
    is left out. Inside a graph, captured once per shape, it is the fastest measured: graph
    captures (`static.Graphs`) allow it (docs/benchmarks.md, Decoding)."""
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends + [SDPBackend.CUDNN_ATTENTION] if graph else backends)


def _passes(fn: Callable) -> Callable:
    """An engine step that runs model passes: no grad, `attention_backends()`."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), attention_backends():
            return fn(*args, **kwargs)
    return run


class Draft(NamedTuple):
    """A draft round: the drafter's logits [b, B-1, V], each row's tree and what the target
    verifies of it (`tree.verification`: tokens, depths [b, q], ancestors [b, q, q]); a DFlash 2
    drafter's `Lattice`, which its trees come from (None: the logits')."""

    logits: Tensor
    trees: Trees
    tokens: Tensor
    depths: Tensor
    ancestors: Tensor
    lattice: Lattice | MarkovDraft | None = None  # (a DSpark drafter's Markov draft)

    def retokened(self, trees: Trees) -> Draft:
        """The same draft over other tokens of the same trees (the rejection rule's draws)."""
        return self._replace(trees=trees, tokens=torch.cat([self.tokens[:, :1], trees.tokens], 1))


class Runner(Protocol):
    def __call__(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int,
                 commit: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run the target's layers over tokens [b, q] written into `cache` at slots
        lengths + j, positions lengths + depths [b, q], under `tree.visibility` (ancestors bool
        [b, q, q]) over the first n slots. -> (hidden after the final norm [b, q, H], tapped
        features [b, q, n_taps * H]). commit [b] (a prefill's chain): the first commit[i]
        tokens of row i are kept; state that cannot wait for `KVCache.commit` (a hybrid's
        recurrent layers over a long prompt) takes them in now."""


class _SlotCache:
    """Our cache behind Transformers' `Cache.update`: each attention layer writes its new
    keys/values at the round's slots and attends over the first n slots (the 4-D mask hides the
    rest)."""

    def __init__(self, kv: KVCache, slots: Tensor, n: int) -> None:
        self.kv, self.slots, self.n = kv, slots, n

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.kv.write(layer_idx, key_states, value_states, self.slots)
        return self.kv.view(layer_idx, self.n)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.kv.lengths)


def _transformers_cache(kv: KVCache, slots: Tensor, n: int) -> Any:
    """A `transformers.Cache` instance (models check the type) that behaves as `_SlotCache`."""
    from transformers import Cache

    class SlotCache(_SlotCache, Cache):
        def __init__(self) -> None:
            Cache.__init__(self, layers=[])
            _SlotCache.__init__(self, kv, slots, n)

    return SlotCache()


class HFRunner:
    """Any Transformers causal LM through its own forward. The mask goes in as an additive 4-D
    mask (Transformers passes those through as they are): one per layer type when the config
    names layer types, else one for every layer (sliding in all of them when the config has a
    window but no types)."""

    def __init__(self, target: Target, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        kinds = target.layer_kinds
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{target.name}: layer types {unknown} hold recurrent state, which Transformers' "
                             "layers cannot roll back after a draft; use engine 'static' (or 'auto')")
        self.typed = bool(getattr(target.config, "layer_types", None))
        self.kinds = set(kinds)
        self.window = getattr(target.config, "sliding_window", None)

    def __call__(self, cache: KVCache, tokens: Tensor, depths: Tensor, ancestors: Tensor, n: int,
                 commit: Tensor | None = None) -> tuple[Tensor, Tensor]:
        q, dt = tokens.shape[1], self.target.dtype
        lengths = cache.lengths_t
        slots = lengths[:, None] + torch.arange(q, device=tokens.device)

        def additive(kind: str) -> Tensor:
            vis = visibility(lengths, depths, ancestors, n, self.window if kind == "sliding_attention" else None)
            return torch.zeros(vis.shape, dtype=dt, device=vis.device).masked_fill(~vis, torch.finfo(dt).min)[:, None]

        masks: Any = {k: additive(k) for k in self.kinds} if self.typed else additive(next(iter(self.kinds)))
        out = self.target.forward(tokens, self.layer_ids, position_ids=lengths[:, None] + depths, attention_mask=masks,
                                  cache=_transformers_cache(cache, slots, n), logits=False)
        return out.hidden, out.features


def new_cache(target: Target) -> KVCache:
    """The target's cache: keys/values for its attention layers and, for a hybrid, the conv and
    recurrent state of its linear-attention (Gated DeltaNet) layers."""
    kinds, cfg = target.layer_kinds, target.config
    n_linear = kinds.count("linear_attention")
    linear = None
    if n_linear:
        kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        linear = LinearState(n_linear, cfg.linear_conv_kernel_dim, 2 * kh * dk + vh * dv, vh, dk, dv, target.dtype)
    return KVCache(len(kinds) - n_linear, linear)


def ragged_cat(a: Tensor, a_counts: Sequence[int], b: Tensor, b_counts: Sequence[int]) -> tuple[Tensor, list[int]]:
    """Row-wise concatenation of ragged rows: a [n, wa, D] whose row i holds a_counts[i] items,
    then b [n, wb, D] with b_counts[i] -> [n, max(a_counts + b_counts), D] and the counts (slots
    past a row's count hold copies of its items, never read)."""
    ca = to_device(list(a_counts), a.device)[:, None]  # no wait for the device (a round without a draft queues behind)
    w = max(x + y for x, y in zip(a_counts, b_counts))
    j = torch.arange(w, device=a.device)[None]
    idx = torch.where(j < ca, j, a.shape[1] + j - ca).clamp(max=a.shape[1] + b.shape[1] - 1)
    both = torch.cat([a, b], 1)
    return both.gather(1, idx[..., None].expand(-1, -1, both.shape[2])), [x + y for x, y in zip(a_counts, b_counts)]


def round_block(drafter: DFlashDrafter | None, draft_tokens: int | None) -> int:
    """Positions of a round's draft block: 1 + `draft_tokens` (default: the drafter's whole
    block; 1 without a drafter)."""
    if drafter is None:
        if draft_tokens is not None:
            raise ValueError("draft_tokens (--draft-tokens): set without a drafter (autoregressive decoding drafts nothing)")
        return 1
    most = len(drafter.config.draft_slots)  # bonus-first: block_size - 1; anchor-first: block_size
    if draft_tokens is None:
        return most + 1
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= most:
        raise ValueError(f"draft_tokens (--draft-tokens): expected an int from 1 to {most} (the tokens a block of the "
                         f"drafter's block_size {drafter.config.block_size} drafts), got {draft_tokens!r}")
    return draft_tokens + 1


CommitStep = Callable[[Tensor, Tensor, bool, bool], None]  # `KVCache.apply`'s signature
DraftStep = Callable[..., Draft]  # `Engine._draft_step`'s


@dataclass(frozen=True)
class Parts:
    """What an engine is built from besides its target, drafter and runner; each part left None
    is the plain one. The static engine (`static.static_engine`) names them all.

    lm_head, draft_head: hidden [..., H] -> logits, the target's and the drafter's (default: the
    target's own, and a copy of it in the drafter's dtype where the dtypes differ);
    compile_draft: the draft's logits function -> its compiled form (compared once with the eager
    one, `Engine._checked_draft`); graph_draft: the eager draft step and the key its graphs are
    captured under -> the round's draft step and the one over a small context longer than a block
    (`small_pass`); graph_commit: the engine's cache -> the commit's device work (`KVCache.apply`,
    or its CUDA graphs); graph_accept: the rejection rule's eager steps -> the steps a round runs
    (`accept.Steps`, or their CUDA graphs).

    slot_bucket: drafter attention spans rounded up to this (fewer graph shapes). fixed_rows:
    finished rows stay in the batch, idle (committing nothing), instead of leaving it: with CUDA
    graphs, every new batch size would capture new graphs. small_pass: prefills and prompt-long
    first drafts of at most this many rows x tokens are padded to a length bucket and go through
    the runner / draft step as any round does (the static engine replays them from CUDA graphs);
    0: such passes run at their own length, eagerly. geometric: lengths padded to
    `bucket(geometric=True)` (a staging engine's). join_pass: joins (`join`) are prefilled in
    groups of a power of two rows of at most this many rows x tokens (lengths padded to geometric
    buckets), by a staging engine per row count whose caches persist and whose runner (`twin`)
    replays CUDA graphs; 0: a fresh engine each time, eagerly."""

    lm_head: Callable[[Tensor], Tensor] | None = None
    draft_head: Callable[[Tensor], Tensor] | None = None
    compile_draft: Callable[[Callable[..., Tensor]], Callable[..., Tensor]] | None = None
    graph_draft: Callable[[DraftStep, Callable[[], Any]], tuple[DraftStep, DraftStep]] | None = None
    graph_commit: Callable[[KVCache], CommitStep] | None = None
    graph_accept: Callable[[Steps], Steps] | None = None
    slot_bucket: int = 1
    fixed_rows: bool = False
    small_pass: int = 0
    geometric: bool = False
    join_pass: int = 0


class Engine:
    """b sequences of one target (and drafter). Lengths are kept on the host too (exact, or a
    round late with an upper bound, `KVCache.bound`), so a round needs one device-to-host
    transfer: its accepted paths and tokens, which may arrive after the next round is queued."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, runner: Runner | None = None,
                 draft_tokens: int | None = None, parts: Parts = Parts(), confidence: bool = True) -> None:
        self.target, self.drafter = target, drafter
        # Whether a drafter's confidence head (DSpark's) scores its drafts, the chance that the
        # target accepts a path that cost-aware drafting reads; False: its probabilities do, as for
        # the other kinds (a benchmark's baseline for the head, bench_batch's '+cost').
        self.confidence = confidence
        # Positions a draft block holds, the bonus included: the drafter's block, or fewer
        # (`draft_tokens`): a shorter draft costs less to make and to verify, and where a round's
        # cost grows with its tokens (a GPU from batch 32) that outweighs the acceptance it gives
        # up (docs/serving.md, Draft length).
        self.block = round_block(drafter, draft_tokens)
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else [target.num_layers - 1]
        self.run = runner or HFRunner(target, self.layer_ids)
        self.cache = new_cache(target)
        self.dcache = drafter_cache(drafter) if drafter is not None else None
        self.lm_head = parts.lm_head or target.lm_head
        # A drafter may run in another dtype than the target (bf16 on a CPU with bf16 matrix units,
        # `make_engine`): its inputs are cast, and its LM head is a copy of the target's in its dtype.
        self.draft_dtype = target.dtype if drafter is None else next(drafter.parameters()).dtype
        self.draft_head = None if self.draft_dtype == target.dtype else parts.draft_head or lm_head(target, self.draft_dtype)
        self.draft_logits = parts.compile_draft(self._draft_logits) if parts.compile_draft else self._draft_logits
        self.unchecked_draft = parts.compile_draft is not None  # compiled, not yet compared with the eager step
        self.draft_step, self.long_draft_step = self._draft_step, self._draft_step
        if parts.graph_draft is not None and drafter is not None:
            self.draft_step, self.long_draft_step = parts.graph_draft(self._draft_step, lambda: self.dcache.k.data_ptr())
        self.commit_step = parts.graph_commit(self.cache) if parts.graph_commit else self.cache.apply
        self.accept_steps = parts.graph_accept(Steps()) if parts.graph_accept else Steps()
        self.slot_bucket, self.fixed_rows, self.small_pass = parts.slot_bucket, parts.fixed_rows, parts.small_pass
        self.geometric, self.join_pass = parts.geometric, parts.join_pass
        self.caught_up = False  # the last draft took a long context (see `draft`)
        self.cost_state: dict = {}  # cost-aware decoding's `cost.Sizing` per method and batch size
        self.stagings: dict[int, Engine] = {}
        self.eager_joins = 0  # join groups prefilled eagerly on a fresh engine (no staging here, or a prompt too long)
        self.late: collections.deque[tuple[Tensor, int]] = collections.deque()  # `commit_walk`s not settled yet

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def check_prompts(self, prompts: Sequence[Tensor]) -> None:
        limit = self.target.max_positions
        for i, p in enumerate(prompts):
            if not len(p):
                raise ValueError(f"prompt {i} is empty")
            if limit and len(p) >= limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens, but {self.target.name} has {limit} positions "
                                 f"(max_position_embeddings): at most {limit - 1} prompt tokens leave room for an answer")

    @_passes
    def prefill(self, prompts: Sequence[Tensor], capacity: int) -> Tensor:
        """prompts: b x [T_i] -> logits at each row's last prompt token [b, V]. The caches make room
        for `capacity` positions per row (they grow if a round needs more)."""
        self.check_prompts(prompts)
        dev, b = self.target.device, len(prompts)
        lens = [len(p) for p in prompts]
        T = padded(b, max(lens), self.small_pass, self.geometric)
        # Right padding beyond each row's length; one transfer for every row (prompts joining a
        # batch are prefilled together: no per-row copies or host syncs).
        ids = torch.nn.utils.rnn.pad_sequence([*prompts, prompts[0].new_zeros(T)], batch_first=True)[:b]  # to T
        ids = ids.to(dev, torch.long)
        ends = torch.tensor(lens, device=dev) - 1  # each row's last prompt token
        self.cache.start(b, dev)
        if self.dcache is not None:
            self.dcache.start(b, dev)
        self.reserve(max(capacity, T))
        last, feats = None, []
        for off in range(0, T, PREFILL_CHUNK):
            q = min(PREFILL_CHUNK, T - off)
            depths = torch.arange(q, device=dev).expand(b, -1)
            counts = [min(max(n - off, 0), q) for n in lens]
            hidden, f = self.run(self.cache, ids[:, off:off + q], depths, causal(b, q, dev), max(self.cache.lengths) + q,
                                 torch.tensor(counts, device=dev))
            feats.append(f)
            # The hidden state at each row's last token, from the chunk that holds it (one gather
            # for every row, no per-row indexing).
            at = (ends - off).clamp(0, q - 1)[:, None, None].expand(-1, 1, hidden.shape[2])
            here = hidden.gather(1, at)[:, 0]
            last = here if last is None else torch.where(((ends >= off) & (ends < off + q))[:, None], here, last)
            self.cache.advance(counts)
        self.pending, self.pending_counts, self.pending_read = torch.cat(feats, 1), lens, False
        return self.lm_head(last)

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` positions per row in the caches (the drafter's: a block more). They
        only grow; a cache that grows moves its buffers, and a graph engine then captures every
        round's graphs again (`static.Graphs`)."""
        self.cache.reserve(capacity)
        if self.dcache is not None:
            self.dcache.reserve(capacity + self.block)

    def _draft_logits(self, feats: Tensor, bonus: Tensor, ctx_start: Tensor, start: Tensor, n: int
                      ) -> tuple[Tensor, Tensor]:
        """The drafter's pass -> the hidden states of the block's slots [b, S or S + 1, H] and the
        logits [b, S, V] of its S drafting slots (`DrafterConfig.draft_slots`: S = block - 1 either
        way; bonus-first, slot 0 drafts nothing)."""
        # Anchor-first (slot k drafts position start + k + 1): a pass of one position fewer, every slot drafting.
        a = int(self.drafter.config.sample_from_anchor)
        h = draft_step(self.drafter, self._draft_embed, self.dcache, feats.to(self.draft_dtype), bonus, ctx_start,
                       start, n, self.block - a)
        return h, (self.draft_head or self.lm_head)(h[:, 1 - a:])

    def _draft_embed(self, ids: Tensor) -> Tensor:
        return self.target.embed(ids).to(self.draft_dtype)  # (the same tensor where the dtypes agree)

    def _draft_step(self, feats: Tensor, bonus: Tensor, ctx_start: Tensor, start: Tensor, n: int,
                    budget: int | None, top_k: int | None, scored: bool) -> Draft:
        block, logits = self.draft_logits(feats, bonus, ctx_start, start, n)
        extra = kind_draft(self.drafter, block, logits, bonus, self.confidence)
        if isinstance(extra, MarkovDraft):  # DSpark: each slot's logits after the token drafted before it
            trees = markov_trees(extra, budget, top_k)
            return Draft(logits, trees, *verification(bonus, trees, chain=budget is None), extra)
        return Draft(logits, *draft_trees(logits, bonus, budget, top_k, scored, extra), extra)

    @_passes
    def draft(self, bonus: Tensor, budget: int | None = None, top_k: int | None = TOP_K, scored: bool = False) -> Draft:
        """bonus [b] at positions `lengths` -> the drafter's logits [b, B-1, V] for the next B-1
        positions and each row's tree from them (`tree.draft_trees`: budget None, DFlash's chain;
        else DDTree's best-first tree; a drafter with a candidate selector, DFlash 2, drafts both
        over its lattice), built in the same step (one CUDA graph)."""
        B, dc = self.block, self.dcache
        # A round's new context (at most a block per row), or a long one: the prompt's, or what
        # rounds without a draft left.
        feats, self.pending_read = self.pending, True
        b, c = feats.shape[:2]
        self.caught_up = c > B
        # Padding rows land past each row's block (`draft_step`), where no query looks and later
        # contexts overwrite them: one shape every round, few for long contexts.
        width = B if c <= B else padded(b, c, self.small_pass, self.geometric)
        feats = widened(feats, width)
        dc.reserve(max(self.cache.bound, dc.bound + width) + B)
        n = dc.span(self.cache.bound + B, self.slot_bucket)
        args = (feats, bonus, dc.lengths_t, self.cache.lengths_t, n, budget, top_k, scored)
        step = self.draft_step if c <= B else self.long_draft_step if small(b, width, self.small_pass) else None
        if step is not None and dc.k is not None:  # (buffers are allocated outside any graph)
            out = self._checked_draft(step, args, n) if self.unchecked_draft else step(*args)
        else:  # eagerly, uncompiled: a long shape that seldom comes again must not compile mid-serving
            with torch.compiler.set_stance("force_eager"):
                out = self._draft_step(*args)
        if isinstance(self.pending_counts, Tensor):  # a round committed on the device, not read yet
            dc.advance_late(self.pending_counts, feats.shape[1])
        else:
            dc.advance(self.pending_counts)
        return out

    def _checked_draft(self, step: Callable[..., Draft], args: tuple, n: int) -> Draft:
        """`step(*args)`, the compiled draft step, compared once with the same step run eagerly
        from the same state: its logits and the drafter's cache over the n slots attended must
        agree within rounding (relative error at most `DRAFT_CHECK_TOLERANCE`). Decoding stays
        lossless whatever the drafter computes, so a compiler's error shows only as acceptance: an
        Inductor build (torch 2.11-2.13) that sends in-place writes into views of one buffer to the
        first layer's slots halves DFlash's τ (2.3 to 1.1) without a word."""
        dc = self.dcache
        before = dc.k[:, :, :, :n].clone(), dc.v[:, :, :, :n].clone()
        eager = self._draft_logits(*args[:5])[1].float()  # (the uncompiled function)
        written = dc.k[:, :, :, :n].clone(), dc.v[:, :, :, :n].clone()
        dc.k[:, :, :, :n], dc.v[:, :, :, :n] = before
        out = step(*args)
        errors = {"logits": _relative_error(out.logits, eager), "keys": _relative_error(dc.k[:, :, :, :n], written[0]),
                  "values": _relative_error(dc.v[:, :, :, :n], written[1])}
        if max(errors.values()) > DRAFT_CHECK_TOLERANCE:
            raise RuntimeError(
                "the compiled draft step disagrees with the same step run eagerly (relative error "
                + ", ".join(f"{k} {e:.3g}" for k, e in errors.items()) + f"; at most {DRAFT_CHECK_TOLERANCE} is "
                "rounding): this torch.compile would cut acceptance, not correctness. Fix: run with "
                "`--engine static` (no compilation), or another torch version.")
        self.unchecked_draft = False
        return out

    @_passes
    def take_context(self) -> None:
        """The drafter's context cache takes the pending features (a prompt's) without drafting
        a block after them: no attention, LM head or tree, a few launches per drafter layer
        (`drafter.write_context`); padded as `draft` pads them."""
        dc, feats = self.dcache, self.pending.to(self.draft_dtype)
        width = padded(*feats.shape[:2], self.small_pass, self.geometric)
        feats = widened(feats, width)
        dc.reserve(dc.bound + width)
        write_context(self.drafter, dc, feats, dc.lengths_t[:, None] + torch.arange(width, device=feats.device))
        dc.advance(self.pending_counts)
        self.pending_read = True

    @_passes
    def verify(self, tokens: Tensor, depths: Tensor, ancestors: Tensor | None = None) -> Tensor:
        """tokens [b, q] at positions lengths + depths [b, q]; ancestors bool [b, q, q] (None: a
        chain) -> the target's logits [b, q, V]."""
        b, q = tokens.shape
        if ancestors is None:
            ancestors = causal(b, q, tokens.device)
        n = self.cache.bound + q
        self.cache.reserve(n)
        hidden, self.verified = self.run(self.cache, tokens, depths, ancestors, n)
        return self.lm_head(hidden)

    # The rollback after verification: each row keeps its accepted path in the caches (the device
    # half: `KVCache.commit_plan`), its features become the drafter's next context, and the host's
    # lengths learn each row's count (`settle`). `commit` does both halves at once from paths known
    # on the host; a drafted round (`commit_walk`) does the device half from the acceptance walk
    # and is settled when the host reads the round.

    def commit(self, paths: Sequence[Sequence[int]], context: bool = True) -> None:
        """Row i keeps the verified nodes paths[i] (root first; empty for an idle row), settled at
        once. context: False in an autoregressive stream, where no draft reads the kept features:
        the context then stays one round's, where it would grow by a round's features at every
        step (a copy of all of it each time)."""
        plan = self.cache.commit(paths, self.verified.shape[1], self.commit_step)
        new = self._kept(None if all(is_chain(p) for p in paths) else plan, max(len(p) for p in paths))
        counts = [len(p) for p in paths]
        if self.pending_read or self.drafter is None or not context:
            self.pending, self.pending_counts = new, counts
        else:  # a round without a draft (cost-aware decoding): the drafter's next context grows
            self.pending, self.pending_counts = ragged_cat(self.pending, self.pending_counts, new, counts)
        self.pending_read = False

    def commit_walk(self, walked: Walk, running: Tensor, chain: bool) -> None:
        """The device half of a drafted round's rollback: each row's accepted path as the acceptance
        walk left it on the device (rows not `running` [b] keep nothing), without a host read, so
        that the next round can be queued before this one's result reaches the host. `settle`
        must follow, once per call and in order. chain: every tree is a chain (nothing moves)."""
        q = min(walked.path.shape[1], self.block)  # a path holds at most a block of nodes
        counts = (walked.accepted + 1) * running
        plan = None
        if chain and self.cache.linear is None:  # the kept nodes are where they belong: lengths only
            self.cache.advance_late(counts, q)
        else:
            j = torch.arange(q, device=walked.path.device)
            plan = torch.cat([torch.where(j < counts[:, None], walked.path[:, :q], j), counts[:, None]], 1)
            self.cache.commit_plan(plan, not chain, self.commit_step)
        self.late.append((counts, q))
        self.pending = self._kept(None if chain else plan, q)
        self.pending_counts, self.pending_read = counts, False

    def settle(self, counts: Sequence[int]) -> None:
        """The host half of the oldest unsettled `commit_walk`: each row's path length (0 where
        idle), now read on the host."""
        mine, width = self.late.popleft()
        self.cache.settle(counts, width)
        if self.pending_counts is mine:  # no draft took these features yet: it will advance by them
            self.pending_counts = list(counts)
        else:  # a draft took them (`draft`'s `advance_late`)
            self.dcache.settle(counts, self.block)

    def _kept(self, plan: Tensor | None, q: int) -> Tensor:
        """The features of each row's first q kept nodes [b, q, F] (plan None: a chain's, where
        they are; else the plan's first q columns: each path, padded with nodes whose features are
        never read)."""
        v = self.verified
        return v[:, :q] if plan is None else v.gather(1, plan[:, :q, None].expand(-1, -1, v.shape[2]))

    def _settled(self, step: str) -> None:
        if self.late:  # rows move on the host's lengths, which miss the unsettled rounds
            raise RuntimeError(f"Engine.{step}: {len(self.late)} round(s) committed on the device are not settled")

    def _stage(self, prompts: Sequence[Tensor]) -> Engine:
        """The engine that prefills a join group (`_join_groups`: a power of two of prompts): the
        staging engine of its row count if one staging pass (`join_pass`) holds it, its caches
        and CUDA graphs persisting from join to join; else a fresh engine, eagerly (graphs are
        captured over one cache's buffers)."""
        m = len(prompts)
        heads = Parts(lm_head=self.lm_head, draft_head=self.draft_head)
        draft_tokens = self.block - 1 if self.drafter is not None else None
        if self.join_pass and small(m, bucket(max(map(len, prompts)), True), self.join_pass):
            if m not in self.stagings:
                self.stagings[m] = Engine(self.target, self.drafter, self.run.twin(self.join_pass), draft_tokens,
                                          replace(heads, small_pass=self.join_pass, geometric=True), self.confidence)
            return self.stagings[m]
        self.eager_joins += 1
        return Engine(self.target, self.drafter, getattr(self.run, "eager", self.run), draft_tokens, heads,
                      self.confidence)

    def _prefill_joining(self, prompts: Sequence[Tensor]) -> tuple[Engine, Tensor]:
        """Prefill `prompts` on their own caches (`_stage`) -> that engine, the logits at each
        prompt's last token [m, V]. With a drafter running, it takes the prompts' features now,
        over these rows only (`take_context`), so that the batch's next draft sees at most a block
        of new features per row (its CUDA graph) instead of a pass over all b rows at prompt
        length."""
        new = self._stage(prompts)
        logits = new.prefill(list(prompts), capacity=0)  # the caches of the batch make the room (`put_rows`)
        if self.dcache is not None and self.dcache.k is not None:
            new.take_context()
        if self.dcache is None or self.dcache.k is not None:  # no drafter will read them (again)
            new.pending, new.pending_counts = new.pending[:, :0], [0] * len(prompts)
        return new, logits

    def _join_groups(self, prompts: Sequence[Tensor]) -> list[range]:
        """The prompts of a join in consecutive groups that each fill one staging pass (`_stage`):
        a power of two of them, as many as fit `join_pass` tokens at their length bucket. As one
        pass, a join of 9 prompts was padded to 16 rows, which at a 512-token bucket (one prompt
        over 256 tokens) no staging pass holds: it ran eagerly on a fresh engine (about 1,200
        launches for a SmolLM2-sized target) while every running row waited, where 8 + 1 replay
        two captured graphs. A prompt too long for any staging pass goes alone, eagerly."""
        if not self.join_pass:
            return [range(len(prompts))]
        groups, i = [], 0
        while i < len(prompts):
            n = 1
            while i + 2 * n <= len(prompts) and small(2 * n, bucket(max(map(len, prompts[i:i + 2 * n])), True),
                                                      self.join_pass):
                n *= 2
            groups.append(range(i, i + n))
            i += n
        return groups

    @_passes
    def join(self, prompts: Sequence[Tensor], rows: Sequence[int], capacity: int) -> Tensor:
        """Prefill `prompts` beside the running batch and put them into rows `rows` (idle rows
        of this batch, or indices from `batch` on to append): their caches, lengths and pending
        features, as if prefilled with the others (room for `capacity` positions, as `prefill`),
        in groups that staging passes hold (`_join_groups`). -> logits at each prompt's last
        token [m, V]. Into idle rows, rounds committed on the device may still be unsettled:
        their `settle` must then count 0 for the rows taken."""
        if max(rows) >= self.batch:
            self._settled("join")
        logits = []
        for group in self._join_groups(prompts):
            new, part = self._prefill_joining([prompts[i] for i in group])
            self._take_rows(new, [rows[i] for i in group], capacity)
            logits.append(part)
        return torch.cat(logits)

    def _take_rows(self, new: Engine, rows: Sequence[int], capacity: int) -> None:
        """`join`'s second half: the rows of `new` (a joining group's prefill) become `rows` of
        this batch."""
        self.cache.put_rows(new.cache, rows)
        if self.dcache is not None:
            self.dcache.put_rows(new.dcache, rows)
        self.reserve(capacity)
        if self.pending_read:  # the batch's rows have no features left for the drafter
            self.pending_counts, self.pending_read = [0] * len(self.pending_counts), False
        w, extra = max(self.pending.shape[1], new.pending.shape[1]), self.batch - len(self.pending_counts)
        pending = self.pending.new_zeros(self.batch, w, self.pending.shape[2])
        pending[:len(self.pending_counts), :self.pending.shape[1]] = self.pending
        idx = torch.tensor(list(rows), device=pending.device)
        pending[idx, :new.pending.shape[1]] = new.pending[:len(rows)]
        self.pending = pending
        if isinstance(self.pending_counts, Tensor):  # an unsettled round's, on the device: changed in
            self.pending_counts[idx] = to_device(new.pending_counts[:len(rows)], idx.device)  # place (`settle`)
        else:
            self.pending_counts = self.pending_counts + [0] * extra
            for r, n in zip(rows, new.pending_counts):
                self.pending_counts[r] = n

    @_passes
    def warm_joins(self, rows: int) -> None:
        """Prefill, on the staging engines, a join group of every shape that joins into a batch
        of `rows` rows can take (`join_pass`, `_join_groups`: a power of two of at most `rows`
        prompts, at each length bucket that fits): on a graph engine every capture then happens here,
        before serving, not in a join that the running rows wait for. The batch is untouched.
        Longest first per row count, so that each staging cache is allocated once."""
        if not self.join_pass:
            return
        dev, m, limit = self.target.device, 1, self.target.max_positions
        while m <= rows:
            # prompts one token short of each bucket (a prompt leaves room for its answer)
            lengths = [n - 1 for n in (self.join_pass // m >> k for k in range(16))
                       if n >= LENGTH_BUCKET and bucket(n, True) == n and not (limit and n - 1 >= limit)]
            for n in lengths + lengths[:1]:  # (a staging engine's first pass allocates its caches, eagerly)
                self._prefill_joining([torch.zeros(n, dtype=torch.long, device=dev)] * m)
            m *= 2

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in `rows` (indices into the current batch)."""
        self._settled("keep_rows")
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.pending.device)
        self.cache.keep_rows(rows)
        if self.dcache is not None:
            self.dcache.keep_rows(rows)
        self.pending = self.pending[idx]
        self.pending_counts = [self.pending_counts[r] for r in rows]
