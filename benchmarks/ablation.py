"""Ablation at one budget: the recipe against the known-bad variants of docs/conventions.md (CPU, small scale).

    OMP_NUM_THREADS=1 python benchmarks/ablation.py --json runs/ablation/result.json

One drafter, one data set, one seed, the same number of optimiser steps for every variant:

* recipe           hard CE, gamma 7, no noise (the defaults);
* kl               loss=kl (kl_weight 1, T 1): the reference for the loss=kl rows below, which
                   need a target-logit path;
* fc-label         loss=kl with the layer the KL targets come from (L - 1, the target's final
                   hidden state) added as a sixth `fc` tap (docs/conventions.md, mistake 2);
* anchor-visible   loss=kl, and the context mask also shows the anchor's own position (docs/conventions.md
                   mistake 6), default taps;
* fc-label+anchor  both: the combination in which the label layer is a direct shortcut (the
                   final hidden state at the anchor is the target's prediction for slot 1);
* noise-fc         loss=kl, feature noise on the fc inputs only (what the product does);
* noise-label      loss=kl, the same noise, and also on the final hidden state the KL targets are
                   computed from (docs/conventions.md, mistake 3: noise applied before the label split);
* kl70-T2-g10      70 % soft KL at T=2 + 30 % hard CE, gamma 10 (docs/conventions.md, mistake 4, without the
                   "streak weights", which the product has no option for).

The product refuses fc-label (`check_label_sources`) and cannot put noise on the KL targets
(`Batcher` splits them off first): this script reintroduces those bugs on purpose, by patching
`dflashkit.train.check_label_sources`, `dflashkit.train.micro_batch` and `dflashkit.masks.visible`
for the duration of one variant's `train()` call only. So the trainer's own held-out tau_sim is
what a trainer with that bug would report (leaky mask included), while the offline evaluation
after training (`evaluate_offline`) always runs unpatched, with the context inference really has.

Data: the target's own greedy answers (`runs/gpu-regen/regenerated.jsonl`), tokenized, the first
`--train + --held-out` samples; features extracted once (taps + the final layer) into
`<out>/feats`. The held-out samples are the trainer's own held-out split (`split_eval`), so the
trainer's tau_sim and the offline tau measure the same samples, none of which is trained on.
Each variant's result is stored in `<out>/<variant>/ablation.json`: a rerun skips finished variants.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

import dflashkit.masks as masks
import dflashkit.train as train_mod
from dflashkit.checkpoint import atomic_write_json, load_drafter
from dflashkit.config import load_config
from dflashkit.data.chat import load_tokenized, tokenize_file
from dflashkit.data.features import FeatureCache, FeatureSample, extract_features
from dflashkit.drafter import default_target_layer_ids
from dflashkit.evaluate import evaluate_offline
from dflashkit.objective import add_feature_noise
from dflashkit.target import load_target

log = logging.getLogger("ablation")

# name -> (what differs from the recipe, config overrides, patches)
VARIANTS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "recipe": ("recipe: hard CE, gamma 7, no noise", [], ()),
    "kl": ("loss=kl (100 % KL, T=1), taps end at L-3", ["train.loss=kl"], ()),
    "fc-label": ("loss=kl + layer L-1 (the KL-target layer) fed to fc", ["train.loss=kl"], ("label_tap",)),
    "anchor-visible": ("loss=kl + context mask shows the anchor's own position", ["train.loss=kl"],
                       ("anchor_visible",)),
    "fc-label+anchor": ("fc-label + context mask shows the anchor's own position", ["train.loss=kl"],
                        ("label_tap", "anchor_visible")),
    "noise-fc": ("loss=kl + feature noise on fc inputs only (correct)", ["train.loss=kl"], ("noise",)),
    "noise-label": ("loss=kl + the same noise also on the KL-target hidden state", ["train.loss=kl"],
                    ("noise", "noise_label")),
    "kl70-T2-g10": ("70 % soft KL at T=2 + 30 % CE, gamma 10",
                    ["train.loss=kl", "train.kl_weight=0.7", "train.kl_temperature=2", "train.gamma=10"], ()),
}
# the arguments a stored variant result depends on
RUN_SETTINGS = ("regenerated", "train", "held_out", "max_length", "taps", "layers", "steps", "batch_size", "anchors",
                "eval_limit", "noise", "seed", "device")


@contextlib.contextmanager
def reintroduced(patches: tuple[str, ...], noise_std: float, seed: int):
    """Put the named bugs back into the trainer for the duration of the block (this script only)."""
    saved = (train_mod.check_label_sources, train_mod.micro_batch, masks.visible)
    try:
        if "label_tap" in patches:  # the guard against mistake 2 of docs/conventions.md
            train_mod.check_label_sources = lambda *a, **k: None
        if "noise_label" in patches:  # mistake 3 of docs/conventions.md: the KL targets see the fc inputs' noise too
            g = torch.Generator().manual_seed(seed)
            clean_micro_batch = saved[1]

            def noisy_micro_batch(input_ids, loss_mask, ctx_valid, features, anchors, anchor_valid, block_size,
                                  final_hidden=None):
                if final_hidden is not None:
                    final_hidden = add_feature_noise(final_hidden, noise_std, g)
                return clean_micro_batch(input_ids, loss_mask, ctx_valid, features, anchors, anchor_valid, block_size,
                                         final_hidden)

            train_mod.micro_batch = noisy_micro_batch
        if "anchor_visible" in patches:  # mistake 6 of docs/conventions.md: context position == anchor is visible
            clean_visible = saved[2]

            def leaky_visible(q_anchor, q_block, k_pos, k_block, window):
                return clean_visible(q_anchor + 1, q_block, k_pos, k_block, window)

            masks.visible = leaky_visible
        yield
    finally:
        train_mod.check_label_sources, train_mod.micro_batch, masks.visible = saved


class HeldOut:
    """Cached samples `idx`, features reduced to `layer_ids` in that order (what `evaluate_offline` reads)."""

    def __init__(self, cache: FeatureCache, idx: list[int], layer_ids: list[int]) -> None:
        H, have = cache.hidden_size, cache.layer_ids
        self.cache, self.idx = cache, idx
        self.cols = torch.cat([torch.arange(have.index(i) * H, (have.index(i) + 1) * H) for i in layer_ids])

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, j: int) -> FeatureSample:
        s = self.cache[self.idx[j]]  # IndexError past the end ends iteration
        return FeatureSample(s.id, s.input_ids, s.loss_mask, s.features[:, self.cols])


@torch.no_grad()
def target_diagnostics(target, cache: FeatureCache, idx: list[int], noise_std: float, seed: int) -> dict[str, float]:
    """On held-out answers, with the target's LM head on the cached final hidden state h (layer L-1):
    how often the data's token at p + 1 is argmax head(h[p]) (hard labels vs KL targets; also what
    a drafter sees for slot 1 of anchor p when the anchor's own position leaks into the context),
    how often it is argmax head(h[p - 1]) (the latest final state the strict mask shows), and how
    far `noise_std` noise on h moves the KL targets."""
    last = cache.layer_ids.index(target.num_layers - 1)
    H = cache.hidden_size
    g = torch.Generator().manual_seed(seed)
    same, visible, kept, kl, n = 0, 0, 0, 0.0, 0
    for i in idx:
        s = cache[i]
        pos = s.loss_mask[1:].nonzero().squeeze(1)  # anchors p: the token at p + 1 is slot 1's label
        pos = pos[pos >= 1]
        h = s.features[:, last * H:(last + 1) * H].to(device=target.device, dtype=target.dtype)  # [T, H]
        top = target.lm_head(h).argmax(-1).cpu()
        lp = torch.log_softmax(target.lm_head(h[pos]).float(), -1)
        lq = torch.log_softmax(target.lm_head(add_feature_noise(h[pos], noise_std, g)).float(), -1)
        same += int((top[pos] == s.input_ids[pos + 1]).sum())
        visible += int((top[pos - 1] == s.input_ids[pos + 1]).sum())
        kept += int((lq.argmax(-1) == lp.argmax(-1)).sum())
        kl += float((lp.exp() * (lp - lq)).sum())
        n += len(pos)
    return {"positions": n, "label_is_argmax_of_final_at_anchor": same / n,
            "label_is_argmax_of_final_before_anchor": visible / n,
            "noised_argmax_unchanged": kept / n, "noised_kl_nats": kl / n}


def prepare(a: argparse.Namespace, target) -> tuple[FeatureCache, list[int], list[int], list[int]]:
    """Tokenize, extract once; returns (cache, taps, train indices, held-out indices)."""
    out = Path(a.out)
    n = a.train + a.held_out
    tok = out / "tokenized.jsonl"
    if not tok.is_file() or len(load_tokenized(tok)) != n:
        stats = tokenize_file(a.regenerated, target.tokenizer, tok, max_length=a.max_length, limit=n)
        log.info("tokenized: %s", stats)
    samples = load_tokenized(tok)
    if len(samples) != n:
        raise ValueError(f"{a.regenerated}: {len(samples)} usable samples, --train + --held-out asks for {n}")
    taps = default_target_layer_ids(target.num_layers, a.taps)
    last = target.num_layers - 1
    if last in taps:
        raise ValueError(f"--taps {a.taps}: the default taps would include the final layer {last}")
    t0 = time.perf_counter()
    extract_features(target, samples, taps + [last], out / "feats", dtype="bfloat16", batch_size=4)
    log.info("features ready in %.0fs", time.perf_counter() - t0)
    train_idx, held = train_mod.split_eval(n, a.held_out, a.seed)
    if len(held) != a.held_out or set(train_idx) & set(held):
        raise ValueError(f"--held-out {a.held_out}: the trainer holds out at most a fifth of the data ({n // 5})")
    return FeatureCache(out / "feats"), taps, train_idx, held


def run_variant(name: str, a: argparse.Namespace, target, cache: FeatureCache, taps: list[int], held: list[int]) -> dict:
    what, overrides, patches = VARIANTS[name]
    run_dir = Path(a.out) / name
    done = run_dir / "ablation.json"
    settings = {k: getattr(a, k) for k in RUN_SETTINGS}
    if done.is_file():
        old = json.loads(done.read_text())
        if old.get("settings") == settings:
            return old
        log.info("%s: stored result has other settings; running it again", name)
    last = target.num_layers - 1
    tap_ids = taps + [last] if "label_tap" in patches else taps
    cfg = load_config(None, [
        f"target.device={target.device}", f"target.dtype={str(target.dtype).removeprefix('torch.')}",
        f"train.output_dir={run_dir}",
        f"drafter.num_layers={a.layers}", f"drafter.num_taps={len(tap_ids)}", f"drafter.target_layer_ids={tap_ids}",
        f"data.max_length={a.max_length}", f"train.max_steps={a.steps}", f"train.batch_size={a.batch_size}",
        f"train.micro_batch_size={a.batch_size}", f"train.anchors_per_seq={a.anchors}",
        f"train.eval_samples={a.held_out}", f"train.eval_every={a.steps}", f"train.save_every={a.steps}",
        "train.log_every=1", "train.tensorboard=false", f"train.seed={a.seed}",
        *([f"train.feature_noise={a.noise}"] if "noise" in patches else []), *overrides])
    t0 = time.perf_counter()
    with reintroduced(patches, a.noise, a.seed):
        train_mod.train(cfg, target=target, samples=cache, feature_layer_ids=cache.layer_ids)
    t_train = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    tr = [r for r in rows if r["kind"] == "train"][-a.tail:]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    drafter = load_drafter(run_dir / "final", target, device=target.device, dtype=target.dtype)
    t1 = time.perf_counter()
    rep = evaluate_offline({name: drafter}, target, HeldOut(cache, held, tap_ids), methods=("dflash", "ddtree"),
                           budgets=(16,), limit=a.eval_limit)
    m = rep["drafters"][name]["methods"]
    result = {
        "variant": name, "what": what, "overrides": overrides, "patches": list(patches), "taps": tap_ids,
        "settings": settings,
        "train_seconds": round(t_train, 1), "offline_eval_seconds": round(time.perf_counter() - t1, 1),
        "train_loss_tail": sum(r["loss"] for r in tr) / len(tr), "train_acc_tail": sum(r["acc"] for r in tr) / len(tr),
        "heldout_tau_sim": ev["tau_sim"], "heldout_acc": ev["acc"], "heldout_loss": ev["loss"],
        "heldout_slot_acc": ev["slot_acc"],
        "offline": {lab: {"tau": v["tau"], "rounds": v["rounds"], "tau_per_position": v["tau_per_position"],
                          "slot_acceptance": v["slot_acceptance"][:4]} for lab, v in m.items()},
        "offline_samples": rep["samples"], "offline_answer_tokens": rep["answer_tokens"],
    }
    atomic_write_json(done, result)
    return result


def markdown(results: list[dict], setup: dict) -> str:
    lines = [
        f"| variant | what differs | held-out τ_sim (trainer) | held-out acc | train acc (last {setup['tail']} steps) "
        "| offline τ DFlash | offline τ DDTree-16 | train s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        off = r["offline"]
        lines.append(f"| {r['variant']} | {r['what']} | {r['heldout_tau_sim']:.3f} | {r['heldout_acc']:.3f} | "
                     f"{r['train_acc_tail']:.3f} | {off['dflash']['tau']:.3f} | {off['ddtree-16']['tau']:.3f} | "
                     f"{r['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regenerated", default="runs/gpu-regen/regenerated.jsonl", help="the target's own answers (JSONL)")
    p.add_argument("--out", default="runs/ablation", help="work directory (tokenized data, features, one dir per variant)")
    p.add_argument("--train", type=int, default=160, help="training samples")
    p.add_argument("--held-out", type=int, default=32, help="held-out samples (at most a fifth of train + held-out)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--taps", type=int, default=5, help="fc taps (the default layers; fc-label adds layer L-1)")
    p.add_argument("--layers", type=int, default=1, help="drafter layers")
    p.add_argument("--steps", type=int, default=36, help="optimiser steps, the same for every variant")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    p.add_argument("--eval-limit", type=int, default=12,
                   help="held-out samples for the offline tau (the first of the split; the trainer's tau_sim uses all)")
    p.add_argument("--noise", type=float, default=1.0, help="feature noise std (absolute) for the noise variants")
    p.add_argument("--tail", type=int, default=10, help="training accuracy = mean over the last TAIL steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    p.add_argument("--device", default="cpu", help="cpu (float32 target) or cuda (bfloat16 target)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--json", help="write setup + results here")
    a = p.parse_args()
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    if not Path(a.regenerated).is_file():
        p.error(f"--regenerated: {a.regenerated} does not exist (write it with `dflashkit regenerate`)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    target = load_target(dtype="bfloat16" if a.device.startswith("cuda") else "float32", device=a.device)
    cache, taps, train_idx, held = prepare(a, target)
    setup = {"date": time.strftime("%Y-%m-%d %H:%M"),
             "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                        f"{a.threads} thread(s), {target.device} {str(target.dtype).removeprefix('torch.')}",
             "target": target.name, "train_samples": len(train_idx), "held_out_samples": len(held), "taps": taps,
             "cached_layers": cache.layer_ids, "drafter_layers": a.layers, "steps": a.steps, "batch_size": a.batch_size,
             "anchors_per_seq": a.anchors, "noise_std": a.noise, "tail": a.tail,
             "offline_eval_samples": min(a.eval_limit or len(held), len(held)), "seed": a.seed,
             "max_length": a.max_length}
    setup["diagnostics"] = target_diagnostics(target, cache, held[:4], a.noise, a.seed)
    log.info("setup %s", setup)
    results = []
    for name in names:
        results.append(run_variant(name, a, target, cache, taps, held))
        log.info("%s: %s", name, results[-1])
    setup["total_seconds"] = round(time.perf_counter() - t0, 1)
    table = markdown(results, setup)
    print(json.dumps(setup, indent=1))
    print(table)
    if a.json:
        atomic_write_json(Path(a.json), {"setup": setup, "results": results, "markdown": table})


if __name__ == "__main__":
    main()
