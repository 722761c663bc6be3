"""`dflashkit serve`: an OpenAI-compatible HTTP server over the target.

FastAPI + uvicorn (the `serve` extra): SSE streaming, request validation and an async event loop
come for free, and the official `openai` client is what we test against.

The server is a thin shell over a pluggable `Generator` (token ids in, chunks of token ids out, a
stats dict at the end that is merged into the response's `usage` block; `decode/generation.py`).
`dflashkit serve` runs the decoding loop's `DecodingGenerator`: autoregressive without a
drafter, DFlash or DDTree with one.

One worker thread owns the model and runs requests in arrival order (`BatchWorker`): concurrent
requests queue instead of racing on the model and its KV cache. With `--max-batch N` it decodes
up to N requests as one batch that requests join and leave between rounds (continuous
batching): a request waits only while N others are running, or, as joins are cheaper in groups,
until enough rows are free or it has waited long enough (`Admission`, `--join-min-free`,
`--join-max-wait-ms`). `dflashkit serve` runs that engine in a process of its own
(`EngineProcess`), so that HTTP work does not take the interpreter lock from the round loop.

Running for days: a request whose client disconnected is cancelled (streaming or not), so the
engine moves on; at most `--max-queue` requests wait (503 beyond, with Retry-After); request bodies
are capped (413); tokenisation runs on a thread, off the event loop; `--api-key` requires a bearer
token (except on /health); SIGTERM or SIGINT, to the server's process or to its whole process
group, stops accepting, lets in-flight requests finish for `--shutdown-timeout` seconds, then
cuts them. Every error body is JSON; every option value is checked before anything loads.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflashkit.config import Float, Int  # numbers without booleans (JSON true is no max_tokens)
from dflashkit.data.chat import encode, render
from dflashkit.decode.generation import GenerationChunk, Generator
from dflashkit.decode.loop import DecodingGenerator, make_engine
from dflashkit.method import ACCEPTANCES, DEFAULT_ACCEPTANCE

try:  # the `serve` extra; module-level names, as FastAPI resolves the handlers' annotations here
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
except ImportError:  # `build_app` says what to install
    Request = JSONResponse = StreamingResponse = Any

log = logging.getLogger(__name__)


# ---- the engine: requests on a worker thread that owns the model ------------------------------------


class _Job:
    """A request as the engine sees it. `loop`: the event loop its items (`GenerationChunk`,
    `Exception`, then None at the end) go to, on its `out` queue; None in an engine process,
    whose jobs' items go back through a pipe by their `key` (`EngineProcess`)."""

    def __init__(self, input_ids: list[int], params: dict[str, Any], queued_at: float, key: int = 0,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.input_ids, self.params, self.key = input_ids, params, key
        self.queued_at = queued_at  # `BatchWorker.clock` at submission
        self.loop = loop
        self.out: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.cancelled = threading.Event()
        self.finished = False  # its last chunk (with a finish_reason) was produced
        self.on_cancel: Callable[[_Job], None] | None = None

    def cancel(self) -> None:
        """The client is gone, a stop string was found or the response is done."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel:
                self.on_cancel(self)


def to_loops(items: list[tuple[_Job, Any]]) -> None:
    """Hand (job, item) pairs from a worker thread to their event loops: one wake-up per loop
    for a whole round's chunks rather than one per row (each wake-up is a system call and a turn
    of the loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job, Any]]] = {}
    for job, item in items:
        by_loop.setdefault(job.loop, []).append((job, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # the loop is closed: its server has shut down, nobody reads these
            pass


def _put_all(pairs: list[tuple[_Job, Any]]) -> None:
    for job, item in pairs:
        job.out.put_nowait(item)


def text_so_far(tok: Any) -> Callable[[list[int], bool], str]:
    """Detokenise a growing answer: each call takes the new token ids and returns the whole text so
    far. With a fast tokenizer through `tokenizers`' DecodeStream (work per new token, where
    decoding the whole answer again at every chunk is quadratic in its length); else by decoding
    all ids again. DecodeStream holds back the bytes of a character not yet complete, waiting for
    the tokens that finish it; the answer's last call (`final`) returns what the tokenizer decodes
    of all its ids, those bytes included (U+FFFD where no token completes them)."""
    ids: list[int] = []
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers.decoders import DecodeStream

        stream, pieces = DecodeStream(skip_special_tokens=True), []

        def step(new: list[int], final: bool = False) -> str:
            ids.extend(new)
            if final:
                return tok.decode(ids, skip_special_tokens=True)
            pieces.extend(p for p in (stream.step(backend, t) for t in new) if p is not None)
            return "".join(pieces)

        return step

    def again(new: list[int], final: bool = False) -> str:
        ids.extend(new)
        return tok.decode(ids, skip_special_tokens=True)

    return again


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class Admission:
    """When queued requests join a running batch (continuous batching, `BatchWorker`).

    A join stops the running rows for a prefill of the joining prompts (and their drafter
    context pass) outside the CUDA graphs, mostly kernel launches, about as many for one prompt
    as for a group: joining at every round that has a free row makes the running rows mostly wait. So
    requests join in groups, before a round when someone waits and a row is free and
      * no row runs, or
      * at least `min_free` rows are free, or
      * the oldest waiting request has waited `max_wait_s` seconds (a bound on the wait it adds
        to a request's time to first token).
    Everyone then waiting joins at once (as many as rows are free), prefilled in one batched
    pass. `Admission()` (min_free 1) joins at every round that has a free row."""

    min_free: int = 1
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_free < 1 or not self.max_wait_s >= 0:
            raise ValueError(f"Admission: min_free must be >= 1 and max_wait_s >= 0, got {self}")

    def due(self, running: int, max_batch: int, waited_s: float | None) -> bool:
        """Whether waiting requests join before the next round: `running` rows of `max_batch`
        run, the oldest waiting request has waited `waited_s` seconds (None: nobody waits)."""
        free = max_batch - running
        if waited_s is None or free < 1:
            return False
        return running == 0 or free >= self.min_free or waited_s >= self.max_wait_s


class BatchWorker:
    """Runs generation requests in arrival order on a worker thread that owns the model. A
    `BatchedGenerator` decodes a running batch that requests join between rounds (continuous
    batching), up to `max_batch` rows at once, when `admission` says so; a finished or cancelled
    request leaves it at once. Another generator runs one request at a time. At most `max_queue`
    requests wait (`submit` raises `QueueFull` beyond); `close` cancels every job. `clock`
    (seconds) times the waits for `admission`."""

    def __init__(self, generator: Generator, max_batch: int = 1, max_queue: int = 0,
                 admission: Admission = Admission(), clock: Callable[[], float] = time.monotonic,
                 deliver: Callable[[list[tuple[_Job, Any]]], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.batched = hasattr(generator, "generate_batch")
        if max_batch > 1 and not self.batched:
            raise ValueError(f"{type(generator).__name__} decodes one request at a time; max_batch must be 1")
        self.generator, self.max_batch, self.max_queue = generator, max_batch, max_queue
        self.admission, self.clock = admission, clock
        self.deliver = deliver or to_loops  # None: the jobs belong to the submitting event loop
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.running: dict[int, _Job] = {}  # being generated now, by their index in the batch's stream
        # cancelled: ended before the last token (client gone, stop string, shutdown, error)
        self.counters = {"completed": 0, "cancelled": 0}
        self.closed = False
        self.worker = threading.Thread(target=self._work, name="dflashkit-engine", daemon=True)
        self.worker.start()

    def submit(self, input_ids: list[int], key: int = 0, **params: Any) -> _Job:
        if self.closed:
            raise QueueFull("the server is shutting down")
        if self.max_queue and self.jobs.qsize() >= self.max_queue:
            raise QueueFull(f"{self.jobs.qsize()} requests are already waiting (serve --max-queue {self.max_queue})")
        job = _Job(input_ids, params, self.clock(), key, asyncio.get_running_loop() if self.deliver is to_loops else None)
        self.jobs.put(job)
        return job

    def health(self) -> dict[str, int]:
        return {"queued": self.jobs.qsize(), "running": len(self.running), **self.counters}

    def close(self) -> None:
        """Cancel queued and running jobs and stop the worker after its current step."""
        self.closed = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                self._end(job)
        for job in list(self.running.values()):
            job.cancelled.set()
        self.jobs.put(None)

    def _work(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:  # closed
                return
            if self.batched:
                self._run_batch(first)
            else:
                self._run(first)

    def _put(self, pairs: list[tuple[_Job, Any]]) -> None:
        for job, item in pairs:
            if isinstance(item, GenerationChunk) and item.finish_reason:
                job.finished = True
        self.deliver(pairs)

    def _end(self, job: _Job) -> None:
        self.counters["completed" if job.finished else "cancelled"] += 1
        self._put([(job, None)])

    def _wanted(self, job: _Job) -> bool:
        """False for a job cancelled while queued, which is ended here (the flag is read once: it
        may change meanwhile)."""
        if job.cancelled.is_set():
            self._end(job)
            return False
        return True

    def _waited(self) -> float | None:
        """Seconds the oldest queued job has waited (None: none waits)."""
        with self.jobs.mutex:  # a look at the head of the queue, which stays there
            head = self.jobs.queue[0] if self.jobs.queue else None
        return None if head is None else self.clock() - head.queued_at

    def _take(self, n: int) -> list[_Job]:
        """Up to n queued jobs that still want an answer, without waiting."""
        jobs: list[_Job] = []
        while len(jobs) < n:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # closed: leave the mark for `_work`
                self.jobs.put(None)
                break
            if self._wanted(job):
                jobs.append(job)
        return jobs

    def _run_batch(self, first: _Job) -> None:
        """One stream of the round loop, from `first` and whatever else is queued, until no row
        runs and nobody waits; before a round, queued jobs take the rows left free when
        `admission` says so."""
        admitted = 0  # jobs in this stream so far: the next one's index

        def add(jobs: list[_Job]) -> list[tuple[list[int], dict[str, Any]]]:
            nonlocal admitted
            for job in jobs:
                self.running[admitted] = job
                admitted += 1
            return [(j.input_ids, j.params) for j in jobs]

        def cancelled(i: int) -> bool:
            # The loop steps a row no more once this is true (and asks again only for an idle
            # row, whose job has ended), so the job ends here, at once.
            job = self.running.get(i)
            if job is None:
                return True
            if job.cancelled.is_set():
                self._end(self.running.pop(i))
                return True
            return False

        def admit(rows: int) -> list[tuple[list[int], dict[str, Any]]]:
            if not self.admission.due(rows, self.max_batch, self._waited()):
                return []
            return add(self._take(self.max_batch - rows))

        jobs = ([first] if self._wanted(first) else []) + self._take(self.max_batch - 1)
        if not jobs:
            return
        try:
            steps = self.generator.generate_batch(add(jobs), cancelled=cancelled, admit=admit)
            with closing(steps):
                for step in steps:
                    self._put([(self.running[i], chunk) for i, chunk in step])
                    for i, chunk in step:
                        if chunk.finish_reason:
                            self._end(self.running.pop(i))
        except Exception as e:  # reported to every request of the batch, the server keeps serving
            log.exception("batched generation failed")
            self._put([(job, e) for job in self.running.values()])
        finally:
            while self.running:
                self._end(self.running.popitem()[1])

    def _run(self, job: _Job) -> None:
        self.running[0] = job
        try:
            if not job.cancelled.is_set():
                with closing(self.generator.generate(job.input_ids, **job.params)) as chunks:
                    for chunk in chunks:
                        self._put([(job, chunk)])
                        if job.cancelled.is_set():  # client gone, or a stop string was found
                            break
        except Exception as e:  # reported to the request, the server keeps serving
            log.exception("generation failed")
            self._put([(job, e)])
        finally:
            self.running.clear()
            self._end(job)


class EngineProcess:
    """A `BatchWorker` in a process of its own, which loads the model and decodes, while this
    process serves HTTP (`dflashkit serve`). In one process, the event loop's work for every
    streamed token (parsing, JSON, detokenising, socket writes) takes the interpreter lock from the
    round loop, which for a small model is bound by the host. Here requests go to the engine's
    process through a pipe and each round's chunks come back as one message. The same surface as
    `BatchWorker` for `build_app`: `submit`, `health`, `close`. If the engine's process dies, every
    open request fails, `failed` says why, and `on_failure` is called (`run` stops the server). A
    stop signal sent to the whole process group leaves the engine's process running until the
    server closes it (`_leave_stopping_to_the_server`)."""

    def __init__(self, load: Callable[[], tuple[Served, Generator]], max_batch: int, max_queue: int,
                 admission: Admission, on_failure: Callable[[], None] = lambda: None) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_process, args=(theirs, load, max_batch, admission),
                                name="dflashkit-engine", daemon=True)
        self.proc.start()
        theirs.close()
        try:
            ready = self.conn.recv()  # after loading and warming up
        except EOFError:
            self.proc.join()
            raise RuntimeError(f"the engine process exited (code {self.proc.exitcode}) while loading") from None
        except BaseException:  # Ctrl-C while loading: the engine's process leaves stopping to us
            self.proc.kill()
            self.proc.join()
            raise
        if isinstance(ready, BaseException):
            self.proc.join()
            raise ready
        self.served: Served = ready
        self.max_queue, self.on_failure = max_queue, on_failure
        self.jobs: dict[int, _Job] = {}  # submitted and not ended, by key
        self.state = {"running": 0, "completed": 0, "cancelled": 0}  # as the engine last reported it
        self.lock = threading.Lock()  # `jobs` and the pipe's sending end
        self.next_key = 0
        self.closed = False
        self.failed: str | None = None
        self.reader = threading.Thread(target=self._read, name="dflashkit-engine-pipe", daemon=True)
        self.reader.start()

    def submit(self, input_ids: list[int], **params: Any) -> _Job:
        if self.failed or self.closed:
            raise QueueFull(self.failed or "the server is shutting down")
        waiting = len(self.jobs) - self.state["running"]
        if self.max_queue and waiting >= self.max_queue:
            raise QueueFull(f"{waiting} requests are already waiting (serve --max-queue {self.max_queue})")
        with self.lock:
            job = _Job(input_ids, params, time.monotonic(), self.next_key, asyncio.get_running_loop())
            job.on_cancel = self._cancel
            self.next_key += 1
            self.jobs[job.key] = job
            self.conn.send(("submit", job.key, input_ids, params))
        return job

    def _cancel(self, job: _Job) -> None:
        with self.lock:
            if job.key in self.jobs and not self.failed:
                self.conn.send(("cancel", job.key))

    def health(self) -> dict[str, int]:
        return {"queued": max(0, len(self.jobs) - self.state["running"]), **self.state}

    def _read(self) -> None:
        while True:
            try:
                pairs, state = self.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                self.state = state
                out = [(job, item) for key, item in pairs
                       if (job := self.jobs.pop(key, None) if item is None else self.jobs.get(key)) is not None]
            to_loops(out)
        self.proc.join(5)
        with self.lock:
            if not self.closed:
                self.failed = f"the engine process exited (code {self.proc.exitcode})"
                log.error("%s: the server stops", self.failed)
            gone = RuntimeError(self.failed or "the server is shutting down")
            out = [(job, item) for job in self.jobs.values() for item in (gone, None)]
            self.jobs.clear()
        to_loops(out)
        if self.failed:
            self.on_failure()

    def close(self) -> None:
        """Cancel every job, let the engine's process end its round and exit."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.conn.send(("close",))
            except OSError:  # already gone
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.reader.join(10)


def _leave_stopping_to_the_server() -> None:
    """In the engine's process: a stop signal is the server's to act on. Ctrl-C, systemd's stop,
    `timeout` and `kill -TERM -PGID` signal the whole process group; the server drains its
    requests, then closes this process through the pipe, so the signal must not end it first.
    If the server's process dies without closing it (SIGKILL), this process exits too."""
    from multiprocessing import parent_process
    from multiprocessing.connection import wait

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (wait([parent.sentinel]), os._exit(1)),
                         name="dflashkit-engine-orphan", daemon=True).start()


def _engine_process(conn: Any, load: Callable[[], tuple[Served, Generator]], max_batch: int,
                    admission: Admission) -> None:
    """The engine's process (`EngineProcess`): load, report ready, then run the jobs that come
    through `conn` until it says close or the server's process is gone."""
    import pickle

    def portable(item: Any) -> Any:  # an exception that cannot cross the pipe goes as its message
        if isinstance(item, Exception):
            try:
                pickle.loads(pickle.dumps(item))
            except Exception:
                return RuntimeError(f"{type(item).__name__}: {item}")
        return item

    _leave_stopping_to_the_server()
    try:
        served, generator = load()
    except Exception as e:
        conn.send(portable(e))
        return
    jobs: dict[int, _Job] = {}
    lock = threading.Lock()

    def deliver(pairs: list[tuple[_Job, Any]]) -> None:
        with lock:
            for job, item in pairs:
                if item is None:
                    jobs.pop(job.key, None)
            conn.send(([(job.key, portable(item)) for job, item in pairs], engine.health()))

    engine = BatchWorker(generator, max_batch, 0, admission, deliver=deliver)
    conn.send(served)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server's process is gone
            break
        if message[0] == "submit":
            _, key, input_ids, params = message
            with lock:
                jobs[key] = engine.submit(input_ids, key=key, **params)
        elif message[0] == "cancel":
            with lock:
                job = jobs.get(message[1])
            if job is not None:
                job.cancelled.set()
        else:
            break
    engine.close()
    engine.worker.join(30)


# ---- requests ---------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Common(BaseModel):
    # extra="allow": clients send fields we accept and ignore (user, ...); numbers must be finite.
    # strict: JSON types as OpenAI's API takes them ("temperature": "0.5", "stream": "yes" and
    # "max_tokens": 2.0 are refused, not converted); an integer is still a number.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: Int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: Int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # taken modulo 2**64
    stop: str | list[str] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int]


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


_UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "tools": None,
                "suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}


def _check_unsupported(req: Any) -> None:
    for name, default in _UNSUPPORTED.items():
        value = getattr(req, name, None) if name in type(req).model_fields else (req.model_extra or {}).get(name)
        if value not in (None, default) and not (name == "logprobs" and value is False):
            raise APIError(400, f"'{name}' = {value!r} is not supported by this server (only {default!r})", name)


def _check_text(value: Any, where: str) -> None:
    """Every string of a request must be Unicode text, which UTF-8 can encode: JSON lets a lone
    surrogate ("\\ud800") through, which no tokenizer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{where}: character {e.start} is a lone surrogate (U+{ord(value[e.start]):04X}), "
                           "not Unicode text; expected UTF-8 text", where) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


def _check_request_text(req: _Common) -> None:
    for name in [*type(req).model_fields, *(req.model_extra or {})]:
        _check_text(getattr(req, name), name)


def _chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, str]]:
    msgs = []
    for i, m in enumerate(raw):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role is {role!r}, expected system, user or assistant", f"messages[{i}].role")
        if isinstance(content, list):  # content parts: only text
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        msgs.append({"role": "system" if role == "developer" else role, "content": content})
    return msgs


# ---- the HTTP edge: the guard, disconnects, what the handlers need of the target --------------------


async def _send_json(send: Callable, status: int, message: str, kind: str, headers: tuple = ()) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """ASGI middleware run before anything is parsed: the bearer-token check (all but /health) and
    the request-body cap (declared or streamed)."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _send_json(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                        "KEY' with the key given to `serve --api-key`", "authentication_error",
                                        ((b"www-authenticate", b"Bearer"),))
        too_big = f"the request body exceeds the server's limit of {self.max_body} bytes (serve --max-body-mb)"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return await _send_json(send, 413, too_big, "invalid_request_error")
        # Read the body here (bounded), then hand it on; later receives (disconnects) pass through.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await _send_json(send, 413, too_big, "invalid_request_error")
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_after() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_after, send)


