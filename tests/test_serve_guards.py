"""`dflashkit serve` under abuse: clients that leave, a full queue, big bodies, wrong keys, lax
fields, strings that are not Unicode, bugs (error bodies stay JSON), slow tokenisation, option
values out of range, an open host without a key, SIGTERM to the server's process or its whole
process group with requests in flight, and an engine's process that dies or is orphaned.

Most tests run the app in this process over a generator that never ends by itself (so a request
is in flight for as long as a test needs, and only a cancellation ends it); conditions are polled
on /health, never timed. The stop tests run a real `dflashkit serve` on a tiny random target; the
continuous-batching and seeded-sampling tests run the real round loop on one, in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from datahelpers import CHILD_ENV, one_thread, save_tiny_target, start_cli  # noqa: F401
from dflashkit.decode.generation import GenerationChunk
from dflashkit.serve import Admission, BatchWorker, EngineProcess, Served, build_app
from dflashkit.vocab import stop_token_ids

pytestmark = pytest.mark.usefixtures("one_thread")
CHAT = [{"role": "user", "content": "hi"}]


class Endless:
    """Token 42 every few milliseconds, up to max_new_tokens (the whole context: practically never)."""

    def generate(self, input_ids, *, max_new_tokens, **_):
        for _ in range(max_new_tokens):
            time.sleep(0.005)
            yield GenerationChunk([42])
        yield GenerationChunk([], "length", {})


class GatedTokenizer:
    """The real tokenizer, except that encoding a text containing 'BLOCK' waits for `release`."""

    def __init__(self, tok):
        self._tok, self.entered, self.release = tok, threading.Event(), threading.Event()

    def __call__(self, text, **kw):
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(120)
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def tokenizer():
    from dflashkit.data.chat import load_tokenizer

    return load_tokenizer()


def served(tok):
    return Served(tok, "fake", frozenset(stop_token_ids(tok, None)), 1 << 30)


@contextmanager
def serving(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert poll(lambda: server.started)
    try:
        yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(60)


def poll(cond, timeout: float = 60) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def raw_request(url: str, path: str, body: dict, headers: str = "") -> socket.socket:
    """Send a POST and leave the connection open without reading: a client that may go away."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def load_endless():
    """In an engine process (`EngineProcess`, as `dflashkit serve` runs): `Endless`."""
    from dflashkit.data.chat import load_tokenizer

    return served(load_tokenizer()), Endless()


def endless(in_process: bool, max_queue: int = 0, on_failure=lambda: None):
    """`Endless` behind the engine `dflashkit serve` uses (its own process) or one on a thread here."""
    if in_process:
        return BatchWorker(Endless(), max_queue=max_queue)
    return EngineProcess(load_endless, 1, max_queue, Admission(), on_failure)


@pytest.mark.parametrize("stream,in_process", [(False, True), (True, True), (False, False), (True, False)])
def test_a_client_that_disconnects_frees_the_engine(tokenizer, stream, in_process):
    with serving(build_app(served(tokenizer), endless(in_process))) as url:
        s = raw_request(url, "/v1/chat/completions", {"messages": CHAT, "stream": stream})  # no max_tokens: endless
        assert poll(lambda: health(url)["running"] == 1)
        s.close()
        assert poll(lambda: health(url)["cancelled"] == 1 and health(url)["running"] == 0)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert health(url)["completed"] == 1


@pytest.mark.parametrize("in_process", [True, False])
def test_a_full_queue_answers_503(tokenizer, in_process):
    with serving(build_app(served(tokenizer), endless(in_process, max_queue=1))) as url:
        busy = raw_request(url, "/v1/chat/completions", {"messages": CHAT})
        assert poll(lambda: health(url)["running"] == 1)
        waiting = raw_request(url, "/v1/chat/completions", {"messages": CHAT})
        assert poll(lambda: health(url)["queued"] == 1)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "busy: 1 requests are already waiting (serve --max-queue 1)" in r.json()["error"]["message"]
        busy.close()
        waiting.close()
        assert poll(lambda: health(url)["running"] == 0 and health(url)["queued"] == 0)


