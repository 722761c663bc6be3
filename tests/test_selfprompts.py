"""Prompts written by the target itself (`self:N`), on the real SmolLM2 testbed."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.data.chat import prompt_ids, render
from dflashkit.data.prompts import load_prompts, near_evaluation
from dflashkit.data.selfprompts import progress_file, read_spec, user_turn_prefix, write_prompts, writer
from dflashkit.decode.loop import generate, make_engine
from dflashkit.vocab import stop_token_ids

# Short messages and answers keep this quick on a CPU; the shipped spec is assets/self_prompts.yaml.
TINY_SPEC = """
sampling: {temperature: 1.0, top_p: 0.95, max_new_tokens: 40, answer_tokens: 16}
weights: {chat: 2, multiturn: 1}
categories:
  chat: {openers: ["", "What"]}
  multiturn: {turns: 2, openers: ["How"]}
"""


def test_the_prefix_is_what_the_template_writes_before_a_users_message(smollm2):
    tok = smollm2.tokenizer
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for messages in ([], history):
        prefix = user_turn_prefix(tok, messages)
        assert render(tok, [*messages, {"role": "user", "content": "Tell me a joke."}]).startswith(prefix + "Tell me a joke.")
        assert prefix.endswith("user\n")


def test_the_target_writes_finished_new_prompts_away_from_the_evaluation(smollm2, tmp_path: Path, monkeypatch):
    spec = tmp_path / "spec.yaml"  # data.self_prompts
    spec.write_text(TINY_SPEC)
    near = near_evaluation()
    checked: list[str] = []

    def near_eval(text: str) -> bool:
        checked.append(text)
        return near(text)

    monkeypatch.setattr("dflashkit.data.prompts.near_evaluation", lambda: near_eval)
    # sources joined by '+'; 2 rows at a time, a finished message's row refilled with the next
    convs = load_prompts("self:3+builtin:2", writer=writer(smollm2, batch_size=2, spec=read_spec(spec)))
    assert [c.source for c in convs] == ["self"] * 3 + ["builtin"] * 2
    convs = convs[:3]
    assert sorted(c.id.rsplit("-", 1)[0] for c in convs) == ["self-chat", "self-chat", "self-multiturn"]
    texts = set()
    for c in convs:
        roles = [m["role"] for m in c.messages]
        assert roles == (["user", "assistant", "user"] if "multiturn" in c.id else ["user"])
        for m in c.messages[::2]:
            assert len(m["content"].split()) >= 3 and m["content"] == m["content"].strip()
            assert m["content"].lower() not in texts  # no repeats
            texts.add(m["content"].lower())
        assert "\n".join(m["content"] for m in c.messages) in checked  # every kept one was checked
        assert not near("\n".join(m["content"] for m in c.messages))
    mt = next(c for c in convs if "multiturn" in c.id)
    assert mt.messages[0]["content"].startswith("How")  # the opener starts the message
    # the middle turn is the target's own greedy answer to the first message
    tok = smollm2.tokenizer
    g = generate(make_engine(smollm2, None), torch.tensor(prompt_ids(tok, mt.messages[:1])), method="ar",
                 max_new_tokens=16, stop_ids=set(stop_token_ids(tok, smollm2.model.generation_config)))
    assert mt.messages[1]["content"] == tok.decode(g.tokens, skip_special_tokens=True).strip()
    # another seed (`data.seed`) writes other prompts
    other = load_prompts("self:3", writer=writer(smollm2, batch_size=2, seed=1, spec=read_spec(spec)))
    assert not {m["content"].lower() for c in other for m in c.messages[::2]} & texts


def test_an_interrupted_writer_resumes_without_losing_or_repeating_work(smollm2, tmp_path: Path, monkeypatch):
    spec_text = TINY_SPEC.replace('["", "What"]', '["", "What", "How", "Why", "Tell me", "Give me"]')
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text)
    real = __import__("dflashkit.decode.loop", fromlist=["generate_batch"]).generate_batch
    calls: list[list[int]] = []  # per run: how many prompts each generate_batch call was given

    def counting(fail_at: int | None = None):
        calls.append([])

        def generate_batch(engine, prompts, **kw):
            if len(calls[-1]) == fail_at:
                raise KeyboardInterrupt  # the job is stopped in its third batch of messages
            calls[-1].append(len(prompts))
            return real(engine, prompts, **kw)
        monkeypatch.setattr("dflashkit.decode.loop.generate_batch", generate_batch)

    def near_eval(text: str) -> bool:  # turns down about half the first messages: it takes several rounds
        return "\n" not in text and zlib.crc32(text.encode()) % 2 == 0

    def run(keep: Path | None = None) -> list[str]:  # as JSON, key order included
        return [json.dumps(vars(c)) for c in write_prompts(smollm2, 6, batch_size=2, chunk=2, near_eval=near_eval,
                                                           keep=keep, spec=read_spec(spec))]

    counting()
    whole = run()  # saves nothing
    keep = tmp_path / "run"
    counting(fail_at=len(calls[0]) - 1)  # stopped in its last batch of messages
    with pytest.raises(KeyboardInterrupt):
        run(keep)
    saved = progress_file(keep, smollm2, 6, 0, spec_text)
    assert json.loads(saved.read_text())["round"] >= 1  # past the first round: its random state was restored
    counting()
    assert run(keep) == whole
    assert calls[1] + calls[2] == calls[0]  # the messages written before the stop were not written again
    counting(fail_at=0)  # finished: read back, nothing written
    assert run(keep) == whole
    saved.write_text("{")
    with pytest.raises(ValueError, match="unreadable progress of self-written prompts.*delete it"):
        run(keep)


def test_bad_self_prompt_sources_get_clear_errors(smollm2, tmp_path: Path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="written by the target"):
        load_prompts("self:4")
    with pytest.raises(ValueError, match="self:N with N a positive"):
        load_prompts("self:x", writer=writer(smollm2))
    with pytest.raises(ValueError, match="in both"):
        load_prompts("builtin:3+builtin:3")
    # data.self_prompts: checked before the target writes anything
    spec = tmp_path / "spec.yaml"
    with pytest.raises(ValueError, match=r"data.self_prompts: .*spec.yaml: no such file"):
        read_spec(spec)
    for text, expected in [("weights: [chat\n", "not readable as YAML"),
                           ("weights: {chat: 1}\n", "expected 'sampling'.*missing or bad: 'sampling'"),
                           (TINY_SPEC.replace("temperature: 1.0, ", ""), "missing or bad: 'temperature'"),
                           (TINY_SPEC.replace("chat: 2", "chat: lots"), "a share >= 0"),
                           (TINY_SPEC.replace("{chat: 2, multiturn: 1}", "[chat, multiturn]"), "a share >= 0"),
                           (TINY_SPEC.replace("chat: 2, multiturn: 1", "chat: 0, multiturn: 0"), "not all 0"),
                           (TINY_SPEC.replace('["How"]', "[]"), "non-empty list of 'openers'"),
                           (TINY_SPEC.replace("turns: 2", "turns: 3"), "'turns' 1 or 2")]:
        spec.write_text(text)
        with pytest.raises(ValueError, match=f"data.self_prompts: .*spec.yaml: .*{expected}"):
            read_spec(spec)
    # `regenerate` reads the file before it loads the target (minutes for a large one)
    monkeypatch.setattr("dflashkit.target.load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    assert main(["regenerate", "data.prompts=self:2", f"data.regenerated={tmp_path / 'r.jsonl'}",
                 f"data.self_prompts={spec}"]) == 1
    assert "'turns' 1 or 2" in capsys.readouterr().err
