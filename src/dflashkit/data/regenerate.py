"""`dflashkit regenerate`: the target writes the answers the drafter will learn.

Every conversation is cut after its last user turn and answered by the target, either locally
(dflashkit's batched decoding engine) or by any OpenAI-compatible server (vLLM, SGLang,
`dflashkit serve`) with bounded concurrency, timeouts and retries.

Output: append-only JSONL, one line per answered prompt:
`{"id", "messages": context + [assistant answer], "source", "finish_reason", "prompt_tokens",
"completion_tokens", "params", "prompt_sha256", "target"}`, plus `completion_ids` (the generated
token ids, stop token included) from the local back-end, which `tokenize` uses instead of
re-encoding the answer. A re-run skips the answers already there, each keyed on its prompt's text
(`prompt_sha256`), the target's identity (`target`) and the generation settings (`params`): an
answer of another prompt text, target or setting is refused (`--overwrite` starts afresh). A line
cut by a kill is dropped and redone. A file that is not such an output (a line that is not a
record), or a link, is refused as it is, never appended to, cut or emptied. Every answer is decoded from its own prompt and its own
random stream (seeded by the id), so an interrupted run writes exactly what an uninterrupted one
writes, greedy or sampled.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import torch

from dflashkit.checkpoint import complete_lines
from dflashkit.data.chat import prompt_ids, template_sha256
from dflashkit.data.prompts import Conversation
from dflashkit.progress import progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    thinking: bool = False
    seed: int = 0


@dataclass
class RegenerateStats:
    prompts: int = 0
    already_done: int = 0
    written: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    retries: int = 0  # HTTP attempts after the first, of every request (answered or failed)
    failed: dict[str, str] = field(default_factory=dict)  # id -> last error (not written; a re-run retries them)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


def context_messages(conv: Conversation) -> list[dict]:
    """The conversation up to its last user turn: what the target answers."""
    last = max(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    return conv.messages[:last + 1]


def probe_samples(target: Any, conversations: list[Conversation], max_new_tokens: int) -> list[Any]:
    """The target's own greedy answers to `conversations` (up to their last user turn) as
    `TokenizedSample`s: probes that training replays decoding rounds on and never trains on
    (`train(probes=...)`), the offline twin of online greedy DFlash decoding of these prompts."""
    import torch

    from dflashkit.data.chat import TokenizedSample
    from dflashkit.decode.loop import generate_batch, make_engine
    from dflashkit.vocab import stop_token_ids

    ids = [prompt_ids(target.tokenizer, context_messages(c)) for c in conversations]
    gens = generate_batch(make_engine(target, None), [torch.tensor(i) for i in ids], max_new_tokens=max_new_tokens,
                          method="ar", stop_ids=stop_token_ids(target.tokenizer, target.model.generation_config))
    return [TokenizedSample(c.id, i + g.tokens, [0] * len(i) + [1] * len(g.tokens))
            for c, i, g in zip(conversations, ids, gens)]


def probe_sets(spec: str, target: Any, max_new_tokens: int, limit: int | None = None) -> dict[str, list[Any]]:
    """`train.probes`: 'suites' -> one probe per evaluation suite (its prompts, `limit` at most,
    and its answer length); else a prompt set (file, dataset or 'builtin:N') -> one probe named
    after it, answered to `max_new_tokens`."""
    from dflashkit.data.prompts import EVAL_SUITES, load_prompts, load_suite

    if spec == "suites":
        return {s.name: probe_samples(target, load_suite(s.name, limit), s.max_new_tokens) for s in EVAL_SUITES}
    return {Path(spec).stem or spec: probe_samples(target, load_prompts(spec, limit=limit), max_new_tokens)}


# ---- the append-only output ----------------------------------------------------------------------------


def prompt_sha256(context: list[dict]) -> str:
    """What the target answers, hashed: a prompt's answer is reused only for the same text."""
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()


def target_key(target: Any) -> dict[str, str]:
    """The local target's identity in a record: its config, a fingerprint of its weights and its
    chat template (what renders the prompt); `name` is informative, the rest must match."""
    from dflashkit.data.features import target_identity

    ident = target_identity(target)
    return {"name": ident["name"], "config_sha256": ident["config_sha256"],
            "weights_fingerprint": ident["weights_fingerprint"], "chat_template_sha256": template_sha256(target.tokenizer)}