def test_an_engine_process_that_dies_fails_its_requests_and_stops_the_server(tokenizer):
    """The engine's process killed under a running request: the request ends with an error (in
    band, as its headers are sent), new ones get 503 naming the cause, and the server is told to
    stop (`dflashkit serve` then exits with that error)."""
    stopped = threading.Event()
    engine = endless(False, on_failure=stopped.set)
    with serving(build_app(served(tokenizer), engine)) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": CHAT, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {") and  # it runs
                        json.loads(line[6:])["choices"][0]["delta"].get("content"))
            os.kill(engine.proc.pid, signal.SIGKILL)
            rest = list(lines)
        assert any("the engine process exited (code -9)" in line for line in rest), rest[-3:]
        assert stopped.wait(30) and engine.failed == "the engine process exited (code -9)"
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and "the engine process exited (code -9)" in r.json()["error"]["message"]
    engine.close()


def test_api_key_body_cap_and_strict_fields(tokenizer):
    app = build_app(served(tokenizer), BatchWorker(Endless()), api_key="s3cret", max_body_bytes=2000)
    good = {"Authorization": "Bearer s3cret"}
    with serving(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # open, for load balancers
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{url}/v1/models", headers=headers)
            assert r.status_code == 401 and "serve --api-key" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=big, headers=good)
        assert r.status_code == 413 and "limit of 2000 bytes" in r.json()["error"]["message"]
        chunked = httpx.post(f"{url}/v1/chat/completions", content=iter([json.dumps(big).encode()]),
                             headers={**good, "content-type": "application/json"})
        assert chunked.status_code == 413
        # JSON types as OpenAI's API takes them: a string, a float or a word is not converted
        for field, value in (("max_tokens", True), ("seed", 2 ** 70), ("n", True), ("temperature", "0.5"),
                             ("stream", "yes"), ("max_tokens", 2.0), ("top_p", "1"), ("seed", 1.0)):
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, field: value}, headers=good)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "seed": 2 ** 63,
                                                            "temperature": 1, "top_p": 1, "stream": False},
                       headers=good, timeout=60)
        assert r.status_code == 200  # an integer is a number


def test_tokenisation_does_not_block_the_event_loop(tokenizer):
    gated = GatedTokenizer(tokenizer)
    with serving(build_app(served(gated), BatchWorker(Endless()))) as url:
        s = raw_request(url, "/v1/completions", {"prompt": "BLOCK " * 10, "max_tokens": 2})
        try:
            assert gated.entered.wait(60)
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # answered while tokenising
        finally:
            gated.release.set()
            s.close()


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory):
    # A context of 32k tokens: a request without max_tokens runs for minutes on the CPU.
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "model", context=1 << 15)


def test_sigterm_stops_the_server_with_a_long_request_in_flight(long_context_target):
    proc = start_cli("serve", "--port", "0", "--shutdown-timeout", "2", f"target.path={long_context_target}",
                     "target.device=cpu")
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the server did not start"
        url = line.split("listening on", 1)[1].strip().removesuffix("/v1")
        s = raw_request(url, "/v1/completions", {"prompt": "Once upon a time"} | {"max_tokens": 30000})
        assert poll(lambda: health(url)["running"] == 1, 120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)  # raises TimeoutExpired if the server is still running after 10 s
        s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Spy:
    """A batched generator that records, for every admission, the rows running and the requests joining."""

    def __init__(self, generator):
        self.generator, self.joined = generator, []

    def generate(self, input_ids, **kw):
        return self.generator.generate(input_ids, **kw)

    def generate_batch(self, requests, cancelled, admit=None):
        def spy(rows):
            new = admit(rows)
            if new:
                self.joined.append((rows, len(new)))
            return new

        return self.generator.generate_batch(requests, cancelled, spy)


def endless_target_and_drafter(tokenizer):
    """A tiny random target and drafter on which a request without a short limit runs until it is
    cancelled: a long context, and a head that gives stop tokens no chance (a random model emits
    them now and then, and which tokens it decodes depends on the round a request joined in)."""
    import torch

    from conftest import make_tiny_drafter, make_tiny_target

    target = make_tiny_target()
    target.config.max_position_embeddings = 1 << 20
    emb = target.model.get_input_embeddings().weight
    head = torch.nn.Linear(emb.shape[1], emb.shape[0])
    with torch.no_grad():
        head.weight.copy_(emb)
        head.bias.zero_()
        head.bias[sorted(stop_token_ids(tokenizer, None))] = -1e4
    target.model.set_output_embeddings(head)
    return target, make_tiny_drafter(target)


