"""`regenerate`: resumable append-only output (kill -9 mid-run loses and duplicates nothing), and
the HTTP back-end against a live `dflashkit serve` that fails some requests."""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import pytest
import torch

from datahelpers import live_server, one_thread, save_tiny_target, start_cli, wait_until  # noqa: F401
from dflashkit.cli import main as cli_main
from dflashkit.data.chat import load_tokenized, prompt_ids, tokenize_file
from dflashkit.data.prompts import Conversation, load_prompts
from dflashkit.data.regenerate import (GenerationParams, RequestFailed, post_with_retries, regenerate_http,
                                       regenerate_local)
from dflashkit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hi.", "What is Python?", "Count to three.", "Name a fruit."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    # A multi-turn record: its old answer is dropped, earlier turns stay as context.
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"} for i in range(40)]
    rows[1] = {"id": "q1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "old"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)), "duplicated ids"
    return {r["id"]: r for r in lines}


def test_local_kill_and_resume(tiny_dir, prompts_file, tmp_path, capsys):
    convs = load_prompts(prompts_file)
    params = GenerationParams(max_new_tokens=24)  # (at 16 some of the random target's answers are blank)
    ref = tmp_path / "ref.jsonl"
    stats = regenerate_local(load_target(tiny_dir), convs, ref, params, batch_size=4)
    assert stats.written == 40 and stats.completion_tokens > 0
    want = records(ref)
    assert want["q1"]["messages"][:3] == convs[1].messages[:3] and want["q1"]["messages"][3]["content"] != "old"
    target = load_target(tiny_dir)  # the answers are the target's own greedy continuations
    for r in list(want.values())[:3]:
        x = torch.tensor([prompt_ids(target.tokenizer, r["messages"][:-1])])
        own = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)[0, x.shape[1]:]
        assert r["completion_ids"] == own[:len(r["completion_ids"])].tolist()

    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--out", str(out), f"target.path={tiny_dir}", f"data.prompts={prompts_file}",
            "data.max_new_tokens=24", "data.batch_size=4"]
    proc = start_cli(*args)
    try:
        assert wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 6, proc), proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    done = out.read_bytes().count(b"\n")
    assert 6 <= done < 40, "the run was not interrupted mid-way"
    with open(out, "ab") as f:  # as if the kill had cut a write in half
        f.write(b'{"id": "q39", "messages": [{"ro')
    assert cli_main(args) == 0, capsys.readouterr().err  # the resumed run in this process: no second CLI start-up
    assert f"{40 - done} answers written, {done} already there" in capsys.readouterr().out
    assert records(out) == want  # greedy: exactly what the uninterrupted run wrote

    with pytest.raises(ValueError, match=f"{out}:1: written with generation params"):
        regenerate_local(load_target(tiny_dir), convs, out, GenerationParams(max_new_tokens=8))

    # tokenize keeps the target's own ids: prompt ids + generated ids, exactly.
    tok = load_target(tiny_dir).tokenizer
    stats = tokenize_file(out, tok, tmp_path / "tok.jsonl", max_length=4096)
    assert stats.written == stats.target_ids == 40
    for s in load_tokenized(tmp_path / "tok.jsonl"):
        r = want[s.id]
        seq = prompt_ids(tok, r["messages"][:-1]) + r["completion_ids"]
        assert s.input_ids[:len(seq)] == seq


def test_rows_refilled_on_a_graph_engine_answer_as_whole_batches(tiny_dir, prompts_file, tmp_path, monkeypatch):
    """On an engine with fixed rows (CUDA graphs) a finished row takes the next prompt at once and
    each answer is written as it ends: the answers are the whole batches' (greedy), a run
    resumed from a file holding some of them writes only the rest, and one resumed from a file
    holding all of them (a --data-only run's) builds no engine and decodes nothing."""
    from dflashkit.decode import loop

    convs, params = load_prompts(prompts_file)[:12], GenerationParams(max_new_tokens=24)
    target = load_target(tiny_dir)
    whole = tmp_path / "whole.jsonl"
    regenerate_local(target, convs, whole, params, batch_size=4)
    make = loop.make_engine

    built = []

    def fixed(*a, **kw):
        engine = make(*a, **kw)
        engine.fixed_rows = True
        built.append(engine)
        return engine

    monkeypatch.setattr(loop, "make_engine", fixed)
    joins = []
    monkeypatch.setattr(loop.Engine, "join", lambda self, *a, join=loop.Engine.join, **kw: (joins.append(1), join(self, *a, **kw))[1])
    refilled = tmp_path / "refilled.jsonl"
    lines = whole.read_text().splitlines(keepends=True)
    refilled.write_text("".join(lines[:4]))  # an earlier run wrote these
    stats = regenerate_local(target, convs, refilled, params, batch_size=4)
    assert joins and stats.already_done == 4 and stats.written == 8
    assert records(refilled) == records(whole)
    built.clear()
    again = regenerate_local(target, convs, refilled, params, batch_size=4)
    assert not built and again.already_done == 12 and again.written == 0 and again.completion_tokens == 0
    assert records(refilled) == records(whole)


