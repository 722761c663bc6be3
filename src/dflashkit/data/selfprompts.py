"""Prompts written by the target itself (`data.prompts: self:N`).

The target's chat template is opened at a user turn (everything the template writes before a
user's message) and the target samples the message, as in the Magpie method: an instruction-tuned
model writes requests in the style and spread of those it was tuned on, which templates cannot
imitate. Openers (the start of a message, from ``assets/self_prompts.yaml``) steer the topic per
category; a two-turn category gets a first message, the target's greedy answer to it and a
follow-up message. Messages still open after the sampling limit, empty or repeated ones, and any
that come near an evaluation prompt (``near_eval``) are dropped and written again.

Deterministic for a given target and seed: every message samples from its own random stream. Given
a directory (`keep`), the writer saves its progress there, and a stopped job resumes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import logging
import time

import torch
import yaml

from dflashkit.checkpoint import atomic_write_bytes
from dflashkit.data.chat import encode, render
from dflashkit.data.prompts import Conversation
from dflashkit.data.trainset import interleave, quotas
from dflashkit.progress import progress

log = logging.getLogger(__name__)

SEED = 20261203
ROUNDS = 8  # passes over the missing prompts before giving up
# A pass drafts what is missing times a factor: 1.05 at first (SmolLM2 wrote 91-96 % usable messages,
# and a message that finds its category full was written for nothing: at 1.3x, a fifth of them), then
# 1.1 over the share usable in the pass before, at most 4x.
FIRST_FACTOR, MARGIN, MAX_FACTOR = 1.05, 1.1, 4.0
_SENTINEL = "\x00dflashkit-user-message\x00"


def spec_path() -> Path:
    return Path(str(resources.files("dflashkit") / "assets" / "self_prompts.yaml"))


def user_turn_prefix(tokenizer: Any, messages: list[dict]) -> str:
    """The template's text for `messages` followed by an opened user turn: what it writes before
    a user's message (system prompt and role header included)."""
    text = render(tokenizer, [*messages, {"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in text:
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} drops the user's message; "
                         "it cannot be opened at a user turn, so self-written prompts are not available")
    return text[:text.index(_SENTINEL)]


@dataclass(frozen=True)
class Spec:
    """A self-prompts file (`data.self_prompts`), checked."""
    text: str  # as read: names the saved progress
    sampling: dict[str, Any]  # temperature, top_p, max_new_tokens; answer_tokens (two-turn) optional
    weights: dict[str, float]  # category -> share
    openers: dict[str, list[str]]
    turns: dict[str, int]  # 1, or 2 for a conversation


def read_spec(path: Path | str | None = None) -> Spec:
    """The file `data.self_prompts` names (default: the bundled one), or a ValueError naming what is
    wrong in it; `regenerate` and `quality_run.py` read it once, before loading the target."""
    path = Path(path) if path else spec_path()
    where = f"data.self_prompts: {path}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file (expected a YAML of 'sampling', 'weights' and 'categories', "
                         f"as {spec_path()})")
    text = path.read_text(encoding="utf-8")
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not readable as YAML ({e})") from None
    try:
        sampling, weights, categories = spec["sampling"], spec["weights"], spec["categories"]
        openers = {c: categories[c]["openers"] for c in weights}
        turns = {c: categories[c].get("turns", 1) for c in weights}
        for k in ("temperature", "top_p", "max_new_tokens"):
            float(sampling[k])  # a missing or non-numeric setting fails here
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: expected 'sampling' (temperature, top_p, max_new_tokens), 'weights' and "
                         f"'categories' with 'openers' for every weighted category; missing or bad: {e}") from None
    if not isinstance(weights, dict) or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0
                                            for w in weights.values()) or not sum(weights.values()) > 0:
        raise ValueError(f"{where}: expected 'weights' to give each category a share >= 0, not all 0 (got {weights})")
    empty = [c for c, o in openers.items() if not (isinstance(o, list) and o and all(isinstance(x, str) for x in o))]
    if empty or any(t not in (1, 2) for t in turns.values()):
        raise ValueError(f"{where}: expected every category a non-empty list of 'openers' (strings; \"\" leaves the "
                         f"start to the target) and 'turns' 1 or 2 (got openers {openers}, turns {turns})")
    return Spec(text, sampling, weights, openers, turns)