def test_continuous_batching_frees_a_disconnected_clients_row(tokenizer):
    """`--max-batch 2` over the real round loop (tiny random target and drafter): two endless
    requests fill the batch and a third waits; when one client disconnects, the third joins the
    running batch beside the other (which keeps running), and its answer is what it decodes alone."""
    import torch

    from dflashkit.decode.engine import Engine as Decoder
    from dflashkit.decode.loop import DecodingGenerator, generate

    target, drafter = endless_target_and_drafter(tokenizer)
    stops = stop_token_ids(tokenizer, None)
    spy = Spy(DecodingGenerator(Decoder(target, drafter)))
    endless = {"prompt": [5, 6, 7, 8], "max_tokens": 100_000, "stream": True}
    short = {"prompt": [9, 10, 11], "max_tokens": 5, "temperature": 0}
    with serving(build_app(served(tokenizer), BatchWorker(spy, max_batch=2))) as url:
        a = raw_request(url, "/v1/completions", endless)
        b = raw_request(url, "/v1/completions", endless)
        assert poll(lambda: health(url)["running"] == 2)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/completions", json=short, timeout=120)
            assert poll(lambda: health(url)["queued"] == 1)
            a.close()
            r = answer.result()
        assert r.status_code == 200 and poll(lambda: health(url)["running"] == 1)  # b still runs
        assert spy.joined[-1] == (1, 1)  # the third request joined beside b (b may have joined a too)
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 5 and usage["batch_size"] == 2
        b.close()
        assert poll(lambda: health(url)["running"] == 0 and health(url)["cancelled"] == 2)
        assert health(url)["completed"] == 1
    alone = generate(Decoder(target, drafter), torch.tensor(short["prompt"]), max_new_tokens=5, stop_ids=stops)
    assert r.json()["choices"][0]["text"] == tokenizer.decode([t for t in alone.tokens if t not in stops],
                                                              skip_special_tokens=True)


