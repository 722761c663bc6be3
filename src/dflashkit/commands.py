"""Small commands that belong to no single pipeline stage."""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any, Callable

import torch


def add_config_options(p: argparse.ArgumentParser) -> None:
    """`--config FILE` plus trailing `section.field=value` overrides, shared by config-driven commands."""
    p.add_argument("--config", metavar="FILE", help="YAML config (sections: target, drafter, data, train, eval)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="override a config field")
    p.epilog = p.epilog or "Every config field with its default and meaning: `dflashkit config` (> my.yaml to start one)."


def config_from_args(args: argparse.Namespace):
    from dflashkit.config import load_config

    return load_config(args.config, args.overrides)


DRAFT_TOKENS_HELP = ("tokens drafted a round (default: the drafter's block_size - 1, 15 for the bundled drafter); fewer "
                     "cost less to draft and verify and can pay where a round's cost grows with its tokens, e.g. 7 "
                     "from batch 32 on a GPU (docs/serving.md, Draft length)")


def _checked(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Any:
    """`convert(text)` if it converts and passes `ok`; else argparse's usage error, which names the
    option: `argument --timeout: expected a finite number > 0, got 'nan'`."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count >= 1 (`--draft-tokens N`: the drafter's block bounds it when it loads)."""
    return _checked(text, int, lambda n: n >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type of a count >= 0 (`--retries`)."""
    return _checked(text, int, lambda n: n >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type of a finite amount > 0 (seconds, sizes): not 0, not nan, not inf."""
    return _checked(text, float, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """argparse type of a finite amount >= 0 (`--temperature`)."""
    return _checked(text, float, lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")


def port_number(text: str) -> int:
    """argparse type of a TCP port (`serve --port`)."""
    return _checked(text, int, lambda n: 0 <= n <= 65535, "a port number 0..65535 (0: any free port)")


def probability(text: str) -> float:
    """argparse type of a probability mass in (0, 1] (`--top-p`)."""
    return _checked(text, float, lambda x: 0 < x <= 1, "a number in (0, 1]")


def http_url(text: str) -> str:
    """argparse type of a server's base URL (`--url http://host:8000/v1`)."""
    return _checked(text, str, lambda u: bool(re.fullmatch(r"https?://[^/\s]+(/\S*)?", u)),
                    "an http:// or https:// URL such as http://127.0.0.1:8000/v1")


def api_key(text: str) -> str:
    """argparse type of `serve --api-key` (also applied to its default, $DFLASHKIT_API_KEY): a key
    that is not blank, as a blank one would turn authentication off without a word."""
    return _checked(text, str, lambda k: bool(k.strip()), "a non-empty key (to serve without one, leave out "
                    "--api-key and unset DFLASHKIT_API_KEY)")


def cosine(text: str) -> float:
    """argparse type of a cosine similarity in [-1, 1] (`--min-cosine`)."""
    return _checked(text, float, lambda x: -1 <= x <= 1, "a number in [-1, 1]")


def budget_list(text: str) -> list[int]:
    """argparse type of `--budgets 8,16,32`: DDTree node budgets, each >= 1."""
    try:
        budgets = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated node budgets such as 8,16,64, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"node budgets must be integers >= 1, got {text!r}")
    return budgets


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plain", action="store_true", help="the YAML alone, without each field's meaning as a comment")
    add_config_options(p)


def run_config(args: argparse.Namespace) -> int:
    from dflashkit.config import dump_config

    print(dump_config(config_from_args(args), comments=not args.plain), end="")
    return 0


def draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    p.add_argument("--drafter", metavar="DIR", help="reference-format drafter directory (default: a fresh, untrained one)")
    add_config_options(p)


def run_draft(args: argparse.Namespace) -> int:
    """Prefill the prompt, draft one block, and compare with the target's own greedy tokens."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.decode.engine import Engine
    from dflashkit.drafter import new_drafter
    from dflashkit.target import load_target

    cfg = config_from_args(args)
    t0 = time.perf_counter()
    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype,
                         device=resolve_device(cfg.target.device))
    drafter = load_drafter(args.drafter, target) if args.drafter else new_drafter(target, cfg.drafter)
    drafter = drafter.to(device=target.device, dtype=target.dtype)
    print(f"target {target.name}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size} "
          f"(loaded in {time.perf_counter() - t0:.1f}s)")
    dc = drafter.config
    print(f"drafter: {dc.num_hidden_layers} layers, taps {dc.target_layer_ids}, block {dc.block_size}, "
          f"mask token {dc.mask_token_id} ({target.tokenizer.convert_ids_to_tokens(dc.mask_token_id)!r}), "
          f"{drafter.num_parameters() / 1e6:.1f}M parameters{'' if args.drafter else ' (untrained)'}")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"].to(target.device)
    with torch.no_grad():
        # The engine drafts as decoding does, whatever the drafter's kind (DFlash 2's walk, DSpark's
        # Markov chain); the prompt's features go to the drafter, the bonus token is the block's anchor.
        engine = Engine(target, drafter)
        bonus = engine.prefill([ids[0]], ids.shape[1] + 2 * dc.block_size).argmax(-1)
        draft = engine.draft(bonus).trees.tokens
        greedy = target.model.generate(ids, max_new_tokens=draft.shape[1] + 1, do_sample=False)[:, ids.shape[1]:]
    accepted = int((draft[0] == greedy[0, 1:]).long().cumprod(0).sum())
    dec = target.tokenizer.decode
    print(f"target greedy : {dec(greedy[0])!r}")
    print(f"drafted block : {dec(bonus)!r} + {dec(draft[0])!r}")
    print(f"acceptance length of this block: {accepted + 1} (bonus token included)")
    return 0