@dataclass(frozen=True)
class AnswerKey:
    """What an answer in the output depends on besides its id: a resumed run keeps an answer only
    when all of it is the same."""
    params: GenerationParams
    target: dict[str, str]  # `target_key` (local) or {"served_model": name} (HTTP)
    prompts: dict[str, str]  # conversation id -> `prompt_sha256` of its context

    def mismatch(self, rec: dict) -> str | None:
        """Why `rec` is not an answer of this run (None when it is)."""
        if rec.get("params") != asdict(self.params):
            return f"written with generation params {rec.get('params')}, this run uses {asdict(self.params)}"
        have = rec.get("target")
        if not isinstance(have, dict):
            return "records no target identity, so it cannot be known which target wrote it"
        changed = sorted(k for k in self.target.keys() | have.keys() if k != "name" and have.get(k) != self.target.get(k))
        if changed:
            return (f"written by another target ({', '.join(changed)} {'differs' if len(changed) == 1 else 'differ'}: "
                    f"{have.get('name', '?')!r} then, "
                    f"{self.target.get('name', '?')!r} now)")
        want = self.prompts.get(rec["id"])
        if want is not None and rec.get("prompt_sha256") != want:
            return f"answers another text of prompt {rec['id']!r} (its messages changed since)"
        return None


# How `_write` begins every record: a last line a kill cut short begins so too.
RECORD_START = b'{"id": '


def _is_record(line: bytes, cut_short: bool) -> bool:
    """Whether `line` is a record of regenerate's output (`cut_short`: the last line, without its
    newline, which may be one that a kill cut)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return cut_short and (line.startswith(RECORD_START) or RECORD_START.startswith(line))
    return isinstance(rec, dict) and isinstance(rec.get("id"), str) and {"messages", "params"} <= rec.keys()


def _check_own(f: BinaryIO, path: Path) -> None:
    """Refuse a file that is not regenerate's output before anything in it is cut or emptied."""
    f.seek(0)
    for lineno, line in enumerate(f, 1):
        if line.strip() and not _is_record(line, cut_short=not line.endswith(b"\n")):
            raise ValueError(f"{path}:{lineno}: not a regenerate record (expected JSON with 'id', 'messages' and "
                             "'params'), so the file is not this command's output, which regenerate appends to "
                             "and --overwrite empties: write to another --out, or fix or remove the line")


def _open_no_link(path: Path) -> int:
    """The file's descriptor for reading and appending, created if missing; a link is refused."""
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ValueError(f"{path}: a symbolic link; regenerate writes its output file itself, never through a link: "
                         "give the path it points to, or another --out") from None


