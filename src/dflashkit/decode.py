"""Speculative decoding with a DFlash drafter: linear blocks and DDTree, lossless (SPEC §2).

One round, starting with the bonus token at position `start` (the first token whose target
features are not yet in the drafter's cache):

  draft   the drafter turns the features of the tokens verified last round plus the bonus into
          per-slot distributions for positions start+1 .. start+B-1 (`draft_block`);
  tree    a best-first tree of at most `budget` nodes over prefixes scored by summed
          log-probabilities, top-K tokens per slot. DFlash is the special case of one chain
          (top-1, budget B-1); plain autoregressive decoding the case of no node at all;
  verify  one target pass over [bonus, nodes...] at positions start + depth under an
          ancestor-only mask (the whole prefix is visible);
  commit  walk from the root while the target's token at the current node (its argmax, or a
          sample from its own distribution) is a child; keep only the accepted path in the
          target's KV cache; its features are the drafter's next context, and the target's token
          at the last node is the next bonus.

Lossless: every committed token is the target's argmax (greedy) or a sample of the target's own
distribution drawn before looking at the draft ("accept while draft == target sample"), so the
output is exactly what the target alone produces. The drafter only decides how many of those
tokens one target pass yields.

τ (acceptance length) of a round = accepted draft tokens + 1 (the target's token at the end of
the path), 1 <= τ <= B. The final round counts only tokens up to the stop token or
`max_new_tokens` (named convention: it makes online τ equal offline τ from cached features).

Engines hold the caches: `HFEngine` runs any Transformers model through its own forward with a
cache we crop and compact ourselves (`target.py`); `static_engine.StaticEngine` is the fast path
for Llama/Qwen-family targets (static KV caches, CUDA graphs). Both decode one sequence;
`batch.py` decodes b prompts at once (AR and DFlash) on the Transformers path.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
from torch import Tensor

from dflashkit.drafter import DFlashDrafter, draft_block
from dflashkit.target import Target, crop_cache, select_cache

METHODS = ("ar", "dflash", "ddtree")


# ---- the draft tree -----------------------------------------------------------------------


@dataclass
class Tree:
    """Draft nodes 1..m under the root 0 (the bonus token). `parents[i-1]` is node i's parent."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> "Tree":
        """DFlash: node k (depth k) under node k-1."""
        return cls(list(tokens), list(range(len(tokens))), list(range(1, len(tokens) + 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.parents)))

    def ancestors(self) -> Tensor:
        """bool [m+1, m+1]: node i may attend to node j (j is i or an ancestor of i)."""
        lines = [[0]]  # node i's ancestors and itself; parents precede children
        for i, p in enumerate(self.parents, start=1):
            lines.append(lines[p] + [i])
        rows = [i for i, line in enumerate(lines) for _ in line]
        anc = torch.zeros(len(lines), len(lines), dtype=torch.bool)
        anc[rows, [j for line in lines for j in line]] = True  # one op: tree building stays cheap
        return anc

    def children(self) -> list[dict[int, int]]:
        kids: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (p, t) in enumerate(zip(self.parents, self.tokens), start=1):
            kids[p][t] = i
        return kids


def build_tree(logprobs: Tensor, token_ids: Tensor, budget: int) -> Tree:
    """Best-first tree from per-slot top-K (logprobs/token_ids [B-1, K], sorted descending).

    A prefix's score is the sum of its slots' log-probabilities. Popping the best candidate and
    pushing its next sibling (same slot, next rank) and its first child (next slot, rank 0)
    enumerates prefixes in exactly descending score order, so the first `budget` pops are the
    `budget` best prefixes, and each one's parent is already in the tree."""
    lp, ids = logprobs.tolist(), token_ids.tolist()
    slots, k = len(lp), len(lp[0]) if lp else 0
    tree = Tree([], [], [])
    heap = [(-lp[0][0], 0, 0, 0, 0.0)] if slots and budget > 0 else []  # (-score, parent, slot, rank, parent score)
    while heap and len(tree) < budget:
        neg, parent, slot, rank, pscore = heapq.heappop(heap)
        tree.tokens.append(ids[slot][rank])
        tree.parents.append(parent)
        tree.depths.append(slot + 1)
        node = len(tree)
        if rank + 1 < k:
            heapq.heappush(heap, (-(pscore + lp[slot][rank + 1]), parent, slot, rank + 1, pscore))
        if slot + 1 < slots:
            heapq.heappush(heap, (neg - lp[slot + 1][0], node, slot + 1, 0, -neg))
    return tree