@pytest.fixture(scope="module")
def failing_server():
    with live_server("--fail-every", "3") as url:
        yield url


@pytest.mark.slow
def test_http_backend_with_failing_server(failing_server, smollm2, tmp_path):
    convs = [Conversation(f"h{i}", [{"role": "user", "content": q}], "test") for i, q in enumerate(QUESTIONS)]
    params = GenerationParams(max_new_tokens=4)
    out = tmp_path / "http.jsonl"
    # No retries: every 3rd request fails and is reported, nothing is written for it.
    first = regenerate_http(failing_server, convs, out, params, concurrency=3, retries=0)
    assert first.failed and first.written == len(convs) - len(first.failed)
    assert all("HTTP 500" in e for e in first.failed.values())
    # A re-run with retries (backoff) completes the rest without duplicating anything.
    second = regenerate_http(failing_server, convs, out, params, concurrency=3, retries=6, backoff=0.05)
    assert not second.failed and second.already_done == first.written and second.written == len(first.failed)
    got = records(out)
    assert set(got) == {c.id for c in convs}
    health = httpx.get(failing_server.removesuffix("/v1") + "/health").json()
    assert health["injected_failures"] >= len(first.failed) + second.retries

    # The server's answers are the target's own greedy answers.
    ref = tmp_path / "local.jsonl"
    regenerate_local(smollm2, convs, ref, params, batch_size=1)
    local = records(ref)
    for i in got:
        assert got[i]["messages"] == local[i]["messages"]
        assert (got[i]["finish_reason"], got[i]["completion_tokens"]) == (local[i]["finish_reason"], local[i]["completion_tokens"])


@pytest.mark.slow
def test_http_client_errors_are_not_retried(failing_server):
    t0 = time.perf_counter()
    with httpx.Client() as client, pytest.raises(RequestFailed, match="HTTP 400"):
        post_with_retries(client, f"{failing_server}/chat/completions", {"messages": []}, retries=5, backoff=1.0,
                          timeout=30)
    assert time.perf_counter() - t0 < 1.0  # no backoff sleeps
    with httpx.Client() as client, pytest.raises(RequestFailed, match="gave up after 2 attempts"):
        post_with_retries(client, "http://127.0.0.1:9/v1/chat/completions", {}, retries=1, backoff=0.01, timeout=5)


def test_http_read_timeouts_are_not_retried_and_retries_are_counted(tmp_path, monkeypatch):
    """A request the server may still be computing is not sent again (no duplicate queued behind
    it); refused attempts are retried and every retry is counted, also of requests that failed."""
    from functools import partial

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append(body["messages"][-1]["content"])
        if body["messages"][-1]["content"] == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(503, json={"error": {"message": "busy"}})

    monkeypatch.setattr(httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(handler)))
    convs = [Conversation("a", [{"role": "user", "content": "slow"}], "t"),
             Conversation("b", [{"role": "user", "content": "busy"}], "t")]
    stats = regenerate_http("http://x/v1", convs, tmp_path / "o.jsonl", GenerationParams(max_new_tokens=4), model="m",
                            concurrency=1, retries=5, backoff=0.001, timeout=1)
    assert calls.count("slow") == 1 and calls.count("busy") == 6
    assert "not retried" in stats.failed["a"] and "gave up after 6 attempts" in stats.failed["b"]
    assert stats.retries == 5 and stats.written == 0


def test_cli_counts_malformed_prompt_lines_and_takes_overrides_after_options(tiny_dir, tmp_path, capsys, caplog):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Say hi."}\n{not json\n{"id": "b", "prompt": "Name a fruit."}\n')
    out = tmp_path / "o.jsonl"
    # Overrides before and after the options.
    rc = cli_main(["regenerate", f"target.path={tiny_dir}", "--out", str(out), f"data.prompts={prompts}",
                   "data.max_new_tokens=2", "target.device=cpu"])
    res = capsys.readouterr()
    assert rc == 0, res.err
    assert "2 answers written" in res.out and "1 malformed prompt records skipped" in res.out
    assert f"{prompts}:2: invalid JSON" in res.out
    rc = cli_main(["regenerate", "--out", str(out), f"data.prompts={tmp_path / 'p.jsnol'}", f"target.path={tiny_dir}"])
    err = capsys.readouterr().err
    assert rc == 1 and "p.jsnol: no such prompt file" in err
    assert "Traceback" not in err + caplog.text  # (in this process the log goes to caplog, not to stderr)