def spec_for(prompts: str, path: Path | str | None) -> Spec | None:
    """`read_spec(path)` where `data.prompts` has the target write prompts (``self:N``), else None:
    called before the target loads, so that a bad file fails in seconds, not after minutes."""
    return read_spec(path) if "self:" in prompts else None


@dataclass
class _Draft:
    category: str
    opener: str
    key: str  # names the random streams of its messages
    messages: list[dict]


def writer(target: Any, batch_size: int | None = None, seed: int = 0, keep: Path | None = None,
           spec: Spec | None = None) -> Callable[[int, Callable[[str], bool]], list[Conversation]]:
    """What `data.prompts.load_prompts(writer=...)` calls for ``self:N``; spec: `read_spec(data.self_prompts)`."""
    return lambda count, near_eval: write_prompts(target, count, near_eval=near_eval, batch_size=batch_size,
                                                  seed=seed, keep=keep, spec=spec)


def progress_file(keep: Path, target: Any, count: int, seed: int, spec_text: str) -> Path:
    """Where `write_prompts(keep=...)` saves its progress: one file per target, count, seed and spec."""
    digest = hashlib.sha256(f"{getattr(target, 'name', '')}\n{spec_text}".encode()).hexdigest()[:10]
    return Path(keep) / f"self-prompts-{count}-seed{seed}-{digest}.json"


def write_prompts(target: Any, count: int, *, near_eval: Callable[[str], bool] | None = None, seed: int = 0,
                  batch_size: int | None = None, spec: Spec | None = None, keep: Path | None = None,
                  chunk: int | None = None) -> list[Conversation]:
    """`count` conversations that end with a user message written by `target`, ids
    ``self-<category>-NNNNN``, categories interleaved (any prefix covers all of them).
    spec: categories, openers and shares (`read_spec`; default: the bundled file).
    batch_size: messages written at once, a finished one's row refilled (default 256 on a GPU, 16
    on a CPU). seed: another seed writes other prompts (`data.seed`).
    keep: a directory where progress is saved (atomically) after every `chunk` drafts (default 64
    batches): an interrupted run resumes there and writes what an uninterrupted one writes, and a
    finished run's prompts are read back instead of written again. Each chunk ends with its batch
    draining (rows left idle as its last messages finish), so chunks are large."""
    spec = spec or read_spec()
    if count < 1:
        raise ValueError(f"self:{count}: expected a positive number of prompts")
    batch_size = batch_size or (256 if target.device.type == "cuda" else 16)
    saved = progress_file(keep, target, count, seed, spec.text) if keep is not None else None
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
    state = _read_progress(saved) if saved is not None and saved.is_file() else None
    if state is not None and state.get("conversations") is not None:
        log.info("self:%d: the %d prompts written earlier, read from %s", count, len(state["conversations"]), saved)
        return [Conversation(**c) for c in state["conversations"]]
    w = _Writer(target, spec, count, seed + SEED, batch_size, near_eval)
    _write_rounds(w, state, saved, chunk or 64 * batch_size)
    short = {c: w.quota[c] - len(w.made[c]) for c in w.names if len(w.made[c]) < w.quota[c]}
    if short:
        raise RuntimeError(f"self:{count}: the target wrote too few usable prompts after {ROUNDS} rounds "
                           f"(missing per category: {short}); check its chat template, or ask for fewer")
    convs = [Conversation(f"self-{c}-{i:05d}", m, "self") for i, (c, m) in enumerate(interleave(w.made, w.random), 1)]
    if saved is not None:
        _save(saved, {"conversations": [vars(c) for c in convs]})
    return convs