# ---- the target's token at each node --------------------------------------------------------


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def target_tokens(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """logits [n, V] -> [n]: the argmax, or one independent sample per row from the target's own
    (temperature, top-p) distribution. The same function serves autoregressive decoding, so
    speculative and plain decoding sample from the same distribution."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        p, idx = probs.sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= sampling.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def walk(tree: Tree, tokens: list[int]) -> tuple[list[int], int]:
    """Follow the target's token (`tokens[i]` at node i) down the tree. Returns the accepted path
    (node indices, root first) and the target's token after it (the next bonus).

    Sampled decoding stays lossless: the token at node i was drawn before anyone looked at i's
    children, and reaching i depends only on its ancestors' tokens."""
    kids = tree.children()
    path = [0]
    while (nxt := kids[path[-1]].get(tokens[path[-1]])) is not None:
        path.append(nxt)
    return path, tokens[path[-1]]


def new_generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    """The random stream of one sequence (None when greedy); an unset seed draws a fresh one."""
    if sampling.temperature == 0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    return gen


# ---- engines: who holds the caches ------------------------------------------------------------


class Engine(Protocol):
    """Target (+ drafter) state of one sequence. Positions [0, length) are committed."""

    target: Target
    drafter: DFlashDrafter | None
    length: int

    def prefill(self, ids: Tensor, capacity: int) -> Tensor:
        """ids [1, T] -> logits of the last position [1, V]; room for `capacity` positions."""

    def draft(self, bonus: Tensor) -> Tensor:
        """bonus [1] at position `length` -> drafter logits [1, B-1, V] for length+1 .. length+B-1."""

    def verify(self, tokens: Tensor, depths: Tensor, ancestors: Tensor | None) -> Tensor:
        """tokens [1, t] at positions length + depths; ancestors bool [t, t] (None: a chain).
        -> target logits [1, t, V]."""

    def commit(self, path: list[int]) -> None:
        """Keep the verified nodes `path` (indices into the last verify's tokens)."""


def attention_masks(vis: Tensor, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype, window: int | None) -> Any:
    """Additive 4-D mask(s) [b, 1, q, K] for the target's own forward from `vis` bool [b, q, K]
    (Transformers passes a 4-D mask through as-is). With a sliding `window` (Qwen3-style models
    with sliding layers) a dict per layer type, the sliding one also bounded from below by
    position: q_pos [b, q], k_pos [b, K]."""
    lowest = torch.finfo(dtype).min

    def additive(v: Tensor) -> Tensor:
        return torch.zeros(v.shape, dtype=dtype, device=v.device).masked_fill(~v, lowest)[:, None]

    if window is None:
        return additive(vis)
    near = k_pos[:, None, :] > q_pos[:, :, None] - window
    return {"full_attention": additive(vis), "sliding_attention": additive(vis & near)}


class HFEngine:
    """Any Transformers causal LM through its own forward: a DynamicCache that we crop/compact
    (`crop_cache`, `select_cache`), the tree mask as a 4-D additive mask (returned as-is by
    Transformers' mask code), and the drafter's `draft_block` with its `DrafterCache`."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else [target.num_layers - 1]
        cfg = target.config
        self.sliding = {t for t in (getattr(cfg, "layer_types", None) or [])} - {"full_attention"}
        if self.sliding - {"sliding_attention"}:
            raise ValueError(f"{target.name}: layer types {sorted(self.sliding)} hold recurrent state; "
                             "a draft tree cannot be rolled back in them")
        self.window = getattr(cfg, "sliding_window", None)
        self.length = 0

    def prefill(self, ids: Tensor, capacity: int) -> Tensor:
        from transformers import DynamicCache

        # Sliding-window cache layers keep only the last window's keys and cannot be rolled back
        # by position: such models get plain full-length layers and the window in the mask.
        self.cache = DynamicCache() if self.sliding else self.target.new_cache()
        self.dcache = self.drafter.new_cache() if self.drafter is not None else None
        out = self.target.forward(ids, self.layer_ids, cache=self.cache)
        self.length, self.pending = ids.shape[1], out.features
        return out.logits[:, -1]

    def draft(self, bonus: Tensor) -> Tensor:
        h = draft_block(self.drafter, self.target.embed, self.dcache, self.pending, bonus)
        return self.target.lm_head(h[:, 1:])

    def _mask(self, depths: Tensor, ancestors: Tensor) -> Any:
        """[1, 1, t, length + t]: the prefix plus the node's ancestors (and itself)."""
        n, dev = self.length, self.target.device
        vis = torch.cat([torch.ones(len(depths), n, dtype=torch.bool), ancestors], dim=1).to(dev)
        q_pos = n + depths.to(dev)
        k_pos = torch.cat([torch.arange(n, device=dev), q_pos])
        return attention_masks(vis[None], q_pos[None], k_pos[None], self.target.dtype, self.window if self.sliding else None)

    def verify(self, tokens: Tensor, depths: Tensor, ancestors: Tensor | None) -> Tensor:
        mask = None if ancestors is None else self._mask(depths, ancestors)
        pos = (self.length + depths.to(self.target.device))[None]
        out = self.target.forward(tokens, self.layer_ids, cache=self.cache, position_ids=pos, attention_mask=mask)
        self.verified = out.features
        return out.logits

    def commit(self, path: list[int]) -> None:
        keep = torch.tensor(path, device=self.target.device)
        if path == list(range(len(path))):
            crop_cache(self.cache, self.length + len(path))
        else:
            select_cache(self.cache, self.length, keep)
        self.pending = self.verified[:, keep]
        self.length += len(path)


def make_engine(target: Target, drafter: DFlashDrafter | None, kind: str = "auto") -> Engine:
    """'hf'; 'static' (static KV caches, CUDA graphs on CUDA); or 'auto': on CUDA, for
    Llama/Qwen-family targets, static + torch.compile + fused q/k/v and gate/up weights (the
    fastest measured, docs/benchmarks.md), else hf."""
    from dflashkit import static_engine

    if kind not in ("auto", "hf", "static"):
        raise ValueError(f"engine: expected 'auto', 'hf' or 'static', got {kind!r}")
    if kind == "auto" and target.device.type == "cuda" and static_engine.supported(target) is None:
        return static_engine.StaticEngine(target, drafter, compile=True)
    if kind == "static":
        return static_engine.StaticEngine(target, drafter)
    return HFEngine(target, drafter)


# ---- the loop -----------------------------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]  # new tokens; a stop token that ended generation is included
    accept_lengths: list[int]  # τ per round
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float  # rounds only (after the first token)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # filled when profiling

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    def extend(self, new: list[int], max_new_tokens: int, stop_ids: set[int] | frozenset[int]) -> list[int]:
        """Append `new` up to the first stop token (included) or the token limit, setting
        `finish_reason` when either is reached; returns what was appended."""
        for i, t in enumerate(new):
            if t in stop_ids or len(self.tokens) + i + 1 >= max_new_tokens:
                new, self.finish_reason = new[:i + 1], "stop" if t in stop_ids else "length"
                break
        self.tokens += new
        return new

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.rounds)

    def stats(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens), "rounds": self.rounds,
                "tau": round(self.tau, 4), "prefill_seconds": round(self.prefill_seconds, 4),
                "decode_seconds": round(self.decode_seconds, 4), "finish_reason": self.finish_reason}