async def _cancel_on_disconnect(request: Any, job: _Job) -> None:
    """Cancel `job` once its client has disconnected. The body has been read, so the next ASGI
    message is the disconnect (or the end of the response): wait for it, rather than poll
    `is_disconnected`, whose every call opens and cancels a cancel scope."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


@dataclass(frozen=True)
class Served:
    """What the HTTP side needs of the target: its tokenizer (prompts in, text out), the model id
    clients name, the tokens that end an answer, and the context length that bounds a request."""

    tokenizer: Any
    name: str
    stop_ids: frozenset[int]
    context: int

    @classmethod
    def of(cls, target: Any, model_name: str | None = None) -> Served:
        from dflashkit.vocab import stop_token_ids

        name = model_name or (Path(target.name).name if Path(target.name).exists() else target.name)
        stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
        context = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 31)
        return cls(target.tokenizer, name, frozenset(stops), context)


# ---- the app: module-level handlers over one server state -------------------------------------------


@dataclass
class ServerState:
    """What the handlers of one app share (`app.state.dflashkit`): the target's serving facts,
    the engine, the request counters and the fault injector's period (`fail_every`), and the one
    thread that tokenises. Tokenisation (a 1 MB prompt takes seconds) runs there, off the event
    loop; one thread, as a fast tokenizer must not be used by two threads at once."""

    served: Served
    engine: BatchWorker | EngineProcess
    fail_every: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"requests": 0, "injected_failures": 0})
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="dflashkit-tokenize"))


def _state(request: Request) -> ServerState:
    return request.app.state.dflashkit


async def _off_loop(state: ServerState, fn: Callable, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_thread, fn, *args)


@asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    yield
    state: ServerState = app.state.dflashkit
    state.engine.close()  # shutdown: whatever is still queued or running is cancelled
    state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


async def _on_api_error(_request: Request, e: APIError) -> Any:
    response = _error(e.status, e.message, e.param, e.kind)
    if e.status == 503:
        response.headers["retry-after"] = "1"
    return response


async def _on_invalid_request(_request: Request, e: Any) -> Any:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    return _error(400, f"{where}: {first['msg']}", where)


async def _on_http_error(_request: Request, e: Any) -> Any:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error(e.status_code, str(e.detail), kind=kind)


async def _on_unexpected(_request: Request, e: Exception) -> Any:
    # A bug, not the request's fault: still an OpenAI-shaped body, which clients parse (the
    # traceback goes to the server's log).
    return _error(500, f"internal server error: {type(e).__name__}: {e}", kind="server_error")


async def health(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"status": "ok", "model": state.served.name, **state.counters, **state.engine.health()}


async def models(request: Request) -> dict[str, Any]:
    name = _state(request).served.name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dflashkit"}]}


async def completions(req: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    tok = state.served.tokenizer
    _check_request_text(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: {len(prompt)} prompts in one request; this server takes one", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _off_loop(state, encode, tok, prompt)
    else:
        ids = list(prompt)
        if any(not 0 <= t < len(tok) for t in ids):
            raise APIError(400, f"prompt: token ids must lie in 0..{len(tok) - 1}", "prompt")
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    return await _respond(state, request, req, ids, req.max_tokens or 16, chat=False)


async def chat_completions(req: ChatRequest, request: Request) -> Any:
    state = _state(request)
    tok = state.served.tokenizer
    _check_request_text(req)
    msgs = _chat_messages(req.messages)
    kw = dict(req.chat_template_kwargs or {})
    try:
        text = await _off_loop(state, lambda: render(tok, msgs, thinking=bool(kw.pop("enable_thinking", False)),
                                                     generation_prompt=True))
    except Exception as e:  # template errors (jinja raise_exception) are the request's fault
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
    ids = await _off_loop(state, encode, tok, text)
    return await _respond(state, request, req, ids, req.max_completion_tokens or req.max_tokens, chat=True)


def _prepare(state: ServerState, req: Any, ids: list[int], max_tokens: int | None) -> tuple[dict[str, Any], list[str]]:
    """The engine's parameters and the stop strings of a request, after its last checks (and the
    fault injector's turn)."""
    _check_unsupported(req)
    name, context = state.served.name, state.served.context
    if req.model not in (None, name):
        raise APIError(404, f"model {req.model!r} is not served here; this server serves {name!r}", "model",
                       "not_found_error")
    if len(ids) >= context:
        raise APIError(400, f"the prompt has {len(ids)} tokens; the model's context is {context}", "messages")
    if max_tokens is not None and len(ids) + max_tokens > context:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                       f"({context})", "max_tokens")
    state.counters["requests"] += 1
    if state.fail_every and state.counters["requests"] % state.fail_every == 0:
        state.counters["injected_failures"] += 1
        raise APIError(500, f"injected failure (serve --fail-every {state.fail_every})", kind="server_error")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = dict(max_new_tokens=max_tokens or context - len(ids), temperature=req.temperature, top_p=req.top_p,
                  stop_ids=state.served.stop_ids, seed=req.seed)
    return params, [s for s in stops if s]


