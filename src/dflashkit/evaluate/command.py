"""`dflashkit eval`: the command line over online, offline and suite evaluation."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflashkit import versions
from dflashkit.decode.generation import Sampling
from dflashkit.evaluate.offline import evaluate_offline, heldout_items, load_target_head
from dflashkit.evaluate.online import eval_prompts, evaluate_online
from dflashkit.evaluate.partings import check_partings
from dflashkit.evaluate.report import markdown, training_tau_sim, write_report
from dflashkit.evaluate.suites import evaluate_suites
from dflashkit.evaluate.summary import method_labels
from dflashkit.method import ACCEPTANCES, DEFAULT_ACCEPTANCE
from dflashkit.rundir import output_directory

log = logging.getLogger("dflashkit.evaluate")

ONLINE_ONLY = ("prompts", "suites", "max_new_tokens", "temperature", "top_p", "seed", "engine", "draft_tokens",
               "repeats", "acceptance")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import DRAFT_TOKENS_HELP, add_config_options, budget_list, positive_int

    p.add_argument("--drafter", action="append", default=[], metavar="[NAME=]DIR",
                   help="reference-format drafter directory (ours or published); repeat to compare several")
    p.add_argument("--features", metavar="DIR", help="offline mode: a feature cache (`dflashkit extract`); no target layers run")
    p.add_argument("--out", metavar="DIR", default="runs/eval", help="report directory (default runs/eval)")
    p.add_argument("--methods", default="dflash,ddtree", help="comma list of dflash, ddtree (default both)")
    p.add_argument("--budgets", default=None, type=budget_list,
                   help="DDTree node budgets, comma list (default eval.ddtree_budgets)")
    p.add_argument("--top-k", type=int, default=None, help="DDTree candidates per slot (default eval.ddtree_top_k: the node budget)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="prompts per suite or of --prompts (online), or samples (offline)")
    p.add_argument("--heldout", action="store_true", help="offline mode: only the held-out split that `train` "
                   "measures tau_sim on (train.eval_samples, train.seed): a before/after report for fine-tuning")
    g = p.add_argument_group("online mode only")
    g.add_argument("--suites", default=None, help="comma list of evaluation suites (default eval.suites: "
                   "humaneval,code,math,chat,multiturn), each with its own prompt count and answer length")
    g.add_argument("--prompts", default=None, help="one prompt set instead of the suites: humaneval, builtin, a "
                   "JSONL/JSON/Parquet file or a datasets name (default eval.prompts)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="answer length with --prompts (suites have theirs)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (outputs checked against autoregressive)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--acceptance", type=acceptance_list, default=None, metavar="RULES",
                   help="sampled decoding's acceptance rules, comma list of match (the drafter's likeliest tokens, "
                        "accepted when equal to the target's sample: what an engine verifying without the drafter's "
                        "probabilities gets; default) and rejection (drafts drawn from the drafter, accepted with "
                        "min(1, p/q); rows '+rejection')")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--engine", choices=("auto", "hf", "static"), default=None)
    g.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help=DRAFT_TOKENS_HELP)
    g.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                   help="turns of every method per prompt, each timed by its fastest (default 1): speed-ups "
                   "steadier on a machine with other load, at N times the decoding")
    g.add_argument("--cost-aware", action="store_true", help="also run every method cost-aware ('+cost' rows): "
                   "the draft prefix verified each round is chosen from the measured verification cost")
    g.add_argument("--resume", action="store_true", help="suites: reuse those an earlier run of the same command "
                   "finished (saved in OUT/suites/, used only where drafters, prompts and settings match)")
    add_config_options(p)


def acceptance_list(text: str) -> list[str]:
    """--acceptance: a comma list of `method.ACCEPTANCES`, each once."""
    rules = [r.strip() for r in text.split(",") if r.strip()]
    if not rules or any(r not in ACCEPTANCES for r in rules) or len(set(rules)) != len(rules):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(ACCEPTANCES)}, each once; got {text!r}")
    return rules


def parse_drafters(specs: list[str]) -> dict[str, Path]:
    """'[NAME=]DIR' -> {name: dir}, each checked to hold a readable drafter config."""
    from dflashkit.checkpoint import load_config

    if not specs:
        raise ValueError("eval needs at least one --drafter DIR (a reference-format drafter directory: config.json + model.safetensors)")
    out: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"--drafter {spec}: {path} is not a directory")
        load_config(path)  # a broken config.json fails here, before any model is loaded
        name = name or path.name
        while name in out:
            name += "'"
        out[name] = path
    return out


def _pick(arg: Any, default: Any) -> Any:
    """A command-line value when given, else the config's."""
    return arg if arg is not None else default


