"""Reports of an evaluation: Markdown tables, report.json and PNG plots."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from dflashkit.drafter import KIND_NAMES
from dflashkit.evaluate.partings import NUMERICAL_ULPS
from dflashkit.evaluate.speed import SPEEDUP_LEGEND, speedup_mark

def method_table(report: dict[str, Any]) -> list[str]:
    """One row per drafter and method: the online or offline columns."""
    online = report["mode"] == "online"
    if online:
        lines = ["| drafter | kind | method | τ | rounds | tokens/s | speed-up | decode speed-up | greedy identical |",
                 "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    else:
        lines = ["| drafter | kind | method | τ (rounds) | rounds | τ (every position) |",
                 "| --- | --- | --- | ---: | ---: | ---: |"]
    for name, d in report["drafters"].items():
        kind = KIND_NAMES[d.get("kind", "dflash")]  # (reports written before the family have no kind: DFlash)
        for lab, m in d["methods"].items():
            if online:
                lines.append(f"| {name} | {kind} | {lab} | {m['tau']:.3f} | {m['rounds']} | {m['tokens_per_s']:.2f} | "
                             f"{speedup_cell(m)} | {m['decode_speedup']:.2f}x | {_identical(m)} |")
            else:
                lines.append(f"| {name} | {kind} | {lab} | {m['tau']:.3f} | {m['rounds']} | {m['tau_per_position']:.3f} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    online = report["mode"] == "online"
    lines = [f"# dflashkit eval ({report['mode']})", ""]
    for k in ("date", "versions", "target", "device", "settings"):
        if k in report:
            lines.append(f"- {k}: `{json.dumps(report[k]) if isinstance(report[k], dict) else report[k]}`")
    if report.get("reused_suites"):
        lines.append(f"- suites reused from an earlier run of the same evaluation (timings are that run's): "
                     f"{', '.join(report['reused_suites'])}")
    if "heldout" in report:
        h = report["heldout"]
        lines += ["", f"## Held-out split of the training domain ({h['samples']} samples, {h['answer_tokens']} answer "
                  "tokens, decoding rounds replayed offline)", "", *method_table(h)]
    if "suites" in report:
        lines += ["", "## Evaluation suites", "", *suite_table(report), "", "Over all prompts of the suites together:", ""]
    if online:
        b = report["baseline"]
        lines.append(f"- prompts: {report['prompts']}; autoregressive baseline: {b['tokens']} tokens, {b['tokens_per_s']:.2f} tokens/s")
    else:
        lines.append(f"- samples: {report['samples']}, answer tokens: {report['answer_tokens']}")
    lines += ["", *method_table(report)]
    if online:
        lines += ["", SPEEDUP_LEGEND + " Beside a speed-up: its range over the central 80 % of prompts."]
    lines += ["", "τ = accepted draft tokens + 1 per round (the final round of an answer counts tokens up to its end). "
              "Per-slot acceptance P(τ > k) and histograms: report.json, tau_hist.png, slot_acceptance.png"
              + (", suites.png (τ per suite)." if report.get("headline") else ".")]
    if online and report["greedy"]:
        lines += ["", f"Greedy outputs are compared with autoregressive decoding token by token. Where one parts, the "
                  f"target's top logits at that position, as recorded by the two passes that chose the two tokens "
                  f"(a one-token step and a verification block), are compared: "
                  f"the parting is numerical when both tokens are within {NUMERICAL_ULPS} units of {report.get('dtype')} "
                  "rounding of the top logit in both passes, or, beyond that in bf16 or fp16, when float32 arithmetic "
                  "at the same position puts the two tokens as close as both passes' own measured errors allow (or "
                  "closer than either pass's error) and the verification pass is about as exact as the one-token "
                  "step (report.json: per_prompt[].partings, `float32`); any other parting fails the evaluation."]
        if str(report.get("device", "")).startswith("cuda"):  # docs/recipe.md, "How far a suite's τ could move"
            lines.append("On a GPU, where the near-ties fall also depends on what else a run decodes (suites, drafters, "
                         "methods): compare drafters within one report, not across runs of different commands.")
    return "\n".join(lines) + "\n"


def speedup_cell(m: dict[str, Any]) -> str:
    """'1.23x (0.95-1.40)', marked where the spread is too wide or the speed-up above τ (`speed.speedup_mark`)."""
    lo, hi = m["speedup_interval"]
    return f"{m['speedup']:.2f}x{speedup_mark(m)} ({lo:.2f}-{hi:.2f})"


def _identical(m: dict[str, Any]) -> str:
    if m["identical"] is None:
        return "n/a (sampled)"
    if m["identical"]:
        return "yes"
    bad = m.get("unexplained_partings", [])
    numerical = len(m["mismatches"]) - len(bad)
    return (f"NO, unexplained: {', '.join(bad)}" if bad else "") or f"{numerical} parting(s), all numerical near-ties"


def training_tau_sim(paths: dict[str, Path]) -> dict[str, Any]:
    """For drafters that are a training run's `best/` (best.json): {'tau_sim': {drafter: {suite:
    tau_sim}}} where its held-out split had suite labels (tau_sim_by_suite), and {'tau_rounds_probes':
    {drafter: {suite: τ}}} where training replayed decoding rounds on the suites' own answers
    (`train.probes`); {} when none has either."""
    found: dict[str, dict[str, Any]] = {}
    for name, path in paths.items():
        best = Path(path).parent / "best.json"
        if Path(path).name == "best" and best.is_file():
            saved = json.loads(best.read_text())
            for key, field in (("tau_sim", "tau_sim_by_suite"), ("tau_rounds_probes", "tau_rounds_probes")):
                if saved.get(field):
                    found.setdefault(key, {})[name] = saved[field]
    return found


def tau_sim_vs_online(report: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """{drafter: {suite: {tau, tau_sim, rel_diff, tau_rounds_probe, rel_diff_probe}}} (the keys
    that apply) for every suite that the drafter's training measured (`training_tau_sim`): `tau`
    is online DFlash on the suite; τ_sim the mean acceptance over anchors of the held-out answers
    of the training category of the suite's name; τ_rounds_probe the decoding rounds replayed on
    the target's own answers to the suite's prompts (`train.probes`); rel_diff = value / τ - 1."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, value, diff in (("tau_sim", "tau_sim", "rel_diff"), ("tau_rounds_probes", "tau_rounds_probe", "rel_diff_probe")):
        for name, sims in report.get(key, {}).items():
            for suite, t in report["suites"].items():
                online = t["drafters"].get(name, {}).get("dflash")
                if suite in sims and online:
                    row = out.setdefault(name, {}).setdefault(suite, {"tau": online["tau"]})
                    row[value] = sims[suite]
                    row[diff] = sims[suite] / max(online["tau"], 1e-9) - 1
    return out