@contextmanager
def open_output(path: str | Path, key: AnswerKey, *, overwrite: bool = False) -> Iterator[tuple[TextIO, set[str]]]:
    """Open the JSONL for appending; yield it and the ids already answered.

    An incomplete last line (a kill during a write) is cut off. The file is locked: two runs
    appending to it at once would duplicate work. A line written for another prompt text, by
    another target or with other generation parameters is an error: one file, one recipe
    (`overwrite` empties the file instead). A file that is not regenerate's output, or a link, is
    refused, with or without `overwrite`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(_open_no_link(path), "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{path} is being written by another `regenerate` run") from None
        _check_own(f, path)
        if overwrite:
            f.truncate(0)
        done: set[str] = set()
        for lineno, line in complete_lines(f, path):
            if not line.strip():
                continue
            rec = json.loads(line)
            done.add(rec["id"])
            why = key.mismatch(rec)
            if why:
                raise ValueError(f"{path}:{lineno}: {why}; start afresh with --overwrite, or write to another --out")
        with open(f.fileno(), "a", encoding="utf-8", closefd=False) as out:
            try:
                yield out, done
            finally:
                out.flush()
                os.fsync(out.fileno())


def _write(out: TextIO, conv: Conversation, context: list[dict], answer: str, finish: str, prompt_tokens: int,
           completion_tokens: int, key: AnswerKey, completion_ids: list[int] | None = None) -> None:
    rec = {"id": conv.id, "messages": context + [{"role": "assistant", "content": answer}], "source": conv.source,
           "finish_reason": finish, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "params": asdict(key.params), "prompt_sha256": key.prompts[conv.id], "target": key.target}
    if completion_ids is not None:
        rec["completion_ids"] = completion_ids
    out.write(json.dumps(rec, ensure_ascii=False) + "\n")  # one write per line: a kill cuts at most this line
    out.flush()


def answer_key(conversations: list[Conversation], params: GenerationParams, target: dict[str, str]) -> AnswerKey:
    return AnswerKey(params, target, {c.id: prompt_sha256(context_messages(c)) for c in conversations})


# ---- local back-end ---------------------------------------------------------------------------------


def regenerate_local(target: Any, conversations: list[Conversation], out_path: str | Path, params: GenerationParams,
                     *, batch_size: int = 8, engine: str = "auto", overwrite: bool = False) -> RegenerateStats:
    """Answer with the target itself, `batch_size` prompts at a time, on dflashkit's decoding
    engine (autoregressive rounds; on a GPU the static engine with CUDA graphs). On an engine with
    fixed rows (CUDA graphs) a finished row takes the next prompt at once (`loop.finished`; on an
    H200, 1.66x the tokens/s of whole batches, docs/benchmarks.md), and each answer is written as
    it ends; elsewhere whole batches, each re-run whole after an interruption, so that its
    batched numerics do not depend on where an earlier run stopped. Each answer samples from its
    own random stream, seeded by `params.seed` and the conversation id, so an answer does not
    depend on which prompts share its batch (up to the rounding of batched kernels). Answers already
    in `out_path` are kept only when written for the same prompt texts, target and `params`;
    `overwrite` starts the file afresh."""
    from dflashkit.decode.generation import Generation, Sampling
    from dflashkit.decode.loop import finished, make_engine
    from dflashkit.vocab import stop_token_ids

    tok = target.tokenizer
    stats = RegenerateStats(prompts=len(conversations))
    key = answer_key(conversations, params, target_key(target))
    with open_output(out_path, key, overwrite=overwrite) as (out, done):
        stats.already_done = sum(c.id in done for c in conversations)
        if stats.already_done == len(conversations):  # e.g. a --data-only run's answers: no engine to build
            return stats
        stops = set(stop_token_ids(tok, getattr(target.model, "generation_config", None)))
        decoder = make_engine(target, None, engine)
        contexts = [context_messages(c) for c in conversations]
        ids = [prompt_ids(tok, m, thinking=params.thinking) for m in contexts]
        # Longest first: little padding, and an out-of-memory shows at once. Whole batches: the plan
        # covers every prompt, done or not, and a batch re-runs whole, so that batches (and thus the
        # numerics of batched kernels) do not depend on where an earlier run stopped.
        order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
        plan = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        bar = progress(total=len(conversations), initial=stats.already_done, desc="regenerate", unit="prompt")
        t0 = time.perf_counter()

        def decode(prompts: list[int], **kw: Any) -> Iterator[tuple[int, Generation]]:
            sampling = [Sampling(params.temperature, params.top_p, seed=zlib.crc32(f"{params.seed}:{conversations[i].id}".encode()))
                        for i in prompts]
            kw.update(method="ar", max_new_tokens=params.max_new_tokens, sampling=sampling, stop_ids=stops)
            return finished(decoder, [torch.tensor(ids[i]) for i in prompts], **kw)

        if decoder.fixed_rows:
            todo = [i for i in order if conversations[i].id not in done]
            answers = ((todo[j], g) for j, g in decode(todo, rows=batch_size, refill=0))
        else:
            answers = ((batch[j], g) for batch in plan if not all(conversations[i].id in done for i in batch)
                       for j, g in decode(batch))
        for i, g in answers:
            if conversations[i].id in done:
                continue
            row = g.tokens  # the stop token, if any, is the last one
            stopped = g.finish_reason == "stop"
            answer = tok.decode(row[:-1] if stopped else row, skip_special_tokens=True)
            _write(out, conversations[i], contexts[i], answer, g.finish_reason, len(ids[i]), len(row), key, row)
            stats.written += 1
            stats.completion_tokens += len(row)
            bar.update(1)
        stats.seconds = time.perf_counter() - t0
        bar.close()
    return stats


# ---- HTTP back-end ----------------------------------------------------------------------------------


class RequestFailed(RuntimeError):
    def __init__(self, message: str, retries: int = 0) -> None:
        super().__init__(message)
        self.retries = retries  # attempts after the first one


def post_with_retries(client: Any, url: str, body: dict, *, retries: int, backoff: float, timeout: float) -> tuple[dict, int]:
    """POST JSON; retry what never reached the server or that it refused (connection errors and
    timeouts, 408/429/5xx) with exponential backoff and jitter (or the server's Retry-After).
    Not retried: other 4xx (a retry cannot fix them) and a read timeout (the request was sent
    and the server may still be computing it: a retry would queue a duplicate behind it).
    Returns (response JSON, number of retries); `RequestFailed.retries` counts them on failure."""
    import httpx

    err = ""
    for attempt in range(retries + 1):
        wait_s = backoff * 2 ** attempt * (0.5 + random.random())
        try:
            r = client.post(url, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            raise RequestFailed(f"no answer within {timeout}s; not retried, as the server may still be computing "
                                "it (raise --timeout for long answers)", attempt) from None
        except httpx.TimeoutException:
            err = f"timed out after {timeout}s"
        except httpx.TransportError as e:
            err = f"{type(e).__name__}: {e}"
        else:
            if r.status_code == 200:
                return r.json(), attempt
            err = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code < 500 and r.status_code not in (408, 429):
                raise RequestFailed(err, attempt)
            if r.headers.get("retry-after", "").isdigit():
                wait_s = float(r.headers["retry-after"])
        if attempt < retries:
            time.sleep(wait_s)
    raise RequestFailed(f"gave up after {retries + 1} attempts; last error: {err}", retries)


def served_model(client: Any, base_url: str, timeout: float) -> str:
    """The first model the server lists (GET /v1/models); also checks that it is up."""
    import httpx

    try:
        r = client.get(f"{base_url}/models", timeout=timeout)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"{base_url}/models: cannot list the served models ({e}); is the server up? "
                           "Pass --model to skip this check") from None


def regenerate_http(base_url: str, conversations: list[Conversation], out_path: str | Path, params: GenerationParams,
                    *, model: str | None = None, concurrency: int = 8, timeout: float = 300.0, retries: int = 5,
                    backoff: float = 1.0, api_key: str | None = None, overwrite: bool = False) -> RegenerateStats:
    """Answer through an OpenAI-compatible `/v1/chat/completions`, `concurrency` requests in flight.

    `base_url` ends with `/v1`. A prompt that still fails after its retries is listed in
    `stats.failed` and not written; a re-run retries it. The served model's name stands for the
    target's identity in the records (a server cannot show its weights)."""
    try:
        import httpx
    except ImportError:
        raise RuntimeError("the HTTP back-end needs httpx: pip install 'dflashkit[serve]'") from None

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key or os.environ.get('OPENAI_API_KEY', 'none')}"}
    stats = RegenerateStats(prompts=len(conversations))
    with httpx.Client(headers=headers, limits=httpx.Limits(max_connections=concurrency)) as client:
        model = model or served_model(client, base_url, timeout)
        key = answer_key(conversations, params, {"served_model": model})

        def ask(conv: Conversation) -> tuple[dict, int]:
            body = {"model": model, "messages": context_messages(conv), "max_tokens": params.max_new_tokens,
                    "temperature": params.temperature, "top_p": params.top_p,
                    "seed": params.seed + zlib.crc32(conv.id.encode()),  # reproducible per prompt
                    "chat_template_kwargs": {"enable_thinking": params.thinking}}
            return post_with_retries(client, f"{base_url}/chat/completions", body, retries=retries,
                                     backoff=backoff, timeout=timeout)

        with open_output(out_path, key, overwrite=overwrite) as (out, done), ThreadPoolExecutor(concurrency) as pool:
            _ask_all(ask, pool, concurrency, out, done, key, conversations, stats)
    return stats


