"""`dflashkit demo`: the main job on the embedded default, end to end.

prompts -> regenerate -> tokenize -> extract -> adapt -> evaluate -> report, on SmolLM2-135M-Instruct,
on a GPU when there is one. Rather than training a drafter from scratch (a few CPU minutes teach
a drafter little), the demo adapts the bundled SmolLM2 drafter to a domain of its own, requests for
structured output (JSON, SQL, CSV; `assets/demo_domain.yaml`) that the built-in training set does
not cover, written to a prompt file as a user's traffic would be and answered by the target:
fine-tuning from `drafter.init_from` with the settings of `configs/finetune.yaml`. It reports τ
before and after on a held-out split of that domain (the split training measures tau_sim on),
and both drafters on the evaluation suites, side by side. Every stage writes plain files under
`--out` and is skipped (or resumed) when its output is already there, so a second run reuses the
first one's work.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable


log = logging.getLogger("dflashkit.demo")

# The fine-tuning preset of configs/finetune.yaml (a third of the from-scratch learning rate).
FINETUNE_LR = 2.0e-4
FINETUNE_WARMUP = 0.05


@dataclass
class Plan:
    """What the demo does; the defaults fit 20 minutes on a 2-core CPU."""

    train_prompts: int
    answer_tokens: int
    train_steps: int | None  # fine-tuning steps, or (None) as many as `train_minutes` fit
    train_minutes: float | None
    heldout: int  # regenerated samples held out for the before/after τ
    suite_prompts: int | None  # prompts per evaluation suite; None = each suite's full count
    suite_tokens: int | None  # answer tokens per suite prompt; None = each suite's own length
    budgets: list[int]

    @classmethod
    def for_device(cls, cuda: bool) -> "Plan":
        if cuda:
            return cls(train_prompts=2200, answer_tokens=256, train_steps=None, train_minutes=3.0, heldout=64,
                       suite_prompts=None, suite_tokens=None, budgets=[8, 16, 32, 64])
        # On two cores the suites dominate: 5 suites x 2 prompts x (AR + 2 drafters x 2 methods) of 64
        # tokens ~ 4.5 min (each suite's own 128 tokens: about twice that). 80 prompts: with 40 (32 to adapt on,
        # 8 held out) a few dozen steps fitted those 32 and lost on the held-out split. A step count, not a
        # time budget: 2.5 minutes fitted 47-60 steps that beat the bundled drafter on some machines, and 37
        # that did not on a slower one; 64 steps take 2.5-5 minutes on 2 cores.
        return cls(train_prompts=80, answer_tokens=128, train_steps=64, train_minutes=None, heldout=16,
                   suite_prompts=2, suite_tokens=64, budgets=[64])


def bundled_drafter_dir() -> Path:
    from importlib.resources import files

    return Path(str(files("dflashkit") / "assets" / "smollm2-drafter"))


class Stages:
    """Numbered stages with elapsed time and a rough ETA from the plan's estimates."""

    def __init__(self, estimates: dict[str, float]) -> None:
        self.estimates, self.t0, self.done = estimates, time.perf_counter(), []

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        i = len(self.done) + 1
        left = sum(v for k, v in self.estimates.items() if k not in self.done)
        log.info("[%d/%d] %s (elapsed %s, about %s left)", i, len(self.estimates), name,
                 _mmss(time.perf_counter() - self.t0), _mmss(left))
        t = time.perf_counter()
        out = fn()
        self.done.append(name)
        log.info("[%d/%d] %s done in %s", i, len(self.estimates), name, _mmss(time.perf_counter() - t))
        return out


def _mmss(s: float) -> str:
    return f"{int(s) // 60}:{int(s) % 60:02d}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options, budget_list

    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); re-runs reuse it")
    p.add_argument("--train-prompts", type=int, help="prompts of the demo's domain the target answers (CPU 80, GPU 2200)")
    p.add_argument("--train-steps", type=int, help="fine-tuning steps (CPU 64; GPU: as many as --train-minutes fit)")
    p.add_argument("--train-minutes", type=float, help="fine-tuning wall clock instead of a step count (GPU 3)")
    p.add_argument("--suite-prompts", type=int, help="prompts per evaluation suite (CPU 2, GPU each suite's count)")
    p.add_argument("--suite-tokens", type=int, help="answer tokens per suite prompt (CPU 64, GPU each suite's length)")
    p.add_argument("--budgets", type=budget_list, help="DDTree node budgets, comma list (CPU 64, GPU 8,16,32,64)")
    add_config_options(p)


