"""Shared fixtures: a tiny random target for plumbing, the real SmolLM2 and Gemma 3 testbeds for behaviour."""

from __future__ import annotations

import os
from dataclasses import replace
import subprocess
import sys

import pytest
import torch

from dflashkit.decode.tree import Trees, best_first, chains
from dflashkit.drafter import DFlashDrafter, drafter_config_for_target
from dflashkit.target import Target


def in_triton_interpreter(code: str, timeout: float = 600) -> None:
    """Run `code` in a subprocess with Triton's interpreter (chosen when the kernels are defined,
    so not in this process), the tests' folder importable; fails with its stderr's tail."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]


def make_tiny_target(num_layers: int = 6, hidden: int = 64, vocab: int = 128, seed: int = 0, tie: bool = True) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return Target(LlamaForCausalLM(cfg).float(), None, name="tiny-llama")


def make_tiny_hybrid(vocab: int = 128, seed: int = 0, layers: str = "LALLAL", moe: bool = False,
                     qwen3_next: bool = False) -> Target:
    """A random Qwen3.5-style hybrid: Gated DeltaNet (L) and gated full attention (A) layers,
    partial rotary, more value heads than key heads; moe: Qwen3.5-MoE's MLP (8 routed experts, 2
    per token, and a gated shared expert) in every layer. qwen3_next: a Qwen3-Next (fused, per
    key-head grouped linear projections, plain partial rotary; experts in every layer but the third,
    a dense MLP by `mlp_only_layers`; key and value head dims differ; random norm weights, so that
    the (1 + w) conventions are exercised)."""
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3NextConfig, Qwen3NextForCausalLM)

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=len(layers), num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              tie_word_embeddings=False, layer_types=["linear_attention" if c == "L" else "full_attention" for c in layers],
              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    experts = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    if qwen3_next:
        cfg = Qwen3NextConfig(**{**kw, "linear_value_head_dim": 12}, intermediate_size=128, mlp_only_layers=[2],
                              **experts)
        model = Qwen3NextForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        return Target(model, None, name="tiny-qwen3-next")
    if moe:
        cfg = Qwen3_5MoeTextConfig(**experts, **kw)
        return Target(Qwen3_5MoeForCausalLM(cfg).float().eval(), None, name="tiny-qwen3.5-moe")
    return Target(Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=128, **kw)).float().eval(), None,
                  name="tiny-qwen3.5")


def make_tiny_drafter(target: Target, seed: int = 1, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    kw.setdefault("num_layers", 2)
    kw.setdefault("num_taps", 3)
    kw.setdefault("block_size", 8)
    return DFlashDrafter(drafter_config_for_target(target.config, mask_token_id=target.vocab_size - 1, **kw)).float()


FAMILY = {"dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
          "dspark": dict(markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True,
                         sample_from_anchor=True)}


def make_tiny_family(target: Target, kind: str, seed: int = 1, family: dict | None = None, **kw) -> DFlashDrafter:
    """A tiny drafter of the family member `kind` (its `FAMILY` fields, updated by `family`; kw as
    `make_tiny_drafter`) with every weight random: convolutions that are not the identity, a
    Markov bias that is not zero."""
    base = make_tiny_drafter(target, seed, **kw)
    drafter = DFlashDrafter(replace(base.config, **{**FAMILY[kind], **(family or {})})).float()
    drafter.load_state_dict(base.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name not in base.state_dict():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return drafter


def ragged_trees(sizes: list[int], V: int, gen: torch.Generator, slots: int = 6, top_k: int = 3) -> Trees:
    """Random best-first trees of sizes[i] nodes per row (size < 3: a chain of `slots`), padded
    to the largest with nodes that are their own parents (never accepted, seen by nothing)."""
    rows = []
    for n in sizes:
        lp, ids = torch.log_softmax(torch.randn(1, slots, V, generator=gen), -1).topk(top_k, dim=-1)
        rows.append(chains(ids[:, :, 0]) if n < 3 else best_first(lp, ids, n))
    m = max(t.size for t in rows)

    def pad(t: Trees) -> Trees:
        k = m - t.size
        own = torch.arange(t.size + 1, m + 1)[None]
        return Trees(torch.cat([t.tokens, torch.zeros(1, k, dtype=torch.long)], 1), torch.cat([t.parents, own], 1),
                     torch.cat([t.depths, torch.zeros(1, k, dtype=torch.long)], 1),
                     torch.cat([t.scores, torch.zeros(1, k)], 1))

    return Trees(*(torch.cat(x) for x in zip(*map(pad, rows))))


def children(trees: Trees, row: int) -> list[dict[int, int]]:
    """Row `row`'s tree as {token: child node} per node (padding left out)."""
    parents, tokens = trees.parents[row].tolist(), trees.tokens[row].tolist()
    kids: list[dict[int, int]] = [{} for _ in range(len(parents) + 1)]
    for i, (p, t) in enumerate(zip(parents, tokens), start=1):
        if p < i:
            kids[p][t] = i
    return kids


def node_paths(trees: Trees, row: int) -> list[tuple[int, ...]]:
    """Row `row`'s nodes as their token paths from the root, in node order."""
    parents, tokens = trees.parents[row].tolist(), trees.tokens[row].tolist()

    def path(i: int) -> tuple[int, ...]:
        out = []
        while i:
            out.append(tokens[i - 1])
            i = parents[i - 1]
        return tuple(reversed(out))

    return [path(i) for i in range(1, len(parents) + 1)]


def rows_decode_as_alone(make_engine, method: str, budget: int | None) -> list:
    """A greedy row and a sampled row decoded in one batch under the rejection rule, each checked
    against itself decoded alone (tokens and τ per round); -> the batch's generations. make_engine:
    a fresh engine each call."""
    from dflashkit.decode.generation import Sampling
    from dflashkit.decode.loop import generate, generate_batch

    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 8, 2])]
    samplings = [Sampling(), Sampling(0.8, 0.9, seed=3)]
    kw = dict(max_new_tokens=12, method=method, budget=budget, acceptance="rejection")
    batch = generate_batch(make_engine(), prompts, sampling=samplings, **kw)
    for prompt, sampling, together in zip(prompts, samplings, batch):
        alone = generate(make_engine(), prompt, sampling=sampling, **kw)
        assert (together.tokens, together.accept_lengths) == (alone.tokens, alone.accept_lengths)
    return batch


@pytest.fixture(scope="session")
def tiny_target() -> Target:
    return make_tiny_target()


@pytest.fixture(scope="session")
def smollm2() -> Target:
    from dflashkit.target import load_target

    return load_target()


@pytest.fixture(scope="session")
def gemma3() -> Target:
    from dflashkit.target import load_target

    return load_target("gemma3")


def read_late(monkeypatch) -> None:
    """Rounds read a round late, as on a GPU where the device is the slower side: the loop never
    finds a round's tokens on the host before it launches the next round."""
    from dflashkit.decode.cache import HostCopy

    monkeypatch.setattr(HostCopy, "ready", lambda self: False)
