"""Offline evaluation: acceptance from cached target features, no target layers run.

For every answer position p of a cached sample the drafter sees the cached features of
positions < p and the bonus token p, and the leading draft tokens (DDTree: the deepest tree path)
that equal the data's tokens are counted. Decoding rounds are then replayed over the answer: a
round at p commits τ(p) tokens and the next one starts at p + τ(p). When the data is the target's
own greedy output (`regenerate` with temperature 0), these rounds are exactly the rounds of online
greedy decoding, so offline τ equals online τ (docs/conventions.md, mistake 8: only the embedding
and LM head are read from disk).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from dflashkit.decode.markov import MarkovDraft, kind_draft, markov_trees
from dflashkit.decode.tree import Lattice, Trees, candidates, drafted, verification, walk
from dflashkit.drafter import DFlashDrafter, training_hidden
from dflashkit.evaluate.summary import method_labels, summarize
from dflashkit.method import TOP_K
from dflashkit.objective import replay_rounds
from dflashkit.progress import progress
from dflashkit.target import Target

class FeatureItem(Protocol):
    """What offline evaluation reads per sample (`data.features.FeatureSample` is one)."""

    id: str
    input_ids: Tensor  # [T]
    loss_mask: Tensor  # [T]
    features: Tensor  # [T, n_taps * H], taps in the drafter's target_layer_ids order


def answer_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised tokens: one generated answer each."""
    m = loss_mask.bool().tolist()
    spans, start = [], None
    for i, v in enumerate(m + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


def draft_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """The answer spans that a decoding round can draft in (two tokens or more)."""
    return [(a, e) for a, e in answer_spans(loss_mask) if e - a >= 2]


@torch.no_grad()
def drafted_blocks(drafter: DFlashDrafter, head: Target, item: FeatureItem, spans: list[tuple[int, int]],
                   chunk: int = 32) -> Iterator[tuple[list[int], Tensor, Lattice | MarkovDraft | None, Tensor, Tensor]]:
    """The drafter's block at every position p of `item`'s answer spans (`draft_spans`; bonus =
    token p, context < p), `chunk` positions at a time: (positions, logits [n, S, V] of its S
    drafting slots, a DFlash 2 drafter's lattice over them or a DSpark drafter's Markov draft (else
    None), bonus tokens [n], truth [n, S + 1]: the data's token after depth d of a tree rooted at
    p, -1 past the answer, where nothing matches)."""
    B, dev = drafter.config.block_size, head.device
    first, S = drafter.config.draft_slots.start, len(drafter.config.draft_slots)
    ids = item.input_ids.long().to(dev)
    anchors = [p for a, e in spans for p in range(a, e - 1)]
    end_of = {p: e for a, e in spans for p in range(a, e - 1)}
    feats = item.features.to(device=dev, dtype=head.dtype)[None]
    for i in range(0, len(anchors), chunk):
        part = anchors[i:i + chunk]
        h = training_hidden(drafter, head.embed, ids[None], feats, torch.tensor([part], device=dev))
        block = h.view(len(part), B, -1)
        logits = head.lm_head(block[:, first:])
        at = torch.tensor(part, device=dev)
        lattice = kind_draft(drafter, block, logits, ids[at])
        pos = at[:, None] + 1 + torch.arange(S + 1, device=dev)
        ends = torch.tensor([end_of[p] for p in part], device=dev)[:, None]
        yield part, logits, lattice, ids[at], torch.where(pos < ends, ids[pos.clamp(max=len(ids) - 1)], -1)


@torch.no_grad()
def offline_accepted(drafter: DFlashDrafter, head: Target, item: FeatureItem, labels: list[tuple[str, str, int | None]],
                     top_k: int | None, chunk: int = 32) -> tuple[dict[str, dict[int, int]], list[tuple[int, int]]]:
    """Accepted draft tokens at every answer position p (bonus = token p, context < p), per method.
    Returns ({label: {p: accepted}}, spans). Positions past the answer's end never match."""
    out: dict[str, dict[int, int]] = {label: {} for label, _, _ in labels}
    spans = draft_spans(item.loss_mask)
    for part, logits, lattice, roots, truth in drafted_blocks(drafter, head, item, spans, chunk):
        # the same ops as online decoding (`tree.drafted`), the top-k taken once for every budget
        ks = [candidates(budget, top_k, logits.shape[-1]) for _, m, budget in labels if m == "ddtree"]
        top = torch.log_softmax(logits.float(), -1).topk(max(ks), dim=-1) if ks and lattice is None else None
        for label, method, budget in labels:
            chain = method == "dflash"
            trees = markov_trees(lattice, None if chain else budget, top_k) if isinstance(lattice, MarkovDraft) else \
                drafted(logits, None if chain else budget, top_k, lattice=lattice, top=top)
            out[label].update(zip(part, accepted(trees, roots, truth, chain).tolist()))
    return out, spans


def accepted(trees: Trees, roots: Tensor, truth: Tensor, chain: bool = False) -> Tensor:
    """[n] draft tokens that the data accepts of trees under roots (`drafted_blocks`' truth [n, B])."""
    _, depths, anc = verification(roots, trees, chain)
    return walk(trees, anc, truth.gather(1, depths), chain).accepted


def evaluate_offline(drafters: dict[str, DFlashDrafter], head: Target, items: Iterable[FeatureItem], *,
                     methods: Sequence[str] = ("dflash", "ddtree"), budgets: Sequence[int] = (8, 16, 32, 64),
                     top_k: int | None = TOP_K, limit: int | None = None) -> dict[str, Any]:
    labels = method_labels(methods, budgets)
    taus = {n: {lab: ([], []) for lab, _, _ in labels} for n in drafters}
    samples, tokens = 0, 0
    total = len(items) if hasattr(items, "__len__") else None
    total = min(x for x in (total, limit) if x is not None) if (total or limit) else None
    for item in progress(items, desc="offline eval", unit="sample", total=total):
        if limit is not None and samples >= limit:
            break
        samples += 1
        for name, drafter in drafters.items():
            acc, spans = offline_accepted(drafter, head, item, labels, top_k)
            for lab, _, _ in labels:
                r, p = replay_rounds(acc[lab], spans)
                taus[name][lab][0].extend(r)
                taus[name][lab][1].extend(p)
        tokens += sum(e - a for a, e in answer_spans(item.loss_mask))
    report: dict[str, Any] = {"mode": "offline", "samples": samples, "answer_tokens": tokens, "drafters": {}}
    for name, drafter in drafters.items():
        B = drafter.config.block_size
        report["drafters"][name] = {"block_size": B, "kind": drafter.config.kind, "methods": {
            lab: {**summarize(r, B), "tau_per_position": sum(p) / len(p) if p else 0.0} for lab, (r, p) in taus[name].items()}}
    return report


def heldout_items(cache: Any, eval_samples: int, seed: int) -> list[FeatureItem]:
    """The samples of `cache` that `train` holds out for tau_sim with these settings (same split,
    suite by suite when the ids carry suite labels)."""
    from dflashkit.train import sample_ids, split_eval

    return [cache[i] for i in split_eval(len(cache), eval_samples, seed, sample_ids(cache))[1]]


def _weight_file(src: str, tensor: str) -> Path:
    """The safetensors file holding `tensor`: a local directory, or (online) a hub repository."""
    local = Path(src).expanduser()

    def get(name: str) -> Path | None:
        if local.is_dir():
            return local / name if (local / name).is_file() else None
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(src, name))
        except Exception:  # absent file, or no network: reported below with what was looked for
            return None

    index = get("model.safetensors.index.json")
    name = json.loads(index.read_text())["weight_map"].get(tensor) if index else "model.safetensors"
    path = get(name) if name else None
    if path is None:
        raise FileNotFoundError(f"target {src}: no safetensors file holds {tensor} (offline evaluation reads the "
                                "embedding and LM head from the target's safetensors)")
    return path