def decoding_settings(args: argparse.Namespace, ec: Any) -> dict[str, Any]:
    """--methods, --budgets and --top-k, checked before any model is loaded."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = args.budgets or list(ec.ddtree_budgets)
    top_k = args.top_k if args.top_k is not None else ec.ddtree_top_k
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    method_labels(methods, budgets)  # validates --methods
    return {"methods": methods, "budgets": budgets, "top_k": top_k}


def run_offline(args: argparse.Namespace, cfg: Any, paths: dict[str, Path], settings: dict[str, Any],
                device: str, cache: Any, out: Path) -> dict[str, Any]:
    """The offline report: each drafter over the feature cache (or its held-out split)."""
    from dflashkit.checkpoint import load_drafter

    head = load_target_head(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
    problems = cache.target_problems(head)
    if problems:
        raise ValueError("the features are not this target's: " + "; ".join(problems))
    drafters = {}
    for name, path in paths.items():
        d = load_drafter(path, head, device=device, dtype=head.dtype)
        if list(cache.layer_ids) != list(d.config.target_layer_ids):
            raise ValueError(f"--drafter {path}: target_layer_ids {d.config.target_layer_ids} differ from the feature "
                             f"cache's layers {cache.layer_ids} ({args.features}); extract features for this drafter")
        drafters[name] = d
    items = heldout_items(cache, cfg.train.eval_samples, cfg.train.seed) if args.heldout else cache
    report = evaluate_offline(drafters, head, items, limit=args.limit, **settings)
    report["features"] = str(args.features)
    return report


@dataclass
class OnlineInputs:
    """What online evaluation decodes, read and checked before any model loads."""

    sampling: Sampling
    max_new_tokens: int
    limit: int | None
    source: str | None  # --prompts; None: the suites
    suites: list[Any]
    convs: list[Any] | None  # the prompts of `source`


def online_inputs(args: argparse.Namespace, cfg: Any) -> OnlineInputs:
    from dflashkit.data.prompts import get_suite, load_prompts

    ec = cfg.eval
    sampling = Sampling(_pick(args.temperature, ec.temperature), _pick(args.top_p, ec.top_p), _pick(args.seed, ec.seed))
    max_new = _pick(args.max_new_tokens, ec.max_new_tokens)
    if max_new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
    limit, source = _pick(args.limit, ec.limit), _pick(args.prompts, ec.prompts)
    suites = [get_suite(n.strip()) for n in args.suites.split(",") if n.strip()] if args.suites else \
        [get_suite(n) for n in ec.suites]
    if source is None and not suites:
        raise ValueError("--suites: expected at least one suite name")
    convs = load_prompts(source, limit=limit) if source is not None else None
    return OnlineInputs(sampling, max_new, limit, source, suites, convs)


def run_online(args: argparse.Namespace, cfg: Any, paths: dict[str, Path], settings: dict[str, Any],
               device: str, inputs: OnlineInputs, out: Path) -> dict[str, Any]:
    """The online report: the suites side by side (saved as each finishes in `out`/suites), or one
    prompt set; `settings` gains the prompts' and sampling's settings."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.data.prompts import load_suite
    from dflashkit.target import load_target
    from dflashkit.vocab import stop_token_ids

    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
    drafters = {n: load_drafter(p, target, device=target.device, dtype=target.dtype) for n, p in paths.items()}
    sampling = inputs.sampling
    kw = dict(**settings, sampling=sampling, engine=_pick(args.engine, "auto"), cost_aware=args.cost_aware,
              acceptances=args.acceptance or [DEFAULT_ACCEPTANCE],
              draft_tokens=args.draft_tokens, repeats=_pick(args.repeats, 1),
              stop_ids=stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None)))
    if inputs.convs is not None:
        if args.resume:
            log.warning("--resume reuses finished suites; an evaluation of --prompts runs whole")
        prompts = eval_prompts(inputs.convs, target.tokenizer, thinking=cfg.data.thinking)
        report = evaluate_online(target, drafters, prompts, max_new_tokens=inputs.max_new_tokens, **kw)
        settings.update(prompts=inputs.source, max_new_tokens=inputs.max_new_tokens)
    else:
        keep = out / "suites"
        log.info("each finished suite is saved in %s; after a stop, the same command with --resume continues", keep)
        report = evaluate_suites(target, drafters, [
            (s, eval_prompts(load_suite(s.name, inputs.limit), target.tokenizer, thinking=cfg.data.thinking))
            for s in inputs.suites], keep=keep, reuse=args.resume, **kw)
        settings.update(suites=[s.name for s in inputs.suites], limit=inputs.limit)
    settings.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    acceptance=kw["acceptances"],
                    draft_tokens=args.draft_tokens, repeats=kw["repeats"])  # None: each drafter's block_size - 1
    return report


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.data.features import FeatureCache

    cfg = config_from_args(args)
    offline = args.features is not None
    given = [f"--{k.replace('_', '-')}" for k in ONLINE_ONLY if getattr(args, k) is not None]
    if args.heldout and not offline:
        raise ValueError("--heldout selects samples of a feature cache: it needs --features DIR")
    if offline and given:
        log.warning("offline evaluation replays the cached data greedily; ignoring %s", ", ".join(given))
    paths = parse_drafters(args.drafter)
    settings = decoding_settings(args, cfg.eval)
    device = resolve_device(cfg.target.device)
    inputs = FeatureCache(args.features) if offline else online_inputs(args, cfg)
    runs = [(inputs, Path(args.out))] if offline else [
        (replace(inputs, sampling=replace(inputs.sampling, temperature=t)), Path(args.out) / (f"T{t:g}" if i else ""))
        for i, t in enumerate(temperatures(args, cfg.eval, device))]
    # The lock is taken before any model loads: a second evaluation into the same --out (say two
    # --resume runs) is refused at once, not after all its work.
    with output_directory(args.out, "eval", temp_dirs=[str(out.relative_to(args.out) / "suites") for _, out in runs]):
        for one, out in runs:
            report_one(args, cfg, paths, dict(settings), device, one, out)
    return 0


