"""Chat template, assistant-only loss mask and truncation: conversations -> training token ids.

The loss mask is found without generation tags (`{% generation %}`), which most templates lack.
For assistant turn `i`, the template's own rendering of `messages[:i]` with the generation prompt
is the text the target saw before it answered; the supervised span starts right after it and ends
with the answer's text. When a template rewrites earlier turns (Qwen3 drops the reasoning of past
turns), that prefix is not a prefix of the whole conversation and the answer's visible text is
searched for instead. The first token after the answer (the end-of-turn token the target emitted to
stop) is supervised too, unless the answer was cut by `max_new_tokens`.

Token ids are built piece by piece (context, answer, context, ...), each piece tokenised on its
own: the prompt piece is then exactly what `regenerate` fed the target, and no token straddles a
mask boundary. A file's pieces go to the tokenizer in blocks of conversations, one call each.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.checkpoint import atomic_write_bytes, remove_stale_temp_files, temp_path
from dflashkit.progress import progress

log = logging.getLogger(__name__)

ENCODE_BATCH = 512  # conversations whose pieces go to the tokenizer in one call


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = supervised (assistant) token


@dataclass
class TokenizeStats:
    conversations: int = 0
    written: int = 0
    truncated: int = 0  # written, but cut to max_length
    target_ids: int = 0  # answers whose ids are the target's own generated ids (not re-encoded text)
    dropped_unsupervised: int = 0  # fewer than two consecutive supervised tokens (after truncation)
    tokens: int = 0
    supervised_tokens: int = 0
    problems: list[str] = field(default_factory=list)  # malformed input records, "file:line: why"


class ChatTemplateError(ValueError):
    """A conversation whose assistant turns cannot be located in the template's rendering."""


def load_tokenizer(name_or_path: str | Path | None = None, gguf_file: str | None = None) -> Any:
    """The target's tokenizer alone (same path rules as `target.load_target`)."""
    from transformers import AutoTokenizer

    from dflashkit.testbed import resolve

    name_or_path = resolve(name_or_path)
    path = Path(str(name_or_path)).expanduser()
    if path.suffix == ".gguf" and gguf_file is None:
        path, gguf_file = path.parent, path.name
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else str(name_or_path), **kw)


def render(tokenizer: Any, messages: list[dict], *, thinking: bool = False, generation_prompt: bool = False) -> str:
    """The chat template's text; `thinking` is passed as `enable_thinking` (ignored by templates without it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         enable_thinking=thinking)


def prompt_ids(tokenizer: Any, messages: list[dict], *, thinking: bool = False) -> list[int]:
    """Token ids the target reads before answering `messages` (which end with a user turn)."""
    return encode(tokenizer, render(tokenizer, messages, thinking=thinking, generation_prompt=True))


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template writes BOS and special tokens itself, as apply_chat_template(tokenize=True) assumes.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _find_answer(text: str, content: str, start: int) -> tuple[int, int]:
    """[start, end) of the answer's text in `text` at or after `start`: the part after its
    reasoning block, as written (templates that trim it are matched trimmed); (-1, -1) if absent."""
    answer = content.split("</think>")[-1].lstrip()
    for cand in (answer, answer.rstrip()):
        a = text.find(cand, start)
        if a >= 0:
            return a, a + len(cand)
    return -1, -1


def assistant_spans(tokenizer: Any, messages: list[dict], *, thinking: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every assistant answer."""
    text = render(tokenizer, messages, thinking=thinking)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":  # step over it, so that an answer is never matched inside a prompt
            j = text.find(m["content"].strip(), cursor)
            cursor = j + len(m["content"].strip()) if j >= 0 else cursor
            continue
        prefix = render(tokenizer, messages[:i], thinking=thinking, generation_prompt=True) if i else ""
        # From the live prompt's end (keeps a reasoning block in the span); a template that renders
        # history differently from a live prompt (Qwen3 drops past reasoning) lets us start at the answer only.
        live = bool(i) and text.startswith(prefix) and len(prefix) >= cursor
        a, end = _find_answer(text, m["content"], len(prefix) if live else cursor)
        if a < 0:
            raise ChatTemplateError(f"assistant turn {i}: its text does not appear in the chat template's rendering "
                                    "(the template rewrites answers); cannot build a loss mask")
        spans.append((len(prefix) if live else a, end))
        cursor = end
    return text, spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], *, max_length: int, thinking: bool = False,
                          supervise_end: bool = True, answer_ids: list[int] | None = None,
                          id: str = "") -> TokenizedSample | None:
    """Token ids + assistant-only loss mask, cut to `max_length`; None when fewer than two
    consecutive tokens stay supervised (no anchor could be drawn from it).

    `supervise_end`: also supervise the token that follows each answer (the end-of-turn token);
    pass False when the answer was cut by a length limit, as the target never emitted it.
    `answer_ids`: the token ids the target generated for the last answer (stop token excluded);
    used instead of re-encoding its text, which gives other ids for a few percent of answers
    (the target need not emit canonical BPE merges)."""
    pieces = _pieces(tokenizer, messages, thinking=thinking, answer_ids=answer_ids)
    return _assemble(_encode_pieces(tokenizer, [pieces])[0], max_length=max_length, supervise_end=supervise_end,
                     id=id)[0]