def plan_from_args(args: argparse.Namespace, cuda: bool) -> Plan:
    """The device's plan with the command line's values in place of its own (each checked)."""
    plan = Plan.for_device(cuda)
    if args.train_steps is not None and args.train_minutes is not None:
        raise ValueError("--train-steps and --train-minutes: give one of them (a step count or a wall clock)")
    for field, value in (("train_prompts", args.train_prompts), ("train_steps", args.train_steps),
                         ("train_minutes", args.train_minutes), ("suite_prompts", args.suite_prompts),
                         ("suite_tokens", args.suite_tokens)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {value}")
            setattr(plan, field, value)
    if args.train_steps is not None:  # the one given replaces the plan's other
        plan.train_minutes = None
    if args.train_minutes is not None:
        plan.train_steps = None
    if args.budgets:
        plan.budgets = args.budgets
    return plan


def log_to_file(out: Path) -> None:
    """Every log line of the run also goes to OUT/logs/demo.log."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "logs" / "demo.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def stage_estimates(plan: Plan, cpu: bool) -> dict[str, float]:
    """Seconds per stage, a little above what 2 CPU cores (11 minutes in all) and an H200 measure."""
    from dflashkit.data.prompts import EVAL_SUITES

    n_eval = sum(min(s.prompts, plan.suite_prompts or s.prompts) for s in EVAL_SUITES)
    per_prompt = 30 if cpu else 6  # evaluation of one suite prompt
    return {"load target": 10, "regenerate": 1.5 * plan.train_prompts if cpu else 120, "tokenize": 5,
            "extract": 0.6 * plan.train_prompts if cpu else 20, "held-out τ before": 40 if cpu else 10,
            "adapt": plan.train_minutes * 60 if plan.train_minutes else 60 + 4 * plan.train_steps,
            "held-out τ after": 40 if cpu else 10, "evaluate suites": per_prompt * n_eval, "report": 2}


def write_domain_prompts(path: Path, count: int) -> None:
    """The demo's own traffic, written as a user's prompt file would be (deterministic); kept when
    an earlier run wrote as many."""
    from dflashkit.checkpoint import atomic_write_bytes
    from dflashkit.data.prompts import near_evaluation
    from dflashkit.data.trainset import domain_path, generate

    if not path.is_file() or len(path.read_text().splitlines()) < count:
        records = generate(near_evaluation(), count, spec_path=domain_path())
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())


def prepare_data(stages: Stages, target: Any, out: Path, plan: Plan, cfg: Any, layer_ids: list[int], cpu: bool) -> Path:
    """Prompts of the demo's domain -> the target's answers -> tokens -> features (OUT/features)."""
    from dflashkit.data.chat import load_tokenized, tokenize_file
    from dflashkit.data.features import extract_features
    from dflashkit.data.prompts import load_prompts
    from dflashkit.data.regenerate import GenerationParams, regenerate_local

    regen, tok_path, feats, domain = out / "regenerated.jsonl", out / "tokenized.jsonl", out / "features", out / "domain_prompts.jsonl"
    write_domain_prompts(domain, plan.train_prompts)

    def regenerate() -> None:
        convs = load_prompts(domain, limit=plan.train_prompts)
        s = regenerate_local(target, convs, regen, GenerationParams(max_new_tokens=plan.answer_tokens),
                             batch_size=16 if cpu else 256)
        log.info("%d answers written (%d already there), %.1f tokens/s", s.written, s.already_done, s.tokens_per_s)

    stages.run("regenerate", regenerate)
    stages.run("tokenize", lambda: tokenize_file(regen, target.tokenizer, tok_path, max_length=cfg.data.max_length))
    stages.run("extract", lambda: extract_features(target, load_tokenized(tok_path), layer_ids, feats, dtype="bfloat16",
                                                   batch_size=4 if cpu else 32))
    return feats


def adapt_config(cfg: Any, plan: Plan, feats: Path, run_dir: Path, cpu: bool) -> Any:
    """The fine-tuning run's config: from the bundled drafter, on the demo's features."""
    tcfg = cfg.model_copy(deep=True)
    tcfg.drafter.init_from = str(bundled_drafter_dir())
    tcfg.data.features = str(feats)
    tcfg.train.output_dir = str(run_dir)
    tcfg.train.max_steps = plan.train_steps
    tcfg.train.time_budget_s = plan.train_minutes * 60 if plan.train_minutes else None
    # On a CPU a run is a few dozen steps; there a 5 % warm-up is one step, and full-rate
    # steps on AdamW's fresh moments undo part of the trained drafter: held-out τ_sim falls in 21
    # steps (1.956 -> 1.925), and rises with a 30 % warm-up (-> 2.106 in 47 steps).
    tcfg.train.lr, tcfg.train.warmup_ratio = FINETUNE_LR, 0.3 if cpu else FINETUNE_WARMUP
    # On a CPU the LM head's cross-entropy over 49k tokens dominates: few anchors per step.
    tcfg.train.batch_size, tcfg.train.micro_batch_size = (4, 4) if cpu else (16, 16)
    tcfg.train.anchors_per_seq = 16 if cpu else 512
    # On a CPU a held-out evaluation costs as much as several steps: there, only the starting drafter
    # and the last step are evaluated (78 steps in 2.5 minutes instead of 25 with one every 10).
    tcfg.train.eval_every, tcfg.train.eval_samples = (10**6, plan.heldout) if cpu else (25, plan.heldout)
    tcfg.train.save_every = 10**6
    tcfg.train.tensorboard = False
    return tcfg


def adapt(tcfg: Any, target: Any, cache: Any, layer_ids: list[int]) -> None:
    """Fine-tune the bundled drafter (`train`) into train.output_dir, or keep what an earlier run finished there."""
    from dflashkit.train import TrainingStopped, train

    run_dir = Path(tcfg.train.output_dir)
    if (run_dir / "final" / "model.safetensors").is_file():
        log.info("reusing the drafter adapted by an earlier run: %s", run_dir / "final")
        return
    # overwrite: an interrupted earlier demo run left no final drafter; it restarts from scratch.
    try:
        train(tcfg, target=target, samples=cache, feature_layer_ids=layer_ids, overwrite=True)
    except TrainingStopped as e:
        raise TrainingStopped(e.step, e.signum, e.out_dir, "`dflashkit demo` again reuses the stages before "
                              "this one and adapts the drafter afresh") from None


def export_drafters(out: Path, drafter_dirs: dict[str, Path], target: Any) -> dict[str, Any]:
    """The drafters, in reference format, beside the report (OUT/drafters/NAME), loaded from there."""
    from dflashkit.checkpoint import load_drafter, save_drafter

    for name, src in drafter_dirs.items():
        dst = out / "drafters" / name
        if not (dst / "model.safetensors").is_file():
            save_drafter(load_drafter(src, target), dst)
    return {n: load_drafter(out / "drafters" / n, target, device=target.device, dtype=target.dtype) for n in drafter_dirs}


def evaluate_on_suites(target: Any, drafters: dict[str, Any], plan: Plan, report_dir: Path,
                       settings: dict[str, Any]) -> dict[str, Any]:
    """Both drafters on the evaluation suites (each suite saved as it finishes), or the report an
    earlier run wrote with the same settings."""
    from dflashkit import versions
    from dflashkit.data.prompts import EVAL_SUITES, load_suite
    from dflashkit.evaluate import eval_prompts, evaluate_suites
    from dflashkit.vocab import stop_token_ids

    done = report_dir / "report.json"
    if done.is_file():
        old = json.loads(done.read_text())
        if old.get("demo_settings") == settings:
            log.info("reusing the evaluation of an earlier run: %s", done)
            return old
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    suites = [(replace(s, max_new_tokens=plan.suite_tokens or s.max_new_tokens),
               eval_prompts(load_suite(s.name, plan.suite_prompts), target.tokenizer)) for s in EVAL_SUITES]
    rep = evaluate_suites(target, drafters, suites, stop_ids=stops, keep=report_dir / "suites", reuse=True,
                          methods=["dflash", "ddtree"], budgets=plan.budgets)
    rep.update(demo_settings=settings, target=target.name, device=settings["device"],
               date=time.strftime("%Y-%m-%d %H:%M:%S"), versions=versions())
    return rep


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.rundir import output_directory

    cfg = config_from_args(args)
    device = resolve_device(cfg.target.device)
    plan = plan_from_args(args, device.startswith("cuda"))
    # Locked for the run: a second demo into the same --out is refused at once (each stage's own
    # directory is locked by the stage as well).
    with output_directory(args.out, "demo", temp_dirs=("report", "report/suites")):
        return run_stages(cfg, plan, device, Path(args.out))


def run_stages(cfg: Any, plan: Plan, device: str, out: Path) -> int:
    """The demo's stages into `out`, each skipped where an earlier run finished it."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.data.features import FeatureCache
    from dflashkit.evaluate import check_partings, evaluate_offline, heldout_items, markdown, training_tau_sim, write_report
    from dflashkit.evaluate.suites import SAVED_FORMAT
    from dflashkit.target import load_target

    cpu = not device.startswith("cuda")
    log_to_file(out)
    stages = Stages(stage_estimates(plan, cpu))
    log.info("demo plan (%s): %s", device, plan)

    target = stages.run("load target", lambda: load_target(cfg.target.path, gguf_file=cfg.target.gguf_file,
                                                           dtype=cfg.target.dtype, device=device))
    bundled = load_drafter(bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    layer_ids = list(bundled.config.target_layer_ids)  # the features the bundled drafter reads
    feats = prepare_data(stages, target, out, plan, cfg, layer_ids, cpu)
    cache = FeatureCache(feats, dtype=target.dtype)
    tcfg = adapt_config(cfg, plan, feats, out / "adapt", cpu)
    held = heldout_items(cache, plan.heldout, tcfg.train.seed)  # the split training measures tau_sim on
    methods = dict(methods=["dflash", "ddtree"], budgets=plan.budgets)
    before = stages.run("held-out τ before", lambda: evaluate_offline({"bundled (before)": bundled}, target, held, **methods))
    run_dir = Path(tcfg.train.output_dir)
    stages.run("adapt", lambda: adapt(tcfg, target, cache, layer_ids))
    # best by tau_sim on the held-out split; the bundled drafter itself (step 0) is a candidate
    adapted_dir = run_dir / ("best" if (run_dir / "best").is_dir() else "final")
    drafter_dirs = {"adapted": adapted_dir, "bundled": bundled_drafter_dir()}
    drafters = export_drafters(out, drafter_dirs, target)
    after = stages.run("held-out τ after", lambda: evaluate_offline({"adapted (after)": drafters["adapted"]}, target,
                                                                     held, **methods))

    report_dir = out / "report"
    settings = {"suite_prompts": plan.suite_prompts, "suite_tokens": plan.suite_tokens, "budgets": plan.budgets,
                "drafters": sorted(drafter_dirs), "device": device, "adapted": str(adapted_dir), "format": SAVED_FORMAT}
    report = stages.run("evaluate suites", lambda: evaluate_on_suites(target, drafters, plan, report_dir, settings))
    report["heldout"] = {**before, "drafters": {**before["drafters"], **after["drafters"]}}
    report.update(training_tau_sim({"adapted": adapted_dir}))
    stages.run("report", lambda: write_report(report, report_dir))
    if (run_dir / "curves.png").is_file():
        shutil.copyfile(run_dir / "curves.png", report_dir / "training_curves.png")
    print(markdown(report))
    print(f"report: {report_dir / 'report.md'} (plots beside it); drafters: {out / 'drafters'}; logs: {out / 'logs'}")
    check_partings(report)
    return 0