class _Writer:
    """The target writing user messages: its engine, the prompts kept so far per category, the
    messages seen (no duplicates) and the random stream the openers are drawn from."""

    def __init__(self, target: Any, spec: Spec, count: int, seed: int, batch_size: int,
                 near_eval: Callable[[str], bool] | None) -> None:
        from dflashkit.decode.loop import make_engine
        from dflashkit.vocab import stop_token_ids

        self.tok, self.spec, self.seed, self.batch_size, self.near_eval = target.tokenizer, spec, seed, batch_size, near_eval
        self.stops = set(stop_token_ids(self.tok, getattr(target.model, "generation_config", None)))
        self.engine = make_engine(target, None)
        self.names = list(spec.weights)
        self.quota = quotas(count, spec.weights)
        self.random = random.Random(seed)
        self.made: dict[str, list[list[dict]]] = {c: [] for c in self.names}
        self.seen: set[str] = set()
        self.tried = dict.fromkeys(self.names, 0)
        self.opening = user_turn_prefix(self.tok, [])  # what every first message follows

    def sample(self, prefixes: list[str], keys: list[str] | None) -> list[tuple[str, bool]]:
        """(text, finished) per prefix: the target's continuation up to its end of turn, sampled
        from the random stream each key names, or greedy (an answer) when `keys` is None."""
        from dflashkit.decode.generation import Sampling
        from dflashkit.decode.loop import generate_batch

        sampling = self.spec.sampling
        limit = sampling["max_new_tokens"] if keys else sampling.get("answer_tokens", 256)
        modes = [Sampling(sampling["temperature"], sampling["top_p"], seed=zlib.crc32(f"{self.seed}:{k}".encode()))
                 for k in keys] if keys else None
        gens = generate_batch(self.engine, [torch.tensor(encode(self.tok, p)) for p in prefixes], rows=self.batch_size,
                              method="ar", max_new_tokens=limit, sampling=modes, stop_ids=self.stops)
        return [(self.tok.decode(g.tokens[:-1] if g.finish_reason == "stop" else g.tokens, skip_special_tokens=True),
                 g.finish_reason == "stop") for g in gens]

    def usable(self, text: str, finished: bool, conversation: str) -> bool:
        """A finished message of 3+ words, new, and away from every evaluation prompt (then remembered)."""
        norm = re.sub(r"\s+", " ", text.strip().lower())
        if not finished or len(norm.split()) < 3 or "\ufffd" in text or norm in self.seen:
            return False
        if self.near_eval is not None and self.near_eval(conversation):
            return False
        self.seen.add(norm)
        return True

    def write(self, drafts: list[_Draft]) -> Counter[str]:
        """Write the drafts' messages; keep the usable conversations in `made` (up to each category's
        quota). Returns how many were usable per category."""
        firsts = self.sample([self.opening + d.opener for d in drafts], [f"{d.key}:1" for d in drafts])
        kept = []
        for d, (text, done) in zip(drafts, firsts):
            message = (d.opener + text).strip()
            if self.usable(message, done, message):
                d.messages = [{"role": "user", "content": message}]
                kept.append(d)
        two = [d for d in kept if self.spec.turns[d.category] == 2]
        if two:  # the target answers the first message, then writes the follow-up
            answers = self.sample([render(self.tok, d.messages, generation_prompt=True) for d in two], None)
            for d, (text, _) in zip(two, answers):
                d.messages.append({"role": "assistant", "content": text.strip()})
            follow = self.sample([user_turn_prefix(self.tok, d.messages) for d in two], [f"{d.key}:2" for d in two])
            for d, (text, done) in zip(two, follow):
                d.messages.append({"role": "user", "content": text.strip()})
                if not self.usable(text, done, "\n".join(m["content"] for m in d.messages)):
                    d.messages = []
        kept = [d for d in kept if d.messages]
        for d in kept:
            if len(self.made[d.category]) < self.quota[d.category]:
                self.made[d.category].append(d.messages)
        return Counter(d.category for d in kept)

    def drafts(self, start: dict) -> list[_Draft]:
        """What was missing when the round started, times its factor, each with an opener."""
        out = []
        for c in self.names:
            for _ in range(math.ceil(start["factor"][c] * (self.quota[c] - start["made"][c]))):
                self.tried[c] += 1
                out.append(_Draft(c, self.random.choice(self.spec.openers[c]), f"{c}:{self.tried[c]}", []))
        return out

    def written(self) -> int:
        return sum(map(len, self.made.values()))