def _ask_all(ask: Callable[[Conversation], tuple[dict, int]], pool: ThreadPoolExecutor, concurrency: int, out: TextIO,
             done: set[str], key: AnswerKey, conversations: list[Conversation], stats: RegenerateStats) -> None:
    """`ask` every prompt not in `done` on `pool`, writing the answers as they come."""
    todo = [c for c in conversations if c.id not in done]
    stats.already_done = len(conversations) - len(todo)
    bar = progress(total=len(conversations), initial=stats.already_done, desc="regenerate", unit="prompt")
    t0 = time.perf_counter()
    pending: dict[Future, Conversation] = {}
    queue = iter(todo)
    while True:
        # Bounded: at most 2x concurrency futures exist, whatever the number of prompts.
        for conv in queue:
            pending[pool.submit(ask, conv)] = conv
            if len(pending) >= 2 * concurrency:
                break
        if not pending:
            break
        finished, _ = wait(pending, return_when=FIRST_COMPLETED)
        for fut in finished:
            conv = pending.pop(fut)
            try:
                resp, n_retries = fut.result()
                choice, usage = resp["choices"][0], resp.get("usage") or {}
                answer = choice["message"].get("content") or ""
                reasoning = choice["message"].get("reasoning_content")
                if reasoning:  # servers with a reasoning parser split the thinking off
                    answer = f"<think>\n{reasoning}\n</think>\n\n{answer}"
            except (RequestFailed, KeyError, IndexError, TypeError, ValueError) as e:
                stats.retries += getattr(e, "retries", 0)
                stats.failed[conv.id] = str(e)
                log.warning("prompt %s failed: %s", conv.id, e)
                continue
            finish = choice.get("finish_reason") or "stop"
            n = int(usage.get("completion_tokens", 0))
            _write(out, conv, context_messages(conv), answer, finish, int(usage.get("prompt_tokens", 0)), n, key)
            stats.written += 1
            stats.retries += n_retries
            stats.completion_tokens += n
            bar.update(1)
    stats.seconds = time.perf_counter() - t0
    bar.close()