def temperatures(args: argparse.Namespace, ec: Any, device: str) -> list[float]:
    """The online evaluations' temperatures: --temperature; else, on a GPU, the preset
    `eval.temperatures` (greedy and sampled τ in one command); else `eval.temperature`."""
    if args.temperature is not None:
        return [args.temperature]
    return list(ec.temperatures) if device.startswith("cuda") else [ec.temperature]


def report_one(args: argparse.Namespace, cfg: Any, paths: dict[str, Path], settings: dict[str, Any], device: str,
               inputs: Any, out: Path) -> None:
    """One evaluation (online at one temperature, or offline) and its report in `out`."""
    t0 = time.perf_counter()
    report = (run_offline if args.features is not None else run_online)(args, cfg, paths, settings, device, inputs, out)
    report.update(training_tau_sim(paths))
    report.update(date=time.strftime("%Y-%m-%d %H:%M"), versions=versions(),
                  target=str(cfg.target.path or "SmolLM2-135M-Instruct (default)"),
                  device=device, settings=settings, seconds=round(time.perf_counter() - t0, 1),
                  drafter_paths={n: str(p) for n, p in paths.items()})
    files = write_report(report, out)
    print(markdown(report))
    print("wrote " + ", ".join(str(f) for f in files))
    check_partings(report)  # after the report is written: it holds every parting's margins