def suite_table(report: dict[str, Any]) -> list[str]:
    """The suites side by side: τ (speed-up) per suite, the mean over suites and the worst suite;
    τ_sim per suite beside it when the report carries one (`tau_sim`: {drafter: {suite: value}})."""
    names = list(report["suites"])
    head = "| drafter | method | " + " | ".join(f"{s} ({report['suites'][s]['prompts']}×{report['suites'][s]['max_new_tokens']})"
                                                for s in names) + " | **mean** | worst | worst/best |"
    lines = [head, "| --- | --- | " + "---: | " * (len(names) + 1) + "--- | ---: |"]
    for name, methods in report["headline"].items():
        for lab, h in methods.items():
            cells = [f"{m['tau']:.2f} ({m['speedup']:.2f}x{speedup_mark(m)})"
                     for m in (report["suites"][s]["drafters"][name][lab] for s in names)]
            lines.append(f"| {name} | {lab} | " + " | ".join(cells) +
                         f" | **{h['mean_tau']:.2f} ({h['mean_speedup']:.2f}x)** | {h['worst_suite']} {h['worst_tau']:.2f} | "
                         f"{h['worst_to_best']:.2f} |")
    for key, what in (("tau_sim", "τ_sim (held-out, training)"), ("tau_rounds_probes", "τ replayed (the suite's answers, training)")):
        for name, sims in report.get(key, {}).items():
            if not any(s in sims for s in names):  # measured on other data than these suites (the demo's domain)
                continue
            lines.append(f"| {name} | {what} | " + " | ".join(
                f"{sims[s]:.2f}" if s in sims else "–" for s in names) + " | | | |")
    lines += ["", "Cells: τ (speed-up over autoregressive decoding of the same suite); column heads: prompts × answer "
              "tokens. The mean weighs every suite the same; worst/best: the lowest suite τ over the highest.",
              "", SPEEDUP_LEGEND]
    first = next(iter(report["headline"].values()), {})
    if any("mean_tau_interval" in h for h in first.values()):
        lines += ["", "τ with 90 % intervals over prompts (bootstrap: each suite's prompts resampled, 2,000 draws): "
                  "differences narrower than these do not tell two drafters, or two runs, apart.", "",
                  "| drafter | method | " + " | ".join(names) + " | mean | worst/best |",
                  "| --- | --- | " + "---: | " * (len(names) + 2)]
        for name, methods in report["headline"].items():
            for lab, h in methods.items():
                cells = [report["suites"][s]["drafters"][name][lab]["tau_interval"] for s in names]
                lines.append(f"| {name} | {lab} | " + " | ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in cells) +
                             " | {:.2f}-{:.2f} | {:.2f}-{:.2f} |".format(*h["mean_tau_interval"], *h["worst_to_best_interval"]))
    lines += speedup_table(report, names)
    lines += slot_table(report, names)
    lines += extremes_table(report, names)
    if report.get("differences"):
        lines += ["", "τ differences between drafters on the same prompts, with paired 90 % intervals (an interval "
                  "that holds 0: these suites do not tell the two apart):", "",
                  "| drafters | method | " + " | ".join(names) + " | mean |", "| --- | --- | " + "---: | " * (len(names) + 1)]
        for pair, methods in report["differences"].items():
            for lab, d in methods.items():
                lines.append(f"| {pair} | {lab} | " + " | ".join(
                    "{:+.2f} ({:+.2f} to {:+.2f})".format(d[s]["diff"], *d[s]["interval"]) for s in [*names, "mean"]) + " |")
    return lines