class _Stages:
    """Wall time per stage; synchronises CUDA at each boundary so that the times are honest."""

    def __init__(self, on: bool, device: torch.device) -> None:
        self.on, self.cuda = on, device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.t = 0.0

    def start(self) -> None:
        if self.on:
            if self.cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.on:
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.seconds[stage] += now - self.t
            self.t = now


def check_request(method: str, max_new_tokens: int, drafter: DFlashDrafter | None) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter; use method 'ar' without one")


def generate(engine: Engine, prompt_ids: Tensor, **kw: Any) -> Generation:
    """Run `generate_stream` to the end; returns the finished `Generation`."""
    g = None
    for _, g in generate_stream(engine, prompt_ids, **kw):
        pass
    return g


@torch.no_grad()
def generate_stream(
    engine: Engine,
    prompt_ids: Tensor,  # [1, T]
    *,
    max_new_tokens: int,
    method: str = "dflash",
    budget: int | None = None,
    top_k: int = 4,
    sampling: Sampling | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    profile: bool = False,
) -> Iterator[tuple[list[int], Generation]]:
    """Generate up to `max_new_tokens` tokens, stopping after the first stop token (included).
    Yields (newly committed tokens, the running `Generation`) after the prefill and each round.

    method: 'ar' (no drafter), 'dflash' (one chain of B-1 argmax tokens), 'ddtree' (a tree of
    `budget` nodes from the top-`top_k` tokens of each slot)."""
    check_request(method, max_new_tokens, engine.drafter)
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids: expected shape [1, T] (batch size 1), got {tuple(prompt_ids.shape)}")
    sampling = sampling or Sampling()
    B = engine.drafter.config.block_size if engine.drafter is not None else 1
    if method == "dflash":
        budget = B - 1
    elif method == "ddtree" and (budget is None or budget < 1):
        raise ValueError(f"ddtree needs a node budget >= 1, got {budget}")
    elif method == "ar":
        budget = 0
    dev = engine.target.device
    gen = new_generator(sampling, dev)
    stages = _Stages(profile, dev)
    chain_depths = torch.arange(B, device=dev)

    t0 = time.perf_counter()
    logits = engine.prefill(prompt_ids.to(dev), capacity=prompt_ids.shape[1] + max_new_tokens + budget + 2 * B)
    bonus = target_tokens(logits, sampling, gen)  # [1], stays on the device
    res = Generation([], [], "", prompt_ids.shape[1], time.perf_counter() - t0, 0.0)
    t1 = time.perf_counter()
    yield res.extend([int(bonus)], max_new_tokens, stop_ids), res
    while not res.finish_reason:
        stages.start()
        if method == "dflash":  # the chain's tokens stay on the device: one host sync per round
            draft = engine.draft(bonus)[0].argmax(-1)  # [B-1]
            stages.mark("draft")
            tokens, depths, anc = torch.cat([bonus, draft])[None], chain_depths, None
        elif budget:
            dlogits = engine.draft(bonus)[0].float()  # [B-1, V]
            stages.mark("draft")
            tree = build_tree(*torch.log_softmax(dlogits, -1).topk(top_k, dim=-1), budget)
            tokens = torch.cat([bonus, torch.tensor(tree.tokens, dtype=torch.long, device=dev)])[None]
            depths = torch.tensor([0, *tree.depths], device=dev)
            anc = None if tree.is_chain() else tree.ancestors()
        else:
            tree, tokens, depths, anc = Tree([], [], []), bonus[None], chain_depths[:1], None
        stages.mark("tree")
        logits = engine.verify(tokens, depths, anc)[0]
        stages.mark("verify")
        picked = target_tokens(logits, sampling, gen)  # [m+1]
        if method == "dflash":
            host = torch.cat([draft, picked]).tolist()
            tree, picked_host = Tree.chain(host[:B - 1]), host[B - 1:]
        else:
            picked_host = picked.tolist()
        path, last = walk(tree, picked_host)
        new = [tree.tokens[i - 1] for i in path[1:]] + [last]
        engine.commit(path)
        bonus = picked[path[-1]:path[-1] + 1]
        stages.mark("commit")
        new = res.extend(new, max_new_tokens, stop_ids)
        res.accept_lengths.append(len(new))
        res.decode_seconds = time.perf_counter() - t1
        res.stage_seconds = dict(stages.seconds)
        yield new, res
    if dev.type == "cuda":
        torch.cuda.synchronize()
    res.decode_seconds = time.perf_counter() - t1