def _write_rounds(w: _Writer, state: dict | None, saved: Path | None, chunk: int) -> None:
    """Rounds over what is missing, each drafting its factor times that (the factor learnt from the
    share of usable messages), saving progress after every chunk; `state` resumes a round."""
    first_round, resume_at, start, factor = 0, 0, None, dict.fromkeys(w.names, FIRST_FACTOR)
    if state is not None:  # the round under way when it stopped, rebuilt from that round's start
        w.made = {c: state["made"][c] for c in w.names}
        w.seen, w.tried, start = set(state["seen"]), dict(state["round_start"]["tried"]), state["round_start"]
        usable_in_round, factor = dict(state["usable"]), dict(start["factor"])
        first_round, resume_at = state["round"], state["done"]
        w.random.setstate((start["random"][0], tuple(start["random"][1]), start["random"][2]))
        log.info("self-written prompts: resuming from %s (%d written)", saved, w.written())
    bar = progress(total=sum(w.quota.values()), initial=w.written(), desc="write prompts", unit="prompt")
    t0 = time.perf_counter()
    for rnd in range(first_round, ROUNDS):
        if rnd != first_round or start is None:
            start = {"random": w.random.getstate(), "tried": dict(w.tried), "made": {c: len(w.made[c]) for c in w.names},
                     "factor": dict(factor)}
            usable_in_round = dict.fromkeys(w.names, 0)
        drafts = w.drafts(start)
        if not drafts:
            break
        for i in range(resume_at if rnd == first_round else 0, len(drafts), chunk):
            for c, n in w.write(drafts[i:i + chunk]).items():
                usable_in_round[c] += n
            bar.n = w.written()
            bar.refresh()
            if saved is not None:
                _save(saved, {"round": rnd, "done": min(i + chunk, len(drafts)), "round_start": start,
                              "usable": usable_in_round, "made": w.made, "seen": sorted(w.seen)})
        log.info("self-written prompts, round %d: %d of %d written (%d usable of %d tried), %.1f s", rnd + 1,
                 w.written(), sum(w.quota.values()), sum(usable_in_round.values()), len(drafts), time.perf_counter() - t0)
        for c in w.names:
            if w.tried[c] > start["tried"][c]:
                share = usable_in_round[c] / (w.tried[c] - start["tried"][c])
                factor[c] = min(MAX_FACTOR, MARGIN / share) if share else MAX_FACTOR
    bar.close()


def _save(path: Path, state: dict) -> None:
    # Compact, keys in the order written (a message reads back as written): the file is rewritten
    # after every chunk and holds every message so far.
    atomic_write_bytes(path, json.dumps(state, ensure_ascii=False, separators=(",", ":")).encode())


def _read_progress(path: Path) -> dict:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        state = e
    if not isinstance(state, dict) or not ("conversations" in state
                                           or {"round", "done", "round_start", "usable", "made", "seen"} <= state.keys()):
        what = state if isinstance(state, Exception) else "expected 'conversations', or a round's progress"
        raise ValueError(f"{path}: unreadable progress of self-written prompts ({what}); "
                         "delete it to write them again from the start")
    return state