@dataclass
class _Reply:
    """One request's answer in the making: its job, the watcher that cancels the job when the
    client leaves, its stop strings, and the fields every response object of it carries."""

    job: _Job
    watcher: asyncio.Task
    stops: list[str]
    served: Served
    base: dict[str, Any]  # id, object, created, model
    prompt_tokens: int
    chat: bool

    def usage(self, stats: dict[str, Any]) -> dict[str, Any]:
        stats = dict(stats)
        completion = stats.pop("completion_tokens", 0)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, **stats}


async def _respond(state: ServerState, request: Request, req: Any, ids: list[int], max_tokens: int | None,
                   chat: bool) -> Any:
    params, stops = _prepare(state, req, ids, max_tokens)
    kind = ("chat.completion.chunk" if req.stream else "chat.completion") if chat else "text_completion"
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
            "created": int(time.time()), "model": state.served.name}
    try:
        job = state.engine.submit(ids, **params)
    except QueueFull as e:
        raise APIError(503, f"the server is busy: {e}; retry later", kind="server_error") from None
    reply = _Reply(job, asyncio.create_task(_cancel_on_disconnect(request, job)), stops, state.served, base,
                   len(ids), chat)
    if not req.stream:
        return await _whole_response(reply)
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    return StreamingResponse(_event_stream(reply, include_usage), media_type="text/event-stream")