def test_resume_refuses_answers_of_another_prompt_text_or_target(tiny_dir, tmp_path, capsys):
    """An answer is kept on resume only for the same prompt text, target and settings: a changed
    prompt or another target is refused with one line naming the way forward, never counted as
    'already there'; --overwrite starts afresh."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Name a fruit."}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.jsonl"
    args = ["regenerate", "--out", str(out), f"data.prompts={prompts}", "data.max_new_tokens=3", "target.device=cpu"]
    assert cli_main([*args, f"target.path={tiny_dir}"]) == 0
    assert "2 answers written" in capsys.readouterr().out
    first = out.read_bytes()
    assert cli_main([*args, f"target.path={tiny_dir}"]) == 0  # same prompts, same target: nothing to do
    assert "0 answers written, 2 already there" in capsys.readouterr().out

    rows[1]["prompt"] = "Name a vegetable."
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main([*args, f"target.path={tiny_dir}"]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"{out}:\d: answers another text of prompt 'b' .*start afresh with --overwrite", err)
    assert out.read_bytes() == first

    other = save_tiny_target(tmp_path / "other", seed=1)  # another target of the same shape and tokenizer
    rows[1]["prompt"] = "Name a fruit."
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main([*args, f"target.path={other}"]) == 1
    err = capsys.readouterr().err
    assert f"{out}:1: written by another target (weights_fingerprint differs:" in err and "--overwrite" in err
    assert out.read_bytes() == first

    assert cli_main([*args, f"target.path={other}", "--overwrite"]) == 0
    assert "2 answers written, 0 already there" in capsys.readouterr().out
    before = {r["id"]: r for r in map(json.loads, first.splitlines())}
    after = records(out)
    assert after["a"]["target"]["name"] == str(other) and after["a"]["prompt_sha256"] == before["a"]["prompt_sha256"]

    tok = load_target(other).tokenizer  # tokenize trusts answers only under the template that rendered their prompts
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(ValueError, match=rf"{out}:1: answered by target '{other}', whose chat template is not this tokenizer's"):
        tokenize_file(out, tok, tmp_path / "tok.jsonl", max_length=256)


def test_out_is_never_a_link_nor_a_file_of_another_kind_with_or_without_overwrite(tiny_dir, tmp_path, capsys):
    """--out naming a link, or a file that is not regenerate's output (notes, the prompt file, a
    last line without its newline), is refused in one line, with or without --overwrite, and the
    file is left byte for byte; --overwrite empties regenerate's own output, a torn record and all."""
    from dflashkit.data.regenerate import AnswerKey, open_output

    key = AnswerKey(GenerationParams(), {}, {})
    notes, tail = tmp_path / "notes.txt", tmp_path / "tail.txt"
    notes.write_text("my notes\n")
    tail.write_text("no newline at the end")  # not a record that a kill cut short
    link = tmp_path / "link.jsonl"
    link.symlink_to(notes)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"link\.jsonl: a symbolic link; regenerate writes its output file itself"):
            with open_output(link, key, overwrite=overwrite):
                pass
        for path in (notes, tail):
            with pytest.raises(ValueError, match=rf"{path}:1: not a regenerate record"):
                with open_output(path, key, overwrite=overwrite):
                    pass
    assert notes.read_text() == "my notes\n" and tail.read_text() == "no newline at the end"

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Say hi."}) + "\n")
    args = ["regenerate", f"data.prompts={prompts}", "data.max_new_tokens=2", "target.device=cpu",
            f"target.path={tiny_dir}"]
    assert cli_main([*args, "--out", str(prompts), "--overwrite"]) == 1  # the input given as the output
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflashkit")]
    assert len(err) == 1 and f"{prompts}:1: not a regenerate record" in err[0], err
    assert prompts.read_text() == json.dumps({"id": "a", "prompt": "Say hi."}) + "\n"

    out = tmp_path / "o.jsonl"
    assert cli_main([*args, "--out", str(out)]) == 0
    with open(out, "ab") as f:
        f.write(b'{"id": "b", "messa')  # a record a kill cut short
    assert cli_main([*args, "--out", str(out), "--overwrite"]) == 0
    assert "1 answers written, 0 already there" in capsys.readouterr().out and list(records(out)) == ["a"]


def test_a_lone_surrogate_in_a_prompt_is_a_malformed_record(tiny_dir, tmp_path, capsys):
    """JSON's "\\ud800" escape is no Unicode text: the record is skipped and named (file, line, field,
    character), the other prompts are answered (before: an internal error in the tokenizer)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Say hi \\ud800."}\n{"id": "b", "prompt": "Name a fruit."}\n')
    out = tmp_path / "o.jsonl"
    assert cli_main(["regenerate", "--out", str(out), f"data.prompts={prompts}", f"target.path={tiny_dir}",
                     "data.max_new_tokens=2", "target.device=cpu"]) == 0
    res = capsys.readouterr().out
    assert "1 answers written" in res and f"{prompts}:1: prompt: character 7 is a lone surrogate (U+D800)" in res
    assert list(records(out)) == ["b"]
