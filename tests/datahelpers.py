"""Test helpers for the data pipeline and the server: a tiny random target saved with SmolLM2's
tokenizer (fast plumbing with a real chat template), and a live `dflashkit serve` subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dflashkit.serve import subprocess_server

# Test process and child processes share the machine's cores; one thread each avoids the
# oversubscription that makes 2-thread torch several times slower on a busy 2-core box.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Torch on one thread in this process for a module: with 2 threads on a 2-core machine that
    is busy (other processes, our own server/CLI children), small-model work runs 5-20x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_tiny_target(path: Path, num_layers: int = 4, hidden: int = 32, seed: int = 0, context: int = 1024,
                     hybrid: bool = False, moe: bool = False, qwen3_next: bool = False) -> Path:
    """A random Llama (or, hybrid: a Qwen3.5-style model whose layers alternate Gated DeltaNet and
    full attention; moe: with Qwen3.5-MoE's experts as MLPs; qwen3_next: a Qwen3-Next of the same
    layers, experts in all but its first layer) with SmolLM2's vocabulary and tokenizer (chat
    template included)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

    from dflashkit.data.chat import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    linear = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, tie_word_embeddings=True,
                  layer_types=["linear_attention", "full_attention"] * (num_layers // 2))
    if qwen3_next:
        cfg = Qwen3NextConfig(**common, **linear, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                              shared_expert_intermediate_size=hidden, num_experts=4, num_experts_per_tok=2,
                              mlp_only_layers=[0])
        Qwen3NextForCausalLM(cfg).save_pretrained(path)
    elif moe:
        cfg = Qwen3_5MoeTextConfig(**common, **linear, moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                                   num_experts=4, num_experts_per_tok=2)
        Qwen3_5MoeForCausalLM(cfg).save_pretrained(path)
    elif hybrid:
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, **linear, intermediate_size=2 * hidden)).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(**common, intermediate_size=2 * hidden, tie_word_embeddings=True)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflashkit.cli", *args], capture_output=True, text=True,
                          env={**CHILD_ENV, **(env or {})}, timeout=timeout)


def run_cli_logged(log: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> int:
    """`dflashkit ARGS > log 2>&1`: stdout and stderr into one file (not a terminal); the exit code."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "dflashkit.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              env={**CHILD_ENV, **(env or {})}, timeout=timeout).returncode


def start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflashkit.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)


@contextmanager
def live_server(*args: str, timeout: float = 180):
    """`dflashkit serve --port 0 ARGS` in a subprocess; yields its base URL (…/v1)."""
    with subprocess_server([sys.executable, "-m", "dflashkit.cli", "serve", "--port", "0", *args], CHILD_ENV,
                           timeout) as url:
        yield url


def wait_until(done, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll `done()` until it holds or the process ends; return its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if done():
            return True
        time.sleep(0.02)
    return bool(done())
