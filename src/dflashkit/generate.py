"""`dflashkit generate`: one prompt in, text and decoding statistics out."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

from dflashkit.data.chat import prompt_ids
from dflashkit.decode.generation import Sampling
from dflashkit.decode.loop import generate, make_engine
from dflashkit.decode.tree import candidates
from dflashkit.method import ACCEPTANCES, DEFAULT_ACCEPTANCE, METHODS, TOP_K, Method


def chat_ids(tokenizer: Any, prompt: str, chat: bool = True) -> Tensor:
    """[1, T] prompt ids: through the chat template (as `regenerate` prompts the target) when the
    tokenizer has one, else the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": prompt}])])
    return tokenizer(prompt, return_tensors="pt").input_ids


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import (DRAFT_TOKENS_HELP, add_config_options, non_negative_float, positive_int,
                                    probability)

    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--drafter", metavar="DIR", help="reference-format drafter directory (needed unless --method ar)")
    p.add_argument("--method", choices=METHODS, default=None, help="default: dflash with a drafter, ar without")
    p.add_argument("--budget", type=positive_int, default=32, help="DDTree node budget (default 32)")
    p.add_argument("--top-k", type=positive_int, default=TOP_K, help="DDTree candidates per slot (default: the node budget)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--acceptance", choices=ACCEPTANCES, default=DEFAULT_ACCEPTANCE,
                   help="how sampled rounds accept drafted tokens: match (the drafter's likeliest tokens, accepted "
                        "when equal to the target's sample; default: the faster as measured) or rejection (drafts "
                        "drawn from the drafter, accepted with min(1, p/q): a higher τ, more work a round); both exact")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--engine", choices=("auto", "hf", "static"), default="auto")
    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help=DRAFT_TOKENS_HELP)
    p.add_argument("--cost-aware", action="store_true",
                   help="measure what verification costs here and verify, each round, only the draft prefix that "
                        "maximises expected tokens/s (lossless either way)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.checkpoint import load_drafter
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.target import load_target
    from dflashkit.vocab import stop_token_ids

    method = Method.of(args.method or ("dflash" if args.drafter else "ar"), args.budget, args.top_k, args.acceptance)
    if method.drafts and not args.drafter:
        raise ValueError(f"--method {method.kind} needs --drafter DIR (a reference-format drafter directory)")
    if not method.drafts and args.draft_tokens is not None:
        raise ValueError("--draft-tokens needs a speculative --method (dflash or ddtree) and --drafter DIR")
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    cfg = config_from_args(args)
    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype,
                         device=resolve_device(cfg.target.device))
    drafter = load_drafter(args.drafter, target, device=target.device, dtype=target.dtype) if args.drafter else None
    engine = make_engine(target, drafter if method.drafts else None, args.engine, args.draft_tokens)
    ids = chat_ids(target.tokenizer, args.prompt, chat=not args.raw)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    res = generate(engine, ids, max_new_tokens=args.max_new_tokens, method=method, sampling=sampling, stop_ids=stops,
                   cost_aware=args.cost_aware)
    print(target.tokenizer.decode(res.tokens, skip_special_tokens=True))
    s = res.stats()
    tps = len(res.tokens) / max(res.prefill_seconds + res.decode_seconds, 1e-9)
    label = method.kind
    if method.tree_budget is not None:
        label += f" (budget {method.budget}, top-{candidates(method.budget, method.top_k, target.vocab_size)})"
    if args.draft_tokens is not None:
        label += f", {args.draft_tokens} draft tokens a round"
    if method.drafts and sampling.temperature > 0:
        label += f", {method.acceptance} acceptance"
    print(f"\n[{label}] {s['completion_tokens']} tokens in {s['rounds']} rounds, tau {s['tau']:.2f}, "
          f"{tps:.1f} tokens/s, prefill {s['prefill_seconds']:.2f}s, finish: {s['finish_reason']}"
          + (f", mean draft tokens verified {s['mean_draft_size']}" if "mean_draft_size" in s else ""))
    return 0
