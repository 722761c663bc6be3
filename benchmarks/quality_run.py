"""The testbed quality run: regenerate -> tokenize -> train under a wall-clock budget, then greedy
online evaluation on the evaluation suites (AR vs DFlash vs DDTree), in one process.

    python benchmarks/quality_run.py --config configs/smollm2-general.yaml --budget-s 430 \
        --compare-bundled --export-parts runs/parts --json runs/quality.json

The budget covers loading the target, making the prompts, regeneration, tokenisation and
training; the evaluation comes after it (bounded by the suites' fixed prompt counts and answer
lengths; --suite-prompts and --suite-tokens shrink it for a quick check of the path). The suites (HumanEval, code, math, chat, multi-turn; each with its own prompt
count and answer length) are never trained on: the built-in training set's generator drops any
prompt near one of them. --compare-bundled evaluates the bundled drafter beside the new one in
the same run. --export-parts writes the new drafter (`best/`) as parts of at most 15 MiB with
SHA-256 sums (`checkpoint.split_drafter`; `join_drafter` puts it back) right after training, and
--json is written then too, so that both survive an evaluation cut short; --no-eval stops there
(evaluate later with `dflashkit eval`), for a job whose time limit must go to data and training.
--data-only stops after the data (prompts, answers, tokens in train.output_dir), for a job whose
time limit cannot hold both: a second run with data.prompts=OUTPUT_DIR/regenerated.jsonl finds
every answer there (`regenerate` resumes by id), reuses the tokens made from them, and spends its whole budget
on training. Any greedy output that
parts from autoregressive decoding other than at a numerical near-tie fails the run (after the
report is written).
"""

from __future__ import annotations

import time

T_IMPORT = time.perf_counter()  # before the heavy imports: their time is reported too

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from dflashkit.checkpoint import atomic_write_json, load_drafter, split_drafter  # noqa: E402
from dflashkit.commands import resolve_device  # noqa: E402
from dflashkit.config import load_config  # noqa: E402
from dflashkit.data.chat import TokenizeStats, load_tokenized, tokenize_file  # noqa: E402
from dflashkit.data.prompts import EVAL_SUITES, load_prompts, load_suite  # noqa: E402
from dflashkit.data.regenerate import GenerationParams, probe_samples, regenerate_local  # noqa: E402
from dflashkit.data.selfprompts import spec_for, writer  # noqa: E402
from dflashkit.demo import bundled_drafter_dir  # noqa: E402
from dflashkit.evaluate import (  # noqa: E402
    check_partings, eval_prompts, evaluate_suites, markdown, parting_summary, tau_sim_vs_online, training_tau_sim,
    write_report,
)
from dflashkit.target import load_target  # noqa: E402
from dflashkit.train import train  # noqa: E402
from dflashkit.vocab import stop_token_ids  # noqa: E402