async def _whole_response(reply: _Reply) -> dict[str, Any]:
    parts, finish, stats = [], "length", {}
    try:
        async for text, fin, st in _texts(reply, holdback=False):
            parts.append(text)
            finish, stats = fin or finish, st or stats
    finally:
        reply.watcher.cancel()
    out = "".join(parts)
    choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish} if reply.chat
              else {"index": 0, "text": out, "finish_reason": finish, "logprobs": None})
    return {**reply.base, "choices": [choice], "usage": reply.usage(stats)}


def _event(reply: _Reply, text: str | None, finish: str | None, first: bool = False) -> str:
    if reply.chat:
        delta = ({"role": "assistant", "content": ""} if first else {} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return f"data: {json.dumps({**reply.base, 'choices': [choice]})}\n\n"


async def _event_stream(reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    try:
        if reply.chat:
            yield _event(reply, None, None, first=True)
        async for text, fin, st in _texts(reply, holdback=True):
            if text:
                yield _event(reply, text, None)
            if fin:
                yield _event(reply, None, fin)
                if include_usage:
                    yield f"data: {json.dumps({**reply.base, 'choices': [], 'usage': reply.usage(st)})}\n\n"
    except APIError as e:  # headers are sent: report in-band, as OpenAI servers do
        yield _error_event(e.message, e.kind, e.status)
    except Exception as e:  # a bug: the client still gets a JSON error and the stream's end
        log.exception("streaming failed")
        yield _error_event(f"internal server error: {type(e).__name__}: {e}", "server_error", 500)
    finally:
        reply.watcher.cancel()
        reply.job.cancel()
    yield "data: [DONE]\n\n"


def _error_event(message: str, kind: str, status: int) -> str:
    return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': status}})}\n\n"


def _merge_queued(job: _Job, first: GenerationChunk, held: list[Any]) -> tuple[list[int], str | None, dict]:
    """`first` and the chunks queued behind it, as one (token ids, finish_reason, stats): chunks
    that queued up while this client was being served go out as one event, so a server that falls
    behind sends fewer, larger events instead of falling further. An end or an error met on the
    way goes to `held`."""
    new, finish, stats = list(first.token_ids), first.finish_reason, first.stats
    while finish is None and not job.out.empty():
        more = job.out.get_nowait()
        if not isinstance(more, GenerationChunk):
            held.append(more)
            break
        new += more.token_ids
        finish, stats = more.finish_reason, more.stats
    return new, finish, stats


async def _texts(reply: _Reply, holdback: bool) -> AsyncIterator[tuple[str, str | None, dict]]:
    """(new text, finish_reason, stats) as the engine produces tokens; stop strings end the text.
    `holdback` keeps back text that could still become a stop string (streaming)."""
    job, stops, stop_ids = reply.job, reply.stops, reply.served.stop_ids
    detokenize = text_so_far(reply.served.tokenizer)
    generated = sent = 0
    keep = max((len(s) for s in stops), default=1) - 1 if holdback else 0
    held: list[Any] = []  # an end or an error taken from the queue while merging chunks
    try:
        while True:
            item = held.pop() if held else await job.out.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise APIError(500, f"generation failed: {type(item).__name__}: {item}", kind="server_error")
            new, finish, stats = _merge_queued(job, item, held)
            generated += len(new)
            text = detokenize([t for t in new if t not in stop_ids], finish is not None)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                job.cancel()
                yield text[sent:cut], "stop", {"completion_tokens": generated}
                return
            if finish:
                yield text[sent:], finish, {"completion_tokens": generated, **stats}
                return
            end = len(text) - keep
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
                end = min(end, len(text) - 1)
            if end > sent:
                yield text[sent:end], None, {}
                sent = end
    finally:
        job.cancel()


def build_app(served: Served, engine: BatchWorker | EngineProcess, *, fail_every: int = 0,
              api_key: str | None = None, max_body_bytes: int = 8 << 20) -> Any:
    """The FastAPI app over `engine` (which the app closes at shutdown). `fail_every=N` answers
    every N-th generation request with HTTP 500: a fault injector for testing clients' retries
    (`dflashkit serve --fail-every N`). `api_key`: required as a bearer token. `max_body_bytes`:
    413 beyond. Every error body is JSON, in OpenAI's shape."""
    try:
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from starlette.exceptions import HTTPException
    except ImportError as e:  # name what failed: an installed fastapi can miss a dependency of its own
        raise RuntimeError(f"the server needs fastapi and uvicorn: pip install 'dflashkit[serve]' ({e})") from None

    if api_key is not None and not api_key.strip():  # a blank key would let every request through
        raise ValueError("api_key: expected a non-empty key, or None for a server without one")
    app = FastAPI(title="dflashkit", version="1", lifespan=_lifespan)
    app.state.dflashkit = ServerState(served, engine, fail_every)
    app.add_middleware(_Guard, api_key=api_key, max_body=max_body_bytes)
    for kind, handler in ((APIError, _on_api_error), (RequestValidationError, _on_invalid_request),
                          (HTTPException, _on_http_error), (Exception, _on_unexpected)):
        app.add_exception_handler(kind, handler)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


# ---- a server in a subprocess (tests, benchmarks) ---------------------------------------------------


@contextmanager
def subprocess_server(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> Iterator[str]:
    """Run a server command (`dflashkit serve --port 0 ...`) in a subprocess for the block; yields
    the base URL (…/v1) of its 'listening on URL' line (printed by `run`), then stops it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keep draining its output so that the server never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line and not url:
                url.append(line.split("listening on", 1)[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout) or not url:
            raise RuntimeError(f"the server did not start: {' '.join(cmd)}\n" + "".join(lines[-30:]))
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- CLI --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import (DRAFT_TOKENS_HELP, add_config_options, api_key, non_negative_float,
                                    non_negative_int, port_number, positive_float, positive_int)

    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=port_number, default=8000, help="0 = any free port (the chosen one is printed)")
    p.add_argument("--model-name", help="model id clients pass as `model` (default: the target's path)")
    p.add_argument("--fail-every", type=non_negative_int, default=0, metavar="N",
                   help="testing aid: answer every N-th generation request with HTTP 500")
    p.add_argument("--drafter", metavar="DIR", help="speculative decoding with this drafter (reference format); "
                   "acceptance statistics are added to each response's usage block")
    p.add_argument("--ddtree-budget", type=positive_int, metavar="N",
                   help="with --drafter: DDTree with N nodes (default: DFlash)")
    p.add_argument("--cost-aware", action="store_true",
                   help="with --drafter: measure what verification costs at this batch size and verify only the draft "
                   "prefix that pays; draft at all only while drafting rounds give more tokens per second than "
                   "autoregressive ones (a large batch on a GPU, or a CPU, may be faster without)")
    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help="with --drafter: " + DRAFT_TOKENS_HELP)
    p.add_argument("--acceptance", choices=ACCEPTANCES, default=None,
                   help="with --drafter: how sampled requests (temperature > 0) accept drafted tokens: match (the "
                   "drafter's likeliest tokens, accepted when equal to the target's sample; default: the faster as "
                   "measured) or rejection (drafts drawn from the drafter, accepted with min(1, p/q): a higher τ, "
                   "more work a round); both exact")
    p.add_argument("--max-batch", type=positive_int, default=1, metavar="N",
                   help="decode up to N requests as one batch that requests join and leave between rounds "
                   "(continuous batching; default 1: one at a time)")
    p.add_argument("--join-min-free", type=int, metavar="N",
                   help="with --max-batch: waiting requests join the running batch together once N rows are free "
                   "(or no row runs, or --join-max-wait-ms has passed): a join pauses the running rows for a "
                   "prefill that costs about as much for one prompt as for many (default: a quarter of "
                   "--max-batch, at least 1; 1 = join at every round that has a free row)")
    p.add_argument("--join-max-wait-ms", type=float, default=100.0, metavar="MS",
                   help="with --max-batch: a request that has waited MS milliseconds joins at the next round "
                   "whatever --join-min-free says (bounds the wait it adds to time to first token; default 100)")
    p.add_argument("--engine", choices=("auto", "hf", "static"), default="auto",
                   help="decoding engine: auto = the static runner where supported (CUDA graphs and torch.compile on a GPU, "
                   "packed weights on a CPU), else Transformers")
    p.add_argument("--max-queue", type=non_negative_int, default=64, metavar="N",
                   help="requests that may wait for the engine; beyond, HTTP 503 with Retry-After (0 = no limit)")
    p.add_argument("--api-key", type=api_key, default=os.environ.get("DFLASHKIT_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $DFLASHKIT_API_KEY)")
    p.add_argument("--max-body-mb", type=positive_float, default=8.0, metavar="MB",
                   help="request body limit (HTTP 413 beyond)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=5.0, metavar="S",
                   help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are cut")
    add_config_options(p)


def admission_from_args(args: argparse.Namespace) -> Admission:
    """--join-min-free (default: max(1, --max-batch // 4)) and --join-max-wait-ms."""
    min_free = max(1, args.max_batch // 4) if args.join_min_free is None else args.join_min_free
    if min_free < 1:
        raise ValueError(f"--join-min-free {min_free}: expected N >= 1")
    if not args.join_max_wait_ms >= 0:  # inf: no time bound
        raise ValueError(f"--join-max-wait-ms {args.join_max_wait_ms}: expected MS >= 0 (inf: no time bound)")
    return Admission(min_free, args.join_max_wait_ms / 1000)


def check_drafter_options(args: argparse.Namespace) -> None:
    """Options that decide how a drafter drafts, refused without `--drafter` before anything loads
    (each option's own range is its argparse type's)."""
    drafter_only = [("--ddtree-budget", args.ddtree_budget is not None), ("--cost-aware", args.cost_aware),
                    ("--draft-tokens", args.draft_tokens is not None), ("--acceptance", args.acceptance is not None)]
    for option, given in drafter_only:
        if given and not args.drafter:
            raise ValueError(f"{option} needs --drafter DIR")


def bind_socket(host: str, port: int, api_key: str | None) -> socket.socket:
    """The server's socket, bound before the model loads (a wrong or taken address fails at once),
    listening only once the server is ready (until then a client is refused rather than kept
    waiting). Warns when other machines can reach it without an API key."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    address = sock.getsockname()[0]
    try:
        local = ipaddress.ip_address(address).is_loopback
    except ValueError:
        local = False
    if not local and not api_key:
        print(f"dflashkit serve: warning: listening on {address or 'every address'} without an API key: anyone who "
              f"can reach port {sock.getsockname()[1]} can use the model; pass --api-key KEY (or set "
              "DFLASHKIT_API_KEY), or --host 127.0.0.1", file=sys.stderr, flush=True)
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dflashkit.commands import config_from_args

    check_drafter_options(args)
    admission = admission_from_args(args)
    cfg = config_from_args(args)  # invalid settings fail here, before a process is started
    sock = bind_socket(args.host, args.port, args.api_key)
    with closing(sock):
        engine = EngineProcess(functools.partial(load_for_serving, args, cfg), args.max_batch, args.max_queue,
                               admission)
        try:
            app = build_app(engine.served, engine, fail_every=args.fail_every, api_key=args.api_key,
                            max_body_bytes=max(1, int(args.max_body_mb * 2**20)))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                   timeout_graceful_shutdown=args.shutdown_timeout))
            engine.on_failure = lambda: setattr(server, "should_exit", True)  # read when the engine fails
            server.should_exit = bool(engine.failed)  # ... or failed already
            # Listen, then announce: with --port 0 the caller learns the port, and connections made
            # before uvicorn starts accepting wait in the backlog instead of being refused.
            sock.listen(128)
            host, port = sock.getsockname()[:2]
            print(f"dflashkit serve: listening on http://{f'[{host}]' if ':' in host else host}:{port}/v1", flush=True)
            server.run(sockets=[sock])
        finally:
            engine.close()
    if engine.failed:
        raise RuntimeError(f"{engine.failed}; see its messages above")
    return 0


def load_for_serving(args: argparse.Namespace, cfg: Any) -> tuple[Served, Generator]:
    """In the engine's process: the target, the drafter and the decoding generator of `dflashkit
    serve`, warmed up."""
    from dflashkit.commands import resolve_device
    from dflashkit.target import load_target

    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype,
                         device=resolve_device(cfg.target.device))
    drafter = None
    if args.drafter:
        from dflashkit.checkpoint import load_drafter

        drafter = load_drafter(args.drafter, target, device=target.device, dtype=target.dtype)
    method = "ar" if drafter is None else "ddtree" if args.ddtree_budget else "dflash"
    generator = DecodingGenerator(make_engine(target, drafter, args.engine, args.draft_tokens), method=method, budget=args.ddtree_budget,
                                  rows=args.max_batch, cost_aware=args.cost_aware,
                                  acceptance=args.acceptance or DEFAULT_ACCEPTANCE)
    if generator.engine.fixed_rows:
        print(f"dflashkit serve: warming up ({args.max_batch} rows: compiling, capturing CUDA graphs)", flush=True)
        generator.warm_up(target.tokenizer("Hello, world!")["input_ids"])
    return Served.of(target, args.model_name), generator
