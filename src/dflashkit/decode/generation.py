"""What a generation is, independent of how it is decoded: the leaf of the decoding package.

`Sampling` (the request's settings), `target_tokens` (the target's token at each verified
position: argmax or a sample of its own distribution), `Generation` (tokens, τ per round,
timings), `GenerationChunk` and the `Generator` protocols that the server speaks. Nothing here
imports the rest of dflashkit, so the server, the loop and the engines can all depend on it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def distribution(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor = 1.0) -> Tensor:
    """logits [..., V] -> the sampling distribution [..., V] (fp32): softmax at `temperature`,
    then, where top_p < 1, only the smallest prefix of the sorted tokens whose mass reaches
    top_p, renormalised. temperature and top_p: one value, or one per row broadcast against
    logits[..., :1]. The one definition of the target's and the drafter's distributions, so that
    speculative sampling and autoregressive sampling agree token for token."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if isinstance(top_p, Tensor) or top_p < 1:
        p, idx = probs.sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= top_p  # keep the smallest prefix whose mass reaches top_p
        kept = p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, kept / kept.sum(-1, keepdim=True))
    return probs


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """probs [n, V] (non-negative, not necessarily normalised), u [n] (float64 in [0, 1)) -> one
    token per row: the first token whose cumulative probability exceeds u times the row's mass.
    One batched search, not a loop over rows."""
    cdf = probs.double().cumsum(-1)
    # right=True: a token of probability 0 (cut by top-p) is never the first to exceed the draw
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)


def target_tokens(logits: Tensor, sampling: Sampling, u: Tensor | None) -> Tensor:
    """logits [n, V] -> [n]: the argmax, or one sample per row from the target's own
    (temperature, top-p) `distribution`. Autoregressive decoding uses the same function, so
    speculative and plain decoding sample from the same distribution. u [n] (float64 in [0, 1),
    when sampling): each row's uniform draw, from its sequence's own stream (`new_generator`)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    assert u is not None
    return draw(distribution(logits, sampling.temperature, sampling.top_p), u)


def new_generator(sampling: Sampling) -> random.Random | None:
    """The random stream of one sequence (None when greedy); an unset seed draws a fresh one. A
    host stream: a round's draws for a whole batch are a few hundred host calls and one copy,
    where a device generator per sequence costs a kernel launch per sequence."""
    if sampling.temperature == 0:
        return None
    return random.Random(None if sampling.seed is None else sampling.seed % 2**64)  # (-1 is not 1)


@dataclass
class Generation:
    tokens: list[int]  # new tokens; a stop token that ended generation is included
    accept_lengths: list[int]  # τ per round
    finish_reason: str  # "" while running, then "stop" | "length"
    prompt_tokens: int
    prefill_seconds: float  # time to the first token (device synchronised)
    decode_seconds: float  # rounds only (after the first token)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # filled when profiling
    draft_sizes: list[int] = field(default_factory=list)  # cost-aware: draft tokens verified per round
    # When recorded (`decode_stream(record_top=k)`): per output token, the target's top-k token ids
    # and logits in the pass that chose it (the evaluation's check of greedy partings).
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)

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
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens), "rounds": self.rounds,
               "tau": round(self.tau, 4), "prefill_seconds": round(self.prefill_seconds, 4),
               "decode_seconds": round(self.decode_seconds, 4), "finish_reason": self.finish_reason}
        if self.draft_sizes:
            out["mean_draft_size"] = round(sum(self.draft_sizes) / len(self.draft_sizes), 2)
        return out


def usage_stats(g: Generation, label: str | None) -> dict[str, Any]:
    """What a finished request adds to the server's usage block; `label` (the decoding method)
    adds the acceptance statistics of speculative decoding."""
    spec = {} if label is None else {"decoding": label, "rounds": g.rounds, "tau": round(g.tau, 4),
                                     "accepted_draft_tokens": sum(g.accept_lengths) - g.rounds}
    if label is not None and g.draft_sizes:  # cost-aware: draft tokens verified per round (0: no draft)
        spec["mean_draft_size"] = round(sum(g.draft_sizes) / len(g.draft_sizes), 3)
    return {**spec, "time_to_first_token_s": round(g.prefill_seconds, 4),
            "decode_tokens_per_s": round((len(g.tokens) - 1) / g.decode_seconds, 2) if g.decode_seconds > 0 else None}


@dataclass
class GenerationChunk:
    token_ids: list[int]  # new tokens (a stop token, if any, is the last one of the last chunk)
    finish_reason: Literal["stop", "length"] | None = None  # set on the last chunk only
    stats: dict[str, Any] = field(default_factory=dict)  # last chunk: merged into the usage block


class Generator(Protocol):
    def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: set[int], seed: int | None) -> Iterator[GenerationChunk]: ...


class BatchedGenerator(Generator, Protocol):
    def generate_batch(self, requests: list[tuple[list[int], dict[str, Any]]], cancelled: Callable[[int], bool],
                       admit: Callable[[int], list[tuple[list[int], dict[str, Any]]]] | None = None,
                       ) -> Iterator[list[tuple[int, GenerationChunk]]]:
        """(input ids, `generate` keyword arguments) per request -> per round (request index, chunk).
        admit(rows running), called between rounds, returns requests that join the batch, their
        indices following on."""
