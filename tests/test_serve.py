"""`dflashkit serve` answers the official `openai` client: plain, streaming, errors, concurrency.

One live server (a subprocess serving the real SmolLM2 testbed on an ephemeral localhost port)
for the whole module; short max_tokens keep it cheap."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from datahelpers import live_server, one_thread  # noqa: F401
from dflashkit.data.chat import prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with live_server() as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def greedy(target, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_chat_plain_and_stream(client, smollm2):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    text = r.choices[0].message.content
    want = greedy(smollm2, prompt_ids(smollm2.tokenizer, CHAT), 10)
    assert text == smollm2.tokenizer.decode(want, skip_special_tokens=True)  # exactly the target's greedy answer
    assert r.usage.prompt_tokens == len(prompt_ids(smollm2.tokenizer, CHAT))
    assert r.usage.completion_tokens == len(want) and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_plain_stream_and_seed(client, smollm2):
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    want = greedy(smollm2, smollm2.tokenizer("def fibonacci(n):")["input_ids"], 8)
    assert r.choices[0].text == smollm2.tokenizer.decode(want) and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def fibonacci(n):", max_tokens=8, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    a, b, c = (client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=s).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


def test_stop_strings(client):
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                                      stop=["return"], stream=stream)
        choices = [c.choices[0] for c in r] if stream else r.choices
        text = "".join(c.text for c in choices)
        assert "return" not in text and choices[-1].finish_reason == "stop"


def test_bad_requests(client, server):
    with pytest.raises(openai.BadRequestError, match="'n' = 2 is not supported"):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-5", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    r = httpx.post(f"{server}/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = httpx.post(f"{server}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{server}/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_concurrent_requests(client, server):
    def ask(i: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert len(set(answers)) == 1 and answers[0]  # served one at a time: no cache mix-ups
    health = httpx.get(f"{server.removesuffix('/v1')}/health").json()
    assert health["status"] == "ok" and health["queued"] == 0


def test_max_batch_dflash_concurrent_requests(smollm2):
    """`serve --drafter DIR --max-batch 4`: concurrent requests (chat, streamed chat, completion,
    sampled completion) join a batch that a long streamed request is already decoding (in either
    arrival order; the last one waits for a free row); each greedy answer is the target's own,
    and a seeded sample is the same in a batch as alone."""
    from dflashkit.demo import bundled_drafter_dir

    code = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    tok = smollm2.tokenizer
    with live_server("--drafter", str(bundled_drafter_dir()), "--max-batch", "4") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

        def streamed(n: int, started: threading.Event | None = None):
            text, usage = "", None
            for c in client.chat.completions.create(model=MODEL, messages=code, max_tokens=n, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
                text += (c.choices[0].delta.content or "") if c.choices else ""
                usage = c.usage or usage
                if text and started is not None:
                    started.set()  # its first token is out: it is decoding
            return text, usage

        def chat():
            return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)

        def completion():
            return client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=8, temperature=0)

        def sampled():
            return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)

        runs = []
        for order in (1, -1):
            started = threading.Event()
            with ThreadPoolExecutor(5) as pool:
                long = pool.submit(streamed, 40, started)
                assert started.wait(120)
                futures = [pool.submit(f) for f in (chat, lambda: streamed(12), completion, sampled)[::order]][::order]
                runs.append([long.result()] + [f.result() for f in futures])
        alone = sampled()
    assert alone.usage.model_dump()["batch_size"] == 1
    long_want = greedy(smollm2, prompt_ids(tok, code), 40)
    chat_want = greedy(smollm2, prompt_ids(tok, CHAT), 10)
    comp_want = greedy(smollm2, tok("def fibonacci(n):")["input_ids"], 8)
    for (l_text, u_long), r_chat, (text, u_stream), r_comp, r_samp in runs:
        assert l_text == tok.decode(long_want, skip_special_tokens=True)
        assert r_chat.choices[0].message.content == tok.decode(chat_want, skip_special_tokens=True)
        assert text == tok.decode(long_want[:12], skip_special_tokens=True)  # greedy: a prefix of the longer answer
        assert r_comp.choices[0].text == tok.decode(comp_want)
        assert r_samp.choices[0].text == alone.choices[0].text
        usages = [u_long.model_dump(), r_chat.usage.model_dump(), u_stream.model_dump(), r_comp.usage.model_dump(),
                  r_samp.usage.model_dump()]
        assert all(u["decoding"] == "dflash" and u["tau"] >= 1 for u in usages)
        assert max(u["batch_size"] for u in usages) > 1, "the requests were not batched"