@dataclass
class _Pieces:
    """A rendered conversation cut at its answers' bounds: context, answer, context, ... ."""
    texts: list[str]
    own_ids: list[int] | None  # the target's ids for the last answer, when they spell its text exactly


def _pieces(tokenizer: Any, messages: list[dict], *, thinking: bool, answer_ids: list[int] | None) -> _Pieces:
    text, spans = assistant_spans(tokenizer, messages, thinking=thinking)
    bounds = [0, *[x for s in spans for x in s], len(text)]
    texts = [text[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    # The generated ids, when they spell exactly the last answer's text as the template wrote it.
    exact = bool(spans) and answer_ids is not None and tokenizer.decode(answer_ids, skip_special_tokens=True) == texts[-2]
    return _Pieces(texts, list(answer_ids) if exact else None)


def _encode_pieces(tokenizer: Any, convs: list[_Pieces]) -> list[list[list[int]]]:
    """Each conversation's pieces as token ids, every piece on its own, all in one call to the
    tokenizer (a fast tokenizer encodes the batch on all cores); a last answer with `own_ids`
    takes them and is not encoded."""
    out: list[list[list[int] | None]] = [[None] * len(p.texts) for p in convs]
    for c, p in enumerate(convs):
        if p.own_ids is not None:
            out[c][-2] = p.own_ids
    todo = [(c, k) for c, p in enumerate(convs) for k, t in enumerate(p.texts) if out[c][k] is None and t]
    done = tokenizer([convs[c].texts[k] for c, k in todo], add_special_tokens=False)["input_ids"] if todo else []
    for (c, k), ids in zip(todo, done):
        out[c][k] = ids
    return [[ids or [] for ids in conv] for conv in out]


def _assemble(piece_ids: list[list[int]], *, max_length: int, supervise_end: bool,
              id: str) -> tuple[TokenizedSample | None, bool]:
    """(sample, truncated): answers supervised, contexts not, except the first token after an
    answer (its end-of-turn) when `supervise_end`."""
    ids: list[int] = []
    mask: list[int] = []
    for k, toks in enumerate(piece_ids):
        if k % 2:  # an answer
            m = [1] * len(toks)
        else:
            m = [0] * len(toks)
            if k and supervise_end and toks:
                m[0] = 1
        ids += toks
        mask += m
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(a and b for a, b in zip(mask, mask[1:])):
        return None, truncated
    return TokenizedSample(id=id, input_ids=ids, loss_mask=mask), truncated


def tokenize_file(regenerated_jsonl: str | Path, tokenizer: Any, out_jsonl: str | Path, *, max_length: int,
                  thinking: bool = False, limit: int | None = None) -> TokenizeStats:
    """Tokenise a JSONL of conversations (the output of `regenerate`, or any `messages` JSONL) into
    `out_jsonl` ({"id", "input_ids", "loss_mask"} per line), written atomically.

    Malformed lines are skipped and listed in `stats.problems` with their file and line number."""
    from dflashkit.data.prompts import load_prompts_report

    generation = _generation_info(Path(regenerated_jsonl), tokenizer)
    convs, problems = load_prompts_report(str(regenerated_jsonl), limit=limit)
    stats = TokenizeStats(conversations=len(convs), problems=problems)
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    sums = checksum_path(out)
    for name in (out.name, sums.name):
        remove_stale_temp_files(out.parent, name)  # left by a killed run
    tmp = temp_path(out)
    digest = hashlib.sha256()
    unanswered = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f, progress(total=len(convs), desc="tokenize", unit="conv") as bar:
            for start in range(0, len(convs), ENCODE_BATCH):
                block = convs[start:start + ENCODE_BATCH]
                answered = sum(c.messages[-1]["role"] == "assistant" for c in block)
                unanswered += len(block) - answered
                stats.dropped_unsupervised += len(block) - answered
                block = [c for c in block if c.messages[-1]["role"] == "assistant"]
                info = [generation.get(c.id, (None, None)) for c in block]
                pieces = [_pieces(tokenizer, c.messages, thinking=thinking, answer_ids=ids) for c, (_, ids) in zip(block, info)]
                for conv, (finish, _), p, piece_ids in zip(block, info, pieces, _encode_pieces(tokenizer, pieces)):
                    sample, truncated = _assemble(piece_ids, max_length=max_length, supervise_end=finish != "length",
                                                  id=conv.id)
                    if sample is None:
                        stats.dropped_unsupervised += 1
                        continue
                    stats.written += 1
                    stats.truncated += truncated
                    stats.target_ids += p.own_ids is not None
                    stats.tokens += len(sample.input_ids)
                    stats.supervised_tokens += sum(sample.loss_mask)
                    # vars, not asdict: asdict deep-copies every id list (40 % of this loop on a CPU)
                    line = json.dumps(vars(sample), separators=(",", ":")) + "\n"
                    digest.update(line.encode())
                    f.write(line)
                bar.update(min(ENCODE_BATCH, len(convs) - start))
        if convs and not stats.written:  # an empty output would only fail later, in training, far from its cause
            why = (f"{unanswered} end without an assistant answer (tokenize the output of `dflashkit regenerate`, "
                   "not the prompts); " if unanswered else "")
            raise ValueError(f"{regenerated_jsonl}: none of its {len(convs)} conversations gives a training sample: "
                             f"{why}{stats.dropped_unsupervised - unanswered} have fewer than two consecutive "
                             f"supervised tokens within max_length={max_length}")
        # The old sum goes first: a kill in between leaves a file without a sum, never a wrong sum.
        sums.unlink(missing_ok=True)
        os.replace(tmp, out)
        atomic_write_bytes(sums, f"{digest.hexdigest()}  {out.name}\n".encode())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return stats


def template_sha256(tokenizer: Any) -> str:
    """The chat template's hash: what renders a prompt, part of a regenerated answer's key."""
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest()


def _generation_info(path: Path, tokenizer: Any) -> dict[str, tuple[str | None, list[int] | None]]:
    """id -> (finish_reason, the answer's generated ids without the stop token) from a regenerated
    JSONL; empty for other conversation files. Generated ids must be token ids of this tokenizer:
    they are trusted only where they spell the answer's text exactly. A local answer records its
    target's chat template, which must be this tokenizer's (the prompt the target read)."""
    info: dict[str, tuple[str | None, list[int] | None]] = {}
    if not path.is_file():  # the prompt loader names what is missing
        return info
    vocab, template = len(tokenizer), template_sha256(tokenizer)
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # reported by the prompt loader
            if not isinstance(rec, dict) or "finish_reason" not in rec:
                continue
            target = rec.get("target")
            if isinstance(target, dict) and target.get("chat_template_sha256", template) != template:
                raise ValueError(f"{path}:{lineno}: answered by target {target.get('name', '?')!r}, whose chat template "
                                 "is not this tokenizer's; tokenize with the target's tokenizer (target.path)")
            ids = rec.get("completion_ids")
            if ids is not None and not _token_ids(ids, vocab):
                raise ValueError(f"{path}:{lineno}: field 'completion_ids': expected a list of token ids in "
                                 f"0..{vocab - 1} (this tokenizer's), got {str(ids)[:80]}")
            if ids is not None and rec["finish_reason"] == "stop":
                ids = ids[:-1]
            info[str(rec.get("id"))] = (rec["finish_reason"], ids)
    return info


def _token_ids(ids: Any, vocab: int | None = None) -> bool:
    """A list of token ids: ints (not booleans), >= 0 and, with `vocab`, below it."""
    return isinstance(ids, list) and all(type(t) is int and t >= 0 and (vocab is None or t < vocab) for t in ids)


def checksum_path(path: Path) -> Path:
    """Where `tokenize` records the sha256 of the file it wrote (`sha256sum` format)."""
    return path.with_name(path.name + ".sha256")


_SUM_LINE = re.compile(r"^([0-9a-f]{64})  (.+)\n?$")


def recorded_sha256(sums: Path, name: str) -> str:
    """The sha256 that `sums` (one `sha256sum` line) records for file `name`."""
    try:
        m = _SUM_LINE.match(sums.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        m = None
    if not m or m.group(2) != name:
        raise ValueError(f"{sums}: expected one line '<64 hex digits>  {name}' (a sha256sum line); it is damaged: "
                         f"tokenize again, or delete it to use {name} unchecked")
    return m.group(1)


def _sample(rec: Any) -> TokenizedSample:
    """A tokenized record, its values checked: raises ValueError naming the first bad field."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object with id, input_ids, loss_mask, got a {type(rec).__name__}")
    missing = [k for k in ("id", "input_ids", "loss_mask") if k not in rec]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ids, mask = rec["input_ids"], rec["loss_mask"]
    if not isinstance(rec["id"], (str, int)) or isinstance(rec["id"], bool):
        raise ValueError(f"field 'id': expected a string, got {rec['id']!r}")
    if not _token_ids(ids) or not ids:
        raise ValueError(f"field 'input_ids': expected a non-empty list of token ids (integers >= 0), got {str(ids)[:80]}")
    if not isinstance(mask, list) or any(type(m) is not int or m not in (0, 1) for m in mask):
        raise ValueError(f"field 'loss_mask': expected a list of 0 and 1, got {str(mask)[:80]}")
    if len(ids) != len(mask):
        raise ValueError(f"input_ids has {len(ids)} entries, loss_mask {len(mask)}")
    return TokenizedSample(id=str(rec["id"]), input_ids=ids, loss_mask=mask)


def load_tokenized(path: str | Path) -> list[TokenizedSample]:
    """Read the output of `tokenize_file`; a bad line raises with its file, line number and field,
    and a file that differs from the sha256 `tokenize` recorded beside it (`checksum_path`) is refused."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenized file {path} does not exist (run `dflashkit tokenize` first)")
    sums = checksum_path(path)
    want = recorded_sha256(sums, path.name) if sums.is_file() else None
    digest = hashlib.sha256()
    samples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            digest.update(raw)
            if not raw.strip():
                continue
            try:
                samples.append(_sample(json.loads(raw)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    if want is not None and digest.hexdigest() != want:
        raise ValueError(f"{path}: its content differs from the sha256 recorded in {sums.name} (damaged, or edited "
                         f"after `dflashkit tokenize`); tokenize again, or delete {sums.name} to use the file as it is")
    return samples


# ---- CLI: dflashkit tokenize ---------------------------------------------------------------


def is_tokenized_file(path: Path) -> bool:
    """Whether `path` is an earlier output of `tokenize` (or an empty file), which it may replace:
    never the conversations it reads, nor a file of the user's."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        first = f.readline()
    if not first:
        return True
    try:
        rec = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and {"id", "input_ids", "loss_mask"} <= rec.keys()


def add_arguments(p) -> None:
    from dflashkit.commands import add_config_options

    p.add_argument("--input", metavar="JSONL", help="conversations to tokenise (default: data.regenerated)")
    p.add_argument("--out", metavar="JSONL", help="output file (default: data.tokenized)")
    add_config_options(p)


def run(args) -> int:
    from dflashkit.commands import config_from_args
    from dflashkit.rundir import output_path

    cfg = config_from_args(args)
    src, out = args.input or cfg.data.regenerated, args.out or cfg.data.tokenized
    if not src or not out:
        raise ValueError("tokenize needs an input (--input or data.regenerated=PATH) and an output (--out or data.tokenized=PATH)")
    with output_path(out, "tokenize", is_tokenized_file, "a tokenized file (JSONL of id, input_ids, loss_mask)"):
        tok = load_tokenizer(cfg.target.path, cfg.target.gguf_file)
        stats = tokenize_file(src, tok, out, max_length=cfg.data.max_length, thinking=cfg.data.thinking,
                              limit=cfg.data.limit)
    print(f"{out}: {stats.written} samples, {stats.tokens} tokens ({stats.supervised_tokens} supervised), "
          f"{stats.target_ids} answers as the target's own token ids; "
          f"{stats.truncated} truncated to {cfg.data.max_length}, {stats.dropped_unsupervised} dropped "
          f"(fewer than two consecutive supervised tokens), {len(stats.problems)} malformed lines skipped")
    return 0