class Clock:
    """Wall-clock seconds per stage, in order."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {"imports": self.t0 - T_IMPORT}

    def lap(self, stage: str) -> float:
        now = time.perf_counter()
        self.seconds[stage] = now - self.last
        self.last = now
        return self.seconds[stage]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def eval_summary(report: dict[str, Any], suite_prompts: int | None) -> dict[str, Any]:
    """Per drafter and method: τ and speed-up of every suite, mean, worst, best and worst/best;
    τ_sim against online τ per suite; every parting and its class."""
    drafters = {}
    for name, methods in report["headline"].items():
        drafters[name] = {}
        for lab, h in methods.items():
            pooled = report["drafters"][name]["methods"][lab]
            drafters[name][lab] = {
                "suites": {s: {k: t["drafters"][name][lab][k] for k in ("tau", "speedup", "identical")}
                           for s, t in report["suites"].items()},
                **h, "pooled_tau": pooled["tau"], "pooled_speedup": pooled["speedup"],
                "identical_prompts": pooled["identical_prompts"]}
    return {"prompts": report["prompts"], "suite_prompts": suite_prompts,  # None: each suite's own count
            "suites": {s: {k: t[k] for k in ("prompts", "max_new_tokens", "baseline_tokens_per_s")}
                       for s, t in report["suites"].items()},
            "dtype": report["dtype"], "ar_tokens_per_s": report["baseline"]["tokens_per_s"], "drafters": drafters,
            "tau_sim_vs_online": tau_sim_vs_online(report), "partings": parting_summary(report)}


def _cell(row: dict[str, float], key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "–"


def summary_markdown(result: dict[str, Any]) -> str:
    """The run's own tables: stage times, τ_sim against online τ, partings."""
    s, rg = result["seconds"], result["regenerate"]
    lines = ["## Quality run", "", "| stage | seconds | detail |", "| --- | ---: | --- |"]
    detail = {
        "prompts": f"{rg['prompts']} prompts"
                   + (f" ({rg['already_done']} answered in an earlier run)" if rg.get("already_done") else ""),
        "regenerate": f"{rg['completion_tokens']} tokens, {rg['tokens_per_s']:.0f} tokens/s, batch {rg['batch']}",
        "tokenize": f"{result['tokenize']['written']} samples"
                    + (" (tokenized in an earlier run)" if result["tokenize"].get("reused") else ""),
        "train": f"{result['train']['steps']} steps ("
                 + (f"best τ_sim {result['train']['tau_sim']:.3f} at step {result['train']['step']}"
                    if result["train"]["tau_sim"] is not None else "no held-out split: the final weights")
                 + f"), budget {result['train']['time_budget_s']:.0f} s" if result["train"] else "",
        "eval": f"{result['eval']['prompts']} prompts" if result["eval"] else "",
    }
    for stage, sec in s.items():
        lines.append(f"| {stage} | {sec:.1f} | {detail.get(stage, '')} |")
    ev = result["eval"]
    if ev is None:
        return "\n".join(lines) + "\n"
    lines += ["", "Training's measures against online DFlash τ of each suite: τ_sim on the held-out split of the "
              "training set (the category of the suite's name), and decoding rounds replayed during training on "
              "the target's own answers to the suite (probe):", "",
              "| drafter | suite | τ_sim held-out | τ replayed, probe | τ online | held-out / τ - 1 | probe / τ - 1 |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, suites in ev["tau_sim_vs_online"].items():
        lines += [f"| {name} | {suite} | {_cell(c, 'tau_sim', '.3f')} | {_cell(c, 'tau_rounds_probe', '.3f')} | "
                  f"{c['tau']:.3f} | {_cell(c, 'rel_diff', '+.1%')} | {_cell(c, 'rel_diff_probe', '+.1%')} |"
                  for suite, c in suites.items()]
    lines += ["", f"Partings from autoregressive decoding (each classified against {ev['dtype']} rounding):", "",
              "| drafter/method | partings | numerical near-ties | unexplained |", "| --- | ---: | ---: | --- |"]
    for key, p in ev["partings"].items():
        lines.append(f"| {key} | {p['partings']} | {p['numerical']} | {', '.join(p['unexplained']) or 'none'} |")
    if not ev["partings"]:
        lines.append("| (all) | 0 | 0 | none |")
    return "\n".join(lines) + "\n"


def tokenized(answers: Path, tokenizer: Any, out: Path, max_length: int) -> tuple[TokenizeStats, bool]:
    """`tokenize_file`'s output and stats, or those an earlier run made from the same answers with
    the same tokenizer and length (a --data-only run's: 23 s on an H200 host at 22,000 answers,
    given to training instead). True when reused."""
    key = {"answers_sha256": hashlib.sha256(answers.read_bytes()).hexdigest(), "max_length": max_length,
           "tokenizer": getattr(tokenizer, "name_or_path", "")}
    stamp = out.with_name(out.name + ".stamp.json")  # written after `out`, removed before it is rewritten
    if out.is_file() and stamp.is_file():
        saved = json.loads(stamp.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return TokenizeStats(**saved["stats"]), True
    stamp.unlink(missing_ok=True)
    stats = tokenize_file(answers, tokenizer, out, max_length=max_length)
    atomic_write_json(stamp, {"key": key, "stats": asdict(stats)})
    return stats, False


def finish(result: dict[str, Any], clock: Clock, json_path: str | None) -> None:
    """A run that stops before the evaluation: its total time, its JSON, its table."""
    clock.seconds["total"] = clock.elapsed() + clock.seconds["imports"]
    if json_path:
        atomic_write_json(Path(json_path), result)
    print(summary_markdown(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall clock for load + prompts + regenerate + tokenize + train (the evaluation comes after)")
    p.add_argument("--suite-prompts", type=int, default=None, help="prompts per suite (default: each suite's count)")
    p.add_argument("--suite-tokens", type=int, default=None,
                   help="answer tokens per suite (default: each suite's own; fewer only for a quick check of the path)")
    p.add_argument("--compare-bundled", action="store_true",
                   help="evaluate the bundled drafter (src/dflashkit/assets/smollm2-drafter) beside the new one")
    p.add_argument("--export-parts", metavar="DIR",
                   help="write the new drafter as <= 15 MiB parts + SHA256SUMS here (checkpoint.join_drafter rejoins)")
    p.add_argument("--json", help="write the result here (after training, then again after the evaluation)")
    p.add_argument("--no-eval", action="store_true",
                   help="stop after training (and --export-parts): evaluate later with `dflashkit eval --drafter DIR/best`, "
                        "so that a time-limited job spends its budget on data and training")
    p.add_argument("--data-only", action="store_true",
                   help="stop after prompts, regenerate and tokenize; train in a second run given "
                        "data.prompts=TRAIN_OUTPUT_DIR/regenerated.jsonl (every answer is found there, none rewritten)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    clock = Clock()
    cfg = load_config(a.config, a.overrides)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = spec_for(cfg.data.prompts, cfg.data.self_prompts)  # (before the target loads)
    device = resolve_device(cfg.target.device)
    target = load_target(cfg.target.path, gguf_file=cfg.target.gguf_file, dtype=cfg.target.dtype, device=device)
    clock.lap("load")

    d = cfg.data
    convs = load_prompts(d.prompts, limit=d.limit, writer=writer(target, d.batch_size, d.seed, keep=out, spec=spec))
    clock.lap("prompts")
    regen = out / "regenerated.jsonl"
    rs = regenerate_local(target, convs, regen, GenerationParams(max_new_tokens=d.max_new_tokens), batch_size=d.batch_size)
    clock.lap("regenerate")
    tok_path = out / "tokenized.jsonl"
    ts, reused = tokenized(regen, target.tokenizer, tok_path, d.max_length)
    samples = load_tokenized(tok_path)
    clock.lap("tokenize")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "config": a.config, "overrides": a.overrides, "budget_s": a.budget_s, "seconds": clock.seconds,
        "regenerate": {"prompts": rs.prompts, "already_done": rs.already_done,
                       "completion_tokens": rs.completion_tokens, "seconds": rs.seconds,
                       "tokens_per_s": rs.tokens_per_s, "batch": d.batch_size},
        "tokenize": {**asdict(ts), "problems": len(ts.problems), "reused": reused},
        "train": None, "export": None, "eval": None,
    }
    if a.data_only:
        finish(result, clock, a.json)
        return

    stop = stop_token_ids(target.tokenizer, target.model.generation_config)
    suites = [(replace(s, max_new_tokens=a.suite_tokens or s.max_new_tokens),
               eval_prompts(load_suite(s.name, a.suite_prompts), target.tokenizer)) for s in EVAL_SUITES]
    # The target's own answers to the suites: training measures tau_sim on them beside its held-out
    # split (never trained on, never picking best/), the offline twin of the online evaluation below.
    probes = {s.name: probe_samples(target, load_suite(s.name, a.suite_prompts), s.max_new_tokens) for s, _ in suites}
    clock.lap("probes")

    cfg.train.time_budget_s = max(30.0, a.budget_s - clock.elapsed())
    run_dir = train(cfg, target=target, samples=samples, probes=probes)
    clock.lap("train")
    picked = (run_dir / "best.json").is_file()  # not with fewer than 5 samples: no held-out split to pick by
    best = run_dir / ("best" if picked else "final")
    if not picked:
        logging.warning("%s: no held-out split (fewer than 5 samples), so no best/: the final weights stand in", run_dir)
    if a.export_parts:
        split_drafter(best, a.export_parts)
        clock.lap("export")

    steps = json.loads((run_dir / "latest.json").read_text())["step"]
    result["train"] = {"steps": steps, "time_budget_s": cfg.train.time_budget_s,
                       **(json.loads((run_dir / "best.json").read_text()) if picked else {"tau_sim": None, "step": steps})}
    if a.export_parts:
        result["export"] = {"dir": a.export_parts, "files": sorted(f.name for f in Path(a.export_parts).iterdir())}
    if a.no_eval:
        finish(result, clock, a.json)
        return
    if a.json:  # the training's outcome is kept even if the evaluation does not finish
        atomic_write_json(Path(a.json), result)

    drafters = {"trained": load_drafter(best, target, device=target.device, dtype=target.dtype)}
    if a.compare_bundled:
        drafters["bundled"] = load_drafter(bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    report = evaluate_suites(target, drafters, suites, methods=("dflash", "ddtree"), budgets=cfg.eval.ddtree_budgets,
                             top_k=cfg.eval.ddtree_top_k, stop_ids=stop)
    report.update(target=target.name, device=device, date=time.strftime("%Y-%m-%d %H:%M"),
                  **training_tau_sim({"trained": best}))
    clock.lap("eval")
    write_report(report, out / "eval")  # JSON + Markdown + plots
    clock.seconds["total"] = clock.elapsed() + clock.seconds["imports"]
    result["eval"] = eval_summary(report, a.suite_prompts)
    if a.json:
        atomic_write_json(Path(a.json), result)
    print(markdown(report))
    print(summary_markdown(result))
    check_partings(report)


if __name__ == "__main__":
    main()