def speedup_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Each suite's speed-up with its range over the central 80 % of its prompts (`speedup_cell`)."""
    lines = ["", "Speed-up per suite, with its range over the central 80 % of the suite's prompts (marks: above):", "",
             "| drafter | method | " + " | ".join(names) + " |", "| --- | --- |" + " ---: |" * len(names)]
    for name, methods in report["headline"].items():
        for lab in methods:
            cells = [report["suites"][s]["drafters"][name][lab] for s in names]
            lines.append(f"| {name} | {lab} | " + " | ".join(speedup_cell(m) for m in cells) + " |")
    return lines


SLOT_COLUMNS = 3  # the first slots decide τ where it is low (P(τ > 1): the first draft token accepted)


def slot_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Where each suite's rounds stop: P(τ > k) for the first slots, per drafter and method. Two
    suites of equal τ can differ here: one whose rounds mostly end at the first draft token, one
    whose rounds end later."""
    ks = " / ".join(f"P(τ > {k})" for k in range(1, SLOT_COLUMNS + 1))
    lines = ["", f"Per-slot acceptance per suite ({ks}; every slot: report.json, suites.*.drafters):", "",
             "| drafter | method | " + " | ".join(names) + " |", "| --- | --- |" + " ---: |" * len(names)]
    for name, methods in report["headline"].items():
        for lab in methods:
            cells = [" / ".join(f"{p:.2f}" for p in report["suites"][s]["drafters"][name][lab]["slot_acceptance"][:SLOT_COLUMNS])
                     for s in names]
            lines.append(f"| {name} | {lab} | " + " | ".join(cells) + " |")
    return lines


def extremes_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Per suite, the prompt of the lowest and of the highest τ for the first drafter named (DFlash
    where it ran): which requests a drafter serves worst (e.g. explanations of facts) is what a mean hides."""
    name = next(iter(report["drafters"]))
    lab = "dflash" if "dflash" in report["headline"][name] else next(iter(report["headline"][name]))
    key = f"{name}/{lab}"

    def cell(row: dict[str, Any]) -> str:
        request = row.get("request", "").replace("|", "\\|")
        return f"{row['tau'][key]:.2f} {row['id']}" + (f": {request}" if request else "")

    lines = ["", f"Lowest and highest τ per suite ({name}, {lab}; every prompt: report.json, per_prompt):", "",
             "| suite | lowest | highest |", "| --- | --- | --- |"]
    for s in names:
        rows = sorted((r for r in report["per_prompt"] if r.get("suite") == s and key in r["tau"]), key=lambda r: r["tau"][key])
        if rows:
            lines.append(f"| {s} | {cell(rows[0])} | {cell(rows[-1])} |")
    return lines


def plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(f"{n}/{lab}", m) for n, d in report["drafters"].items() for lab, m in d["methods"].items()]
    files = []
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, m) in enumerate(series):
        n = max(1, m["rounds"])
        ax.bar([k + 1 + (i - len(series) / 2) * width for k in range(len(m["hist"]))], [h / n for h in m["hist"]],
               width=width, label=f"{label} (τ {m['tau']:.2f})")
    ax.set(xlabel="τ (tokens per round)", ylabel="share of rounds", title=f"acceptance length ({report['mode']})")
    ax.legend(fontsize=7)
    files.append(out_dir / "tau_hist.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, m in series:
        ax.plot(range(1, len(m["slot_acceptance"]) + 1), m["slot_acceptance"], marker="o", ms=3, label=label)
    ax.set(xlabel="slot / tree depth k", ylabel="P(τ > k)", ylim=(0, 1.02), title="per-slot acceptance")
    ax.legend(fontsize=7)
    files.append(out_dir / "slot_acceptance.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    if report.get("headline"):
        files.append(suite_plot(report, out_dir / "suites.png", plt))
    return files


def suite_plot(report: dict[str, Any], path: Path, plt: Any) -> Path:
    """τ per suite and the mean over suites, a bar per drafter and method, with its 90 % interval
    over prompts where the report has one: the suites side by side at a glance."""
    names = [*report["suites"], "mean"]
    series = [(name, lab, h) for name, methods in report["headline"].items() for lab, h in methods.items()]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, lab, h) in enumerate(series):
        per = [report["suites"][s]["drafters"][name][lab] for s in names[:-1]]
        taus = [m["tau"] for m in per] + [h["mean_tau"]]
        spans = [m.get("tau_interval") for m in per] + [h.get("mean_tau_interval")]
        err = None
        if all(sp is not None and all(math.isfinite(v) for v in sp) for sp in spans):
            # (the interval pools per-prompt τ rounded to 3 decimals: it may miss the point by a hair)
            err = [[max(0.0, t - lo) for t, (lo, _) in zip(taus, spans)], [max(0.0, hi - t) for t, (_, hi) in zip(taus, spans)]]
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in range(len(names))], taus, width=width, yerr=err,
               capsize=2, label=f"{name}/{lab}")
    ax.axvline(len(names) - 1.5, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(names)), [f"{s}\n({report['suites'][s]['prompts']})" for s in names[:-1]] + ["mean"])
    ax.set(ylabel="τ (tokens per round)", title="acceptance length per suite (90 % intervals over prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """report.json, report.md, tau_hist.png, slot_acceptance.png, and suites.png for a suite
    report (each written atomically: the plots are drawn in a folder of their own, named as
    `checkpoint.temp_path` names temp files, so that the next run into the directory removes it
    if this one is killed)."""
    from dflashkit.checkpoint import atomic_write_bytes, atomic_write_json, temp_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "report.md", markdown(report).encode())
    tmp = temp_path(out / "plots")
    tmp.mkdir()
    files = [out / "report.json", out / "report.md"]
    try:
        for f in plots(report, tmp):
            f.replace(out / f.name)
            files.append(out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files