class SpeculativeGenerator:
    """The `serve.Generator` of `dflashkit serve --drafter DIR`: speculative decoding behind the
    OpenAI-compatible server, one chunk per round; the acceptance statistics of the request
    (rounds, τ, accepted draft tokens) go into the response's usage block."""

    def __init__(self, target: Target, drafter: DFlashDrafter, *, method: str = "dflash", budget: int | None = None,
                 top_k: int = 4, engine: str = "auto") -> None:
        self.engine = make_engine(target, drafter, engine)
        self.method, self.budget, self.top_k = method, budget, top_k
        self.label = method if method != "ddtree" else f"ddtree-{budget}"

    def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: set[int], seed: int | None) -> Iterator[Any]:
        from dflashkit.serve import GenerationChunk

        for new, g in generate_stream(self.engine, torch.tensor([input_ids]), max_new_tokens=max_new_tokens,
                                      method=self.method, budget=self.budget, top_k=self.top_k,
                                      sampling=Sampling(temperature, top_p, seed), stop_ids=stop_ids):
            yield GenerationChunk(new, g.finish_reason, usage_stats(g, self.label)) if g.finish_reason else GenerationChunk(new)


def usage_stats(g: Generation, label: str | None) -> dict[str, Any]:
    """What a finished request adds to the server's usage block; `label` (the decoding method)
    adds the acceptance statistics of speculative decoding."""
    spec = {} if label is None else {"decoding": label, "rounds": g.rounds, "tau": round(g.tau, 4),
                                     "accepted_draft_tokens": sum(g.accept_lengths) - g.rounds}
    return {**spec, "time_to_first_token_s": round(g.prefill_seconds, 4),
            "decode_tokens_per_s": round((len(g.tokens) - 1) / g.decode_seconds, 2) if g.decode_seconds > 0 else None}