def load_target_head(name_or_path: str | None = None, *, gguf_file: str | None = None, dtype: str = "auto",
                     device: str = "cpu") -> Target:
    """The target with only its embedding, LM head and final norm read from disk; every decoder
    layer stays on the meta device and cannot run (offline evaluation, docs/conventions.md, mistake 8)."""
    from safetensors import safe_open

    from dflashkit.target import load_target

    t = load_target(name_or_path, gguf_file=gguf_file, dtype=dtype, weights=False)
    if gguf_file or t.name.endswith(".gguf"):
        raise ValueError(f"target {t.name}: offline evaluation reads the embedding and LM head from safetensors, "
                         "which a GGUF file has not: convert it to a Transformers directory first (the default testbed is)")
    emb, head = t.model.get_input_embeddings(), t.model.get_output_embeddings()
    names: dict[int, str] = {}
    for n, p in t.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied LM head keeps the embedding's name
    tied = head.weight is emb.weight
    for module, part in [(emb, "embedding"), (t.final_norm, "final norm")] + ([] if tied else [(head, "LM head")]):
        name = names[id(module.weight)]
        path = _weight_file(t.name, name)
        with safe_open(str(path), "pt") as f:
            if name not in f.keys():
                raise ValueError(f"{path}: tensor {name} (the target's {part}) not found")
            module.weight = torch.nn.Parameter(f.get_tensor(name).to(device=device, dtype=t.dtype), requires_grad=False)
    if tied:
        head.weight = emb.weight
    return t