def test_streamed_text_equals_decoding_the_whole_answer(tokenizer):
    """The server detokenises a streamed answer chunk by chunk (work per new token); at every chunk
    its text equals decoding all ids so far, multi-byte characters split across chunks and special
    tokens included; the same for a tokenizer without a fast backend (decoded again each time)."""
    import random

    from dflashkit.serve import text_so_far

    ids = tokenizer("naïve café — 日本語テキスト, emoji 🙂 and <|im_end|> code: def f(x): return x\n",
                    add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    ids = ids + [rng.randrange(tokenizer.vocab_size) for _ in range(200)]

    class Slow:  # no backend_tokenizer: the fallback
        decode = tokenizer.decode

    for tok in (tokenizer, Slow()):
        step, at = text_so_far(tok), 0
        while at < len(ids):
            n = rng.randint(1, 4)
            text = step(ids[at:at + n])
            at += n
            full = tokenizer.decode(ids[:at], skip_special_tokens=True)
            # a token whose character's bytes are not all there yet is held back (DecodeStream),
            # where a whole decode shows U+FFFD: equal up to that token
            assert full.startswith(text) and (text == full or "\ufffd" in full[len(text):]), (at, text, full)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


class Fixed:
    """The token ids `ids` in one chunk, then the end."""

    def __init__(self, ids):
        self.ids = ids

    def generate(self, input_ids, *, max_new_tokens, **_):
        yield GenerationChunk(list(self.ids))
        yield GenerationChunk([], "length", {})


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_ending_inside_a_character_is_sent_as_the_tokenizer_decodes_it(tokenizer, stream):
    """Byte tokens that never complete their character: the streamed text waits for more bytes, but
    at the answer's end the text is what the tokenizer decodes (U+FFFD), never dropped."""
    whole = tokenizer("ok 🙂🙂", add_special_tokens=False)["input_ids"]
    ids = whole[:-1]  # the last emoji's bytes cut short
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.endswith("\ufffd") and expected.startswith("ok 🙂")
    app = build_app(served(tokenizer), BatchWorker(Fixed(ids)))
    body = {"prompt": "hi", "max_tokens": len(ids), "stream": stream}
    with serving(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        text = r.json()["choices"][0]["text"]
    assert text == expected


def test_speculative_options_without_a_drafter_are_refused_before_loading(capsys):
    """`--draft-tokens` and `--cost-aware` decide how a drafter drafts: without `--drafter` each
    is one line naming both, before any model loads; `--draft-tokens 0` is a usage error."""
    from dflashkit.cli import main

    for option in (["--draft-tokens", "7"], ["--cost-aware"]):
        assert main(["serve", *option]) == 1
        assert f"{option[0]} needs --drafter DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="1"):
        main(["serve", "--draft-tokens", "0"])
    assert "argument --draft-tokens: expected an integer >= 1" in capsys.readouterr().err


def _first_line_with(proc: subprocess.Popen, text: str) -> str:
    line = ""
    while text not in line:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"the server exited before printing {text!r}"
    return line


def test_sigterm_to_the_process_group_drains_in_flight_requests(long_context_target):
    """systemd's stop, `timeout` and `kill -TERM -PGID` signal every process of the server's
    group, the engine's process included: requests in flight (a streamed and a whole one, both
    decoding) still finish with their complete answers, and the server then exits, well within
    its --shutdown-timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "dflashkit.cli", "serve", "--port", "0", "--max-batch", "2",
                             "--shutdown-timeout", "60", f"target.path={long_context_target}", "target.device=cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV,
                            start_new_session=True)
    try:
        url = _first_line_with(proc, "listening on").split("listening on", 1)[1].strip()
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
        want = httpx.post(f"{url}/completions", json=body, timeout=120).json()
        assert want["usage"]["completion_tokens"] == 400, want  # the answer runs to its limit
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{url}/completions", json=body, timeout=120)
            with httpx.stream("POST", f"{url}/completions", json=body | {"stream": True}, timeout=120) as r:
                events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
                streamed = [next(events)]
                assert poll(lambda: whole.running() and health(url.removesuffix("/v1"))["running"] == 2)
                signalled = time.monotonic()
                os.killpg(proc.pid, signal.SIGTERM)
                streamed += list(events)
            assert r.status_code == 200 and not [e for e in streamed if "error" in e], streamed[-1]
            assert "".join(e["choices"][0]["text"] for e in streamed) == want["choices"][0]["text"]
            assert streamed[-1]["choices"][0]["finish_reason"] == "length"
            assert whole.result().status_code == 200 and whole.result().json()["choices"] == want["choices"]
        proc.wait(60)
        assert time.monotonic() - signalled < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class CrashingTokenizer(GatedTokenizer):
    """The real tokenizer, except that encoding a text containing 'CRASH' fails as a bug would."""

    def __call__(self, text, **kw):
        if "CRASH" in text:
            raise TypeError("a bug in the tokenizer")
        return self._tok(text, **kw)


class UndecodableTokenizer(GatedTokenizer):
    """The real tokenizer, except that it cannot decode (and has no fast backend to decode with)."""

    backend_tokenizer = None

    def decode(self, *_args, **_kw):
        raise ValueError("undecodable")


def test_every_error_body_is_json_and_lone_surrogates_are_refused(tokenizer):
    """JSON lets a lone surrogate ("\\ud800") into a string, which no tokenizer takes: a 400 that
    names the field, wherever the string stands. A bug inside the server is a 500 whose body is
    JSON too (in a stream whose headers are out: a JSON error event, then the stream's end), as is
    an unknown route's 404."""
    with serving(build_app(served(CrashingTokenizer(tokenizer)), BatchWorker(Endless()))) as url:
        def post(path: str, body: bytes) -> httpx.Response:
            return httpx.post(f"{url}/v1/{path}", content=body, headers={"content-type": "application/json"},
                              timeout=60)

        for path, body, param in (
                ("completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
                ("completions", rb'{"prompt": ["\udc00"], "max_tokens": 2}', "prompt[0]"),
                ("completions", rb'{"prompt": "ab", "max_tokens": 2, "stop": ["x", "\ud800"]}', "stop[1]"),
                ("chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
                 "messages[0].content"),
                ("chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                                     rb'"\ud800"}]}], "max_tokens": 2}', "messages[0].content[0].text")):
            r = post(path, body)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
            error = r.json()["error"]
            assert error["param"] == param and "is a lone surrogate (U+D" in error["message"], error
        r = post("completions", rb'{"prompt": "CRASH", "max_tokens": 2}')
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal server error: TypeError: a bug in the tokenizer", "type": "server_error",
            "param": None, "code": 500}
        r = httpx.get(f"{url}/v1/nothing-here", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert health(url)["status"] == "ok"  # and the server goes on
    # A bug once a stream's headers are out: an error event in the stream, then its end.
    with serving(build_app(served(UndecodableTokenizer(tokenizer)), BatchWorker(Endless()))) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}, timeout=60)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", r.text
        assert json.loads(events[-2])["error"] == {"message": "internal server error: ValueError: undecodable",
                                                   "type": "server_error", "code": 500}


def never_loaded(*_args, **_kw):
    raise RuntimeError("the command went on to load the model")


@pytest.mark.parametrize("argv,message", [
    (["--port", "99999"], "argument --port: expected a port number 0..65535 (0: any free port), got '99999'"),
    (["--port", "-1"], "argument --port: expected a port number 0..65535"),
    (["--max-body-mb", "inf"], "argument --max-body-mb: expected a finite number > 0, got 'inf'"),
    (["--max-body-mb", "nan"], "argument --max-body-mb: expected a finite number > 0, got 'nan'"),
    (["--max-body-mb", "0"], "argument --max-body-mb: expected a finite number > 0, got '0'"),
    (["--shutdown-timeout", "nan"], "argument --shutdown-timeout: expected a finite number >= 0, got 'nan'"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: expected a finite number >= 0, got '-1'"),
    (["--max-queue", "-1"], "argument --max-queue: expected an integer >= 0, got '-1'"),
    (["--max-batch", "0"], "argument --max-batch: expected an integer >= 1, got '0'"),
    (["--fail-every", "-3"], "argument --fail-every: expected an integer >= 0, got '-3'"),
    (["--join-max-wait-ms", "nan"], "--join-max-wait-ms nan: expected MS >= 0"),
    (["--join-min-free", "0"], "--join-min-free 0: expected N >= 1"),
    (["--drafter", "d", "--ddtree-budget", "0"], "argument --ddtree-budget: expected an integer >= 1, got '0'"),
    (["--ddtree-budget", "8"], "--ddtree-budget needs --drafter DIR"),
    (["--acceptance", "match"], "--acceptance needs --drafter DIR"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1 --port 0: cannot listen there (Cannot assign requested address)"),
    (["--api-key", ""], "argument --api-key: expected a non-empty key (to serve without one, leave out --api-key "
                        "and unset DFLASHKIT_API_KEY), got ''"),
    (["--api-key", " "], "argument --api-key: expected a non-empty key"),
])
def test_option_values_are_refused_before_anything_loads(argv, message, capsys, monkeypatch):
    from dflashkit import serve
    from dflashkit.cli import main

    monkeypatch.setattr(serve, "EngineProcess", never_loaded)
    try:
        code = main(["serve", "--port", "0", *argv])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"dflashkit serve: error: {message}") and err.count("\n") == 1, err


def test_an_empty_api_key_is_refused_not_taken_as_none(tokenizer, capsys, monkeypatch):
    """An empty key, given or in $DFLASHKIT_API_KEY, would turn authentication off: one line, before
    anything loads; the app refuses one too."""
    from dflashkit import serve
    from dflashkit.cli import main

    monkeypatch.setattr(serve, "EngineProcess", never_loaded)
    monkeypatch.setenv("DFLASHKIT_API_KEY", "")
    with pytest.raises(SystemExit, match="1"):
        main(["serve", "--port", "0"])
    assert "argument --api-key: expected a non-empty key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key: expected a non-empty key"):
        build_app(served(tokenizer), BatchWorker(Endless()), api_key="")


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                             ("127.0.0.1", None, False)])
def test_a_host_other_machines_reach_without_an_api_key_is_warned_about(host, key, warned, capsys, monkeypatch):
    from dflashkit import serve
    from dflashkit.cli import main

    monkeypatch.setattr(serve, "EngineProcess", never_loaded)
    monkeypatch.delenv("DFLASHKIT_API_KEY", raising=False)
    assert main(["serve", "--host", host, "--port", "0", *(["--api-key", key] if key else [])]) == 1
    err = capsys.readouterr().err
    assert err.endswith("dflashkit serve: error: the command went on to load the model\n")  # after the warning
    assert ("dflashkit serve: warning: listening on 0.0.0.0 without an API key" in err) == warned, err


@pytest.mark.parametrize("method,budget,acceptance", [("dflash", None, "rejection"), ("ddtree", 8, "rejection"),
                                                     ("dflash", None, "match"), ("ddtree", 8, "match")])
def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(tokenizer, method, budget, acceptance):
    """A sampled request (temperature 0.7, top-p 0.9) with a seed, over the real round loop (tiny
    random target and drafter, DFlash and DDTree, either acceptance rule): its text alone equals
    its text when it joins a batch that a sampled endless request runs (each row draws from its
    own random stream); another seed gives another text."""
    from dflashkit.decode.engine import Engine as Decoder
    from dflashkit.decode.loop import DecodingGenerator

    target, drafter = endless_target_and_drafter(tokenizer)
    generator = DecodingGenerator(Decoder(target, drafter), method=method, budget=budget, acceptance=acceptance)
    seeded = {"prompt": [9, 10, 11], "max_tokens": 24, "temperature": 0.7, "top_p": 0.9, "seed": 11}
    with serving(build_app(served(tokenizer), BatchWorker(generator, max_batch=2))) as url:
        def ask(body: dict) -> dict:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        alone, other_seed = ask(seeded), ask(seeded | {"seed": 12})
        endless = raw_request(url, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 100_000,
                                                       "temperature": 1.0, "seed": 3, "stream": True})
        assert poll(lambda: health(url)["running"] == 1)
        batched = ask(seeded)
        endless.close()
    assert alone["usage"]["batch_size"] == 1 and batched["usage"]["batch_size"] == 2
    assert alone["usage"]["decoding"] == batched["usage"]["decoding"] == method + (f"-{budget}" if budget else "")
    assert batched["choices"][0]["text"] == alone["choices"][0]["text"]
    assert other_seed["choices"][0]["text"] != alone["choices"][0]["text"]


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def load_forever():
    """In an engine process: a model that takes forever to load."""
    time.sleep(600)


def test_the_engine_process_exits_when_the_server_process_is_killed_outright():
    """The engine's process ignores stop signals (the server drains, then closes it), so it must
    not outlive a server process that dies without closing it (SIGKILL, an out-of-memory kill),
    even while it loads the model and reads nothing from the server."""
    code = ("import sys, threading, time; sys.path.insert(0, 'tests'); import test_serve_guards as t; "
            "from multiprocessing import active_children; "
            "threading.Thread(target=t.EngineProcess, args=(t.load_forever, 1, 0, t.Admission()), daemon=True).start(); "
            "t.poll(active_children); print(active_children()[0].pid, flush=True); time.sleep(600)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=CHILD_ENV,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        engine_pid = int(server.stdout.readline())
        assert running(engine_pid)
        server.kill()
        server.wait()
        assert poll(lambda: not running(engine_pid), 60), "the engine's process outlived the server's"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_serve_exits_with_the_engine_process_error(long_context_target):
    """`dflashkit serve` whose engine's process dies stops and exits 1 naming the cause, so that a
    supervisor restarts it (rather than being stopped as if by a signal, with no error)."""
    proc = start_cli("serve", "--port", "0", f"target.path={long_context_target}", "target.device=cpu")
    try:
        _first_line_with(proc, "listening on")
        children = [int(pid) for pid in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        engine = [pid for pid in children if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
        assert len(engine) == 1, children
        os.kill(engine[0], signal.SIGKILL)
        assert proc.wait(60) == 1
        assert proc.stdout.read().endswith("dflashkit serve: error: the engine process exited (code -9); see its "
                                           "messages above\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