# ---- `dflashkit generate` ---------------------------------------------------------------------


def chat_ids(tokenizer: Any, prompt: str, chat: bool = True) -> Tensor:
    """[1, T] prompt ids: through the chat template (as `regenerate` prompts the target) when the
    tokenizer has one, else the raw text."""
    from dflashkit.data.chat import prompt_ids

    if chat and getattr(tokenizer, "chat_template", None):
        return torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": prompt}])])
    return tokenizer(prompt, return_tensors="pt").input_ids


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options

    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--drafter", metavar="DIR", help="reference-format drafter directory (needed unless --method ar)")
    p.add_argument("--method", choices=METHODS, default=None, help="default: dflash with a drafter, ar without")
    p.add_argument("--budget", type=int, default=32, help="DDTree node budget (default 32)")
    p.add_argument("--top-k", type=int, default=4, help="DDTree candidates per slot (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--engine", choices=("auto", "hf", "static"), default="auto")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.checkpoint import load_drafter
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.target import load_target
    from dflashkit.vocab import stop_token_ids

    method = args.method or ("dflash" if args.drafter else "ar")
    if method != "ar" and not args.drafter:
        raise ValueError(f"--method {method} needs --drafter DIR (a reference-format drafter directory)")
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    cfg = config_from_args(args)
    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype,
                         device=resolve_device(cfg.target.device))
    drafter = load_drafter(args.drafter, target, device=target.device, dtype=target.dtype) if args.drafter else None
    engine = make_engine(target, drafter if method != "ar" else None, args.engine)
    ids = chat_ids(target.tokenizer, args.prompt, chat=not args.raw)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    res = generate(engine, ids, max_new_tokens=args.max_new_tokens, method=method, budget=args.budget,
                   top_k=args.top_k, sampling=sampling, stop_ids=stops)
    print(target.tokenizer.decode(res.tokens, skip_special_tokens=True))
    s = res.stats()
    tps = len(res.tokens) / max(res.prefill_seconds + res.decode_seconds, 1e-9)
    label = method if method != "ddtree" else f"ddtree (budget {args.budget}, top-{args.top_k})"
    print(f"\n[{label}] {s['completion_tokens']} tokens in {s['rounds']} rounds, tau {s['tau']:.2f}, "
          f"{tps:.1f} tokens/s, prefill {s['prefill_seconds']:.2f}s, finish: {s['finish_reason']}")
    return 0
