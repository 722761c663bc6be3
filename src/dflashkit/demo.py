"""`dflashkit demo`: the main job on the embedded default (SPEC §4), end to end.

prompts -> regenerate -> tokenize -> extract -> train -> evaluate -> report, on SmolLM2-135M-Instruct,
on a GPU when there is one. A drafter trained in a few minutes on two CPU cores is weak, so the
report also evaluates the bundled SmolLM2 drafter (trained on one H200 by
`benchmarks/quality_run.py --config configs/smollm2-bundled.yaml`), side by side, whatever the
numbers are. Every stage writes plain files under `--out` and is skipped (or resumed) when its
output is already there, so a second run reuses the first one's work.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


log = logging.getLogger("dflashkit.demo")


@dataclass
class Plan:
    """What the demo does; the defaults fit 20 minutes on a 2-core CPU."""

    train_prompts: int
    answer_tokens: int
    train_minutes: float
    drafter_layers: int
    eval_prompts: int
    eval_tokens: int
    budgets: list[int]

    @classmethod
    def for_device(cls, cuda: bool) -> "Plan":
        if cuda:
            return cls(train_prompts=2200, answer_tokens=256, train_minutes=5.0, drafter_layers=4,
                       eval_prompts=20, eval_tokens=128, budgets=[8, 16, 32, 64])
        # On two cores the evaluation dominates: 10 prompts x (AR + 2 drafters x 2 methods) ~ 9 min.
        return cls(train_prompts=32, answer_tokens=128, train_minutes=3.0, drafter_layers=1,
                   eval_prompts=10, eval_tokens=128, budgets=[64])


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
    from dflashkit.commands import add_config_options

    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); re-runs reuse it")
    p.add_argument("--train-prompts", type=int, help="built-in prompts the target answers (CPU 32, GPU 2200)")
    p.add_argument("--train-minutes", type=float, help="training wall clock (CPU 3, GPU 5)")
    p.add_argument("--eval-prompts", type=int, help="first N HumanEval prompts to evaluate on (CPU 10, GPU 20)")
    p.add_argument("--budgets", help="DDTree node budgets, comma list (CPU 64, GPU 8,16,32,64)")
    p.add_argument("--no-bundled", action="store_true", help="do not evaluate the bundled SmolLM2 drafter")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.checkpoint import load_drafter, save_drafter
    from dflashkit.commands import config_from_args, resolve_device
    from dflashkit.data.chat import load_tokenized, tokenize_file
    from dflashkit.data.features import FeatureCache, extract_features
    from dflashkit.data.prompts import load_prompts
    from dflashkit.data.regenerate import GenerationParams, regenerate_local
    from dflashkit.drafter import default_target_layer_ids
    from dflashkit.evaluate import eval_prompts, evaluate_online, markdown, write_report
    from dflashkit.target import load_target
    from dflashkit.train import train
    from dflashkit.vocab import stop_token_ids

    cfg = config_from_args(args)
    device = resolve_device(cfg.target.device)
    plan = Plan.for_device(device.startswith("cuda"))
    for field, value in (("train_prompts", args.train_prompts), ("train_minutes", args.train_minutes),
                         ("eval_prompts", args.eval_prompts)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {value}")
            setattr(plan, field, value)
    if args.budgets:
        plan.budgets = [int(b) for b in args.budgets.split(",")]
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "logs" / "demo.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    cpu = not device.startswith("cuda")
    per_prompt = 55 if cpu else 6  # seconds of evaluation per prompt (measured on 2 CPU cores / an H200)
    stages = Stages({"load target": 10, "regenerate": 3.5 * plan.train_prompts if cpu else 120, "tokenize": 5,
                     "extract": 1.5 * plan.train_prompts if cpu else 20, "train": plan.train_minutes * 60,
                     "evaluate": per_prompt * plan.eval_prompts, "report": 2})
    log.info("demo plan (%s): %s", device, plan)

    target = stages.run("load target", lambda: load_target(cfg.target.path, gguf_file=cfg.target.gguf_file,
                                                           dtype=cfg.target.dtype, device=device))
    regen, tok_path, feats = out / "regenerated.jsonl", out / "tokenized.jsonl", out / "features"

    def regenerate() -> None:
        convs = load_prompts("builtin", limit=plan.train_prompts)
        s = regenerate_local(target, convs, regen, GenerationParams(max_new_tokens=plan.answer_tokens),
                             batch_size=16 if cpu else 256)
        log.info("%d answers written (%d already there), %.1f tokens/s", s.written, s.already_done, s.tokens_per_s)

    stages.run("regenerate", regenerate)
    stages.run("tokenize", lambda: tokenize_file(regen, target.tokenizer, tok_path, max_length=cfg.data.max_length))
    layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(target.num_layers, cfg.drafter.num_taps)
    stages.run("extract", lambda: extract_features(target, load_tokenized(tok_path), layer_ids, feats, dtype="bfloat16",
                                                   batch_size=4 if cpu else 32))

    run_dir = out / "train"

    def train_scratch() -> Path:
        if (run_dir / "final" / "model.safetensors").is_file():
            log.info("reusing the drafter trained by an earlier run: %s", run_dir / "final")
            return run_dir
        tcfg = cfg.model_copy(deep=True)
        tcfg.drafter.num_layers = plan.drafter_layers
        tcfg.drafter.target_layer_ids = layer_ids
        tcfg.data.features = str(feats)
        tcfg.train.output_dir = str(run_dir)
        tcfg.train.time_budget_s = plan.train_minutes * 60
        # On a CPU the LM head's cross-entropy over 49k tokens dominates: few anchors per step.
        tcfg.train.batch_size, tcfg.train.micro_batch_size = (4, 4) if cpu else (16, 16)
        tcfg.train.anchors_per_seq = 16 if cpu else 512
        tcfg.train.eval_every, tcfg.train.eval_samples = (25, 4) if cpu else (100, 64)
        tcfg.train.save_every = 10**6
        tcfg.train.tensorboard = False
        # overwrite: an interrupted earlier demo run left no final drafter; it restarts from scratch.
        return train(tcfg, target=target, samples=FeatureCache(feats, dtype=target.dtype), feature_layer_ids=layer_ids,
                     overwrite=True)

    stages.run("train", train_scratch)

    # best by tau_sim when held-out samples were evaluated, else the last step
    drafter_dirs = {"trained-here": run_dir / ("best" if (run_dir / "best").is_dir() else "final")}
    if not args.no_bundled:
        drafter_dirs["bundled"] = bundled_drafter_dir()
    for name, src in drafter_dirs.items():  # the drafters, in reference format, beside the report
        dst = out / "drafters" / name
        if not (dst / "model.safetensors").is_file():
            save_drafter(load_drafter(src, target), dst)

    report_dir = out / "report"
    settings = {"prompts": plan.eval_prompts, "max_new_tokens": plan.eval_tokens, "budgets": plan.budgets,
                "drafters": sorted(drafter_dirs), "device": device}

    def evaluate() -> dict[str, Any]:
        done = report_dir / "report.json"
        if done.is_file():
            old = json.loads(done.read_text())
            if old.get("demo_settings") == settings:
                log.info("reusing the evaluation of an earlier run: %s", done)
                return old
        drafters = {n: load_drafter(out / "drafters" / n, target, device=target.device, dtype=target.dtype)
                    for n in drafter_dirs}
        prompts = eval_prompts(load_prompts("humaneval", limit=plan.eval_prompts), target.tokenizer)
        stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
        rep = evaluate_online(target, drafters, prompts, budgets=plan.budgets, max_new_tokens=plan.eval_tokens,
                              stop_ids=stops)
        rep.update(demo_settings=settings, target=target.name, device=device,
                   date=time.strftime("%Y-%m-%d %H:%M:%S"))
        return rep

    report = stages.run("evaluate", evaluate)
    stages.run("report", lambda: write_report(report, report_dir))
    if (run_dir / "curves.png").is_file():
        shutil.copyfile(run_dir / "curves.png", report_dir / "training_curves.png")
    print(markdown(report))
    print(f"report: {report_dir / 'report.md'} (plots beside it); drafters: {out / 'drafters'}; logs: {out / 'logs'}")
    return 0
