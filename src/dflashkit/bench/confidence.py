"""How sure the target is of the tokens a drafter drafts: for every drafted token a decoding round
reaches, the target's own probability of that token and whether the draft hit it
(`benchmarks/suite_confidence.py` groups them per suite)."""

from __future__ import annotations

import torch

from dflashkit.data.features import FeatureSample
from dflashkit.evaluate import offline_accepted

# Bins of the target's probability of the token it chose: edges, lowest bin first.
EDGES = (0.3, 0.5, 0.7, 0.9)
BINS = ("<0.3", "0.3-0.5", "0.5-0.7", "0.7-0.9", ">=0.9")


def conf_bin(q: float) -> int:
    return sum(q >= e for e in EDGES)


@torch.no_grad()
def drafted_tokens(target, drafter, prompt: torch.Tensor, answer: list[int]) -> tuple[list[float], list[tuple[float, bool]]]:
    """(the target's probability of each answer token given everything before it, and for every
    token that a round rooted at an answer position drafts and reaches: (that probability, hit))."""
    ids = torch.cat([prompt, torch.tensor(answer, dtype=prompt.dtype)])
    out = target.forward(ids[None].to(target.device), drafter.config.target_layer_ids)
    n, last = len(prompt), drafter.config.block_size - 1
    logits = out.logits[0, n - 1:-1].float()
    probs = logits.softmax(-1).gather(1, ids[n:, None].to(logits.device)).squeeze(1).tolist()
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[n:] = True
    acc, _ = offline_accepted(drafter, target, FeatureSample("probe", ids, mask, out.features[0]),
                              [("dflash", "dflash", None)], None)
    tokens = []
    for p, a in acc["dflash"].items():  # the block rooted at p (bonus = token p) drafts p + 1, p + 2, ...
        tokens += [(probs[p + k - n], True) for k in range(1, a + 1)]
        if a < last and p + a + 1 < len(ids):  # the first miss ends the round
            tokens.append((probs[p + a + 1 - n], False))
    return probs, tokens
