"""`dflashkit <stage>`: one command per pipeline stage (docs/architecture.md).

Each stage lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their command runs, so `dflashkit --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from dflashkit import versions

# command -> (module, one-line help). Order follows the pipeline.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dflashkit.demo", "the main job on the embedded SmolLM2 default: regenerate, extract, train, evaluate, report"),
    "config": ("dflashkit.commands", "print the default configuration (YAML), with overrides applied"),
    "draft": ("dflashkit.commands", "load a target, draft one block for a prompt with a (possibly untrained) drafter"),
    "regenerate": ("dflashkit.data.regenerate", "the target answers the prompts (local Transformers or an OpenAI-compatible server), resumable JSONL"),
    "tokenize": ("dflashkit.data.chat", "apply the chat template: token ids + assistant-only loss masks (JSONL)"),
    "extract": ("dflashkit.data.features", "target features of tokenized samples: sharded safetensors (bf16 or fp8) + manifest"),
    "check-features": ("dflashkit.data.check", "compare two feature sources (caches, targets on other devices/dtypes) per layer"),
    "train": ("dflashkit.train", "train a drafter: DFlash recipe, one GPU or torchrun (DDP / FSDP2), resumable, tau_sim while training"),
    "eval": ("dflashkit.evaluate", "acceptance length and speed-up of drafters: online (DFlash + DDTree budgets, vs autoregressive) or offline from cached features"),
    "doctor": ("dflashkit.doctor", "check a drafter against a target (and training data against evaluation) before training or serving"),
    "export": ("dflashkit.export", "write a drafter for serving engines: reference format (+ dflash.py) or vLLM speculators"),
    "generate": ("dflashkit.generate", "one prompt in, text and decoding statistics out (speculative DFlash / DDTree or autoregressive)"),
    "serve": ("dflashkit.serve", "OpenAI-compatible HTTP server over the target (completions, chat, streaming); speculative with --drafter, batched with --max-batch"),
}


def _handler(module: str, command: str):
    """(add_arguments, run) of a command: `<cmd>_arguments`/`run_<cmd>` when a module holds
    several commands, else the module's `add_arguments`/`run`."""
    mod = importlib.import_module(module)
    name = command.replace("-", "_")
    return (getattr(mod, f"{name}_arguments", None) or mod.add_arguments,
            getattr(mod, f"run_{name}", None) or mod.run)


class Parser(argparse.ArgumentParser):
    """A usage error (an unknown option, a value its type refuses) is bad input like any other:
    one line naming the option, exit status 1; 2 stays the status of a bug."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


# `section.field=value`: a config override, wherever it stands among the options.
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures that bad input, files or the environment cause: one line, no traceback. Their
    messages name the file/field (raised so at the source); anything else is a bug."""
    import yaml
    from pydantic import ValidationError
    from safetensors import SafetensorError

    return (ValueError, OSError, RuntimeError, ImportError, json.JSONDecodeError, yaml.YAMLError, ValidationError,
            SafetensorError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not sys.stderr.isatty():
        # Off a terminal, Hugging Face's bars (loading weights) would fill a log with carriage
        # returns; dflashkit's own stages log their progress lines (progress.py).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [a for a in argv if a != "--debug"]
    parser = Parser(
        prog="dflashkit",
        description="Train, evaluate and serve DFlash block-diffusion drafters for speculative decoding.",
        epilog="Run `dflashkit COMMAND --help` for a command's options.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-V", "--version", action="version", version=versions(),
                        help="dflashkit's version and the torch and transformers it runs on")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, description=help_).set_defaults(_module=module)
    # Only the chosen command's module is imported to add its arguments.
    cmd = next((a for a in argv if a in COMMANDS), None)
    if cmd is not None:
        add, _ = _handler(COMMANDS[cmd][0], cmd)
        add(sub.choices[cmd])
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`... target.path=x --out y data.prompts=z`): argparse leaves
    # those after an option unparsed; they join the command's overrides.
    late = [a for a in extra if _OVERRIDE.match(a)]
    if late and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *late]
        extra = [a for a in extra if a not in late]
    if extra:
        (sub.choices[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    _, run = _handler(args._module, args.command)
    from dflashkit.progress import interval_seconds

    try:
        interval_seconds()  # a bad DFLASHKIT_PROGRESS_SECONDS fails before any work, not at the first bar
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"dflashkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(getattr(e, "exit_code", None), int):  # a job that a signal stopped after saving its work
            print(f"dflashkit {args.command}: {e}", file=sys.stderr)
            return e.exit_code
        if debug:
            raise
        if isinstance(e, expected_errors()):
            print(f"dflashkit {args.command}: error: {e}", file=sys.stderr)
            return 1
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"dflashkit {args.command}: internal error: {type(e).__name__}: {e} (at {Path(where.filename).name}:"
              f"{where.lineno}); this is a bug: re-run with --debug for the traceback and report it", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