# ---- CLI ------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options, http_url, non_negative_int, positive_float, positive_int

    p.add_argument("--out", metavar="JSONL", help="output file (default: data.regenerated)")
    p.add_argument("--backend", choices=["local", "http"], default="local",
                   help="local: Transformers generate on the target; http: an OpenAI-compatible server")
    p.add_argument("--url", type=http_url, default="http://127.0.0.1:8000/v1", help="http back-end: base URL, ending in /v1")
    p.add_argument("--model", help="http back-end: model name (default: the first the server lists)")
    p.add_argument("--concurrency", type=positive_int, default=8, help="http back-end: requests in flight")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="http back-end: seconds per request")
    p.add_argument("--retries", type=non_negative_int, default=5,
                   help="http back-end: retries per request (backoff 1s, 2s, 4s...)")
    p.add_argument("--overwrite", action="store_true",
                   help="start the output afresh (a run resumes only answers of the same prompts, target and settings)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.data.prompts import load_prompts_report

    cfg = config_from_args(args)
    d = cfg.data
    out = args.out or d.regenerated
    if not out:
        raise ValueError("regenerate needs an output file: --out PATH or data.regenerated=PATH")
    params = GenerationParams(max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_p=d.top_p,
                              thinking=d.thinking, seed=d.seed)
    if args.backend == "local":
        from dflashkit.data.selfprompts import spec_for, writer
        from dflashkit.target import load_target

        spec = spec_for(d.prompts, d.self_prompts)
        target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype,
                             device=resolve_device(cfg.target.device))
        # self-written prompts keep their progress beside the answers: a re-run resumes both
        write = writer(target, d.batch_size, d.seed, keep=Path(out).parent, spec=spec)
        convs, problems = load_prompts_report(d.prompts, limit=d.limit, writer=write)
        stats = regenerate_local(target, convs, out, params, batch_size=d.batch_size, overwrite=args.overwrite)
    else:
        convs, problems = load_prompts_report(d.prompts, limit=d.limit)
        stats = regenerate_http(args.url, convs, out, params, model=args.model, concurrency=args.concurrency,
                                timeout=args.timeout, retries=args.retries, overwrite=args.overwrite)
    print(f"{out}: {stats.written} answers written, {stats.already_done} already there, {len(stats.failed)} failed; "
          f"{stats.completion_tokens} tokens in {stats.seconds:.1f}s ({stats.tokens_per_s:.1f} tokens/s)"
          + (f", {stats.retries} retries" if args.backend == "http" else "")
          + (f"; {len(problems)} malformed prompt records skipped (first: {problems[0]})" if problems else ""))
    if stats.failed:
        print(f"failed ids (re-run to retry them): {', '.join(sorted(stats.failed)[:20])}"
              + (" ..." if len(stats.failed) > 20 else ""))
        return 1
    return 0
