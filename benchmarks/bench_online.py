"""The whole online training step at real shapes, random weights: `train()` itself, with the
target in the process computing each micro-batch's features.

Shapes: a Qwen3-8B-shaped target (36 layers, hidden 4096, vocab 151936) and a Qwen3.6-27B-shaped
hybrid (64 layers, 48 Gated DeltaNet, hidden 5120, vocab 248320; 53.8 GB in bf16), each with the
drafter `train()` builds for it by default (5 layers, 5 taps; for the hybrid the published
drafter's shape: four sliding-window layers of 2048 and one full, about 1.8B parameters).
Samples: 2,048 tokens each (a 256-token prompt, then the answer), `--anchors` blocks of 16 per
sample, micro-batches of one sample, `--batch` samples per optimiser step.

Per step, from CUDA events recorded inside the real loop (no synchronisation added): the
target's forward, the drafter's forward + backward, the optimiser step, and the host's batch
preparation (CPU time outside the target's forward). Then samples/s and answer tokens/s over the
timed steps (the first `--warmup` steps compile and are left out), whole-step MFU (the target at
2·N·tokens for the N parameters of the layers it runs, plus the drafter's counted FLOPs, against
a bf16 matmul measured in the same run) and the peak memory.

`--profile` then runs `--profile-steps` more steps of the first run under torch.profiler and writes
bench_online-profile.json: the kernels' time per step by kind (matmul, attention, Gated DeltaNet,
conv1d, elementwise, reduction, copy, optimizer, ...; `dflashkit.bench.profile`), each kind's
heaviest kernels, the step's wall and device-busy time, and the timed steps' phases per step for
comparison (profiled steps are slower and stay out of the timed figures). On a CPU the kinds are
the operators' self times. `--trace` also writes the Chrome trace (large at real shapes).

    python benchmarks/bench_online.py --shape qwen3-8b --anchors 256,512
    python benchmarks/bench_online.py --shape qwen3.6-27b --anchors 256 train.optimizer_state=host
    python benchmarks/bench_online.py --tiny                 # CPU smoke test of the same code
    python benchmarks/bench_online.py --shape qwen3.6-27b --anchors 256 --memory-cap 74 --steps 2 --warmup 1 \
        --profile --profile-steps 1 train.optimizer_state=host
    torchrun --nproc-per-node 8 benchmarks/bench_online.py --shape qwen3.6-27b --batch 64 train.parallel=fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from bench_train import matmul_ceiling, step_flops
from dflashkit import train as train_mod
from dflashkit.bench.profile import format_table, profiler, summarize
from dflashkit.config import load_config
from dflashkit.data import features as features_mod
from dflashkit.data.chat import TokenizedSample
from dflashkit.drafter import default_target_layer_ids
from dflashkit.target import Target

# Under torchrun every rank runs the same loop on its share of each optimiser step; rank 0 reports.
RANK, LOCAL_RANK, WORLD = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))

SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
}


def random_target(shape: dict, device: torch.device, dtype: torch.dtype) -> Target:
    """A target of `shape` with random weights, built in `dtype` on the device (a 27B model built
    in fp32 and cast would not fit an 80 GB card)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if "linear_num_key_heads" in shape:  # three Gated DeltaNet layers, then one full attention
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(shape["num_hidden_layers"])]
        cls, cfg = Qwen3_5ForCausalLM, Qwen3_5TextConfig(**shape, layer_types=types, tie_word_embeddings=False)
    else:
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(**shape, tie_word_embeddings=False)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    return Target(model, None, name=f"{cfg.model_type}-random")


def random_samples(n: int, length: int, prompt: int, vocab: int) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(0)
    return [TokenizedSample(str(i), torch.randint(17, vocab - 1, (length,), generator=g).tolist(),
                            [0] * prompt + [1] * (length - prompt)) for i in range(n)]


class Phases:
    """CUDA events around the loop's parts, read once at the end (events need no synchronisation
    to record); on a CPU, wall time."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.spans = cuda, {}
        self.host_s: list[float] = []

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self.mark()
        yield
        self.spans.setdefault(name, []).append((start, self.mark()))

    def ms(self, name: str, skip: int, stop: int | None = None) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        pairs = self.spans.get(name, [])[skip:stop]
        return [a.elapsed_time(b) if self.cuda else 1e3 * (b - a) for a, b in pairs]


@contextmanager
def instrumented(phases: Phases, flops: list[float]) -> Iterator[None]:
    """Time the real loop's parts: the target's forward (`online_features`), the micro-batches'
    forward + backward (`Trainer.accumulate`, which builds them), the update, whole steps."""
    real_features, real_acc = features_mod.online_features, train_mod.Trainer.accumulate
    real_update, real_build = train_mod.Trainer.update, train_mod.Batcher.build

    launch = [0.0]  # host seconds spent launching the target's forward

    def online_features(*a, **k):
        t = time.perf_counter()
        with phases.span("target"):
            out = real_features(*a, **k)
        launch[0] += time.perf_counter() - t
        return out

    def build(self, items, held_out=False):
        t, launch[0] = time.perf_counter(), 0.0
        mb = real_build(self, items, held_out)
        if not held_out:
            phases.host_s.append(time.perf_counter() - t - launch[0])
            flops.append(step_flops(self.cfg, mb))
        return mb

    def accumulate(self, batches, n):
        with phases.span("accumulate"):
            return real_acc(self, batches, n)

    def update(self, acc):
        with phases.span("update"):
            return real_update(self, acc)

    features_mod.online_features, train_mod.Batcher.build = online_features, build
    train_mod.Trainer.accumulate, train_mod.Trainer.update = accumulate, update
    try:
        yield
    finally:
        features_mod.online_features, train_mod.Batcher.build = real_features, real_build
        train_mod.Trainer.accumulate, train_mod.Trainer.update = real_acc, real_update


def target_flops(target: Target, taps_deepest: int, tokens: int) -> float:
    """2·N·tokens for the parameters of the decoder layers the feature pass runs."""
    n = sum(p.numel() for layer in list(target.layers)[: taps_deepest + 1] for p in layer.parameters())
    return 2.0 * n * tokens


def run(shape_name: str, anchors: int, args: argparse.Namespace, target: Target, overrides: list[str],
        ceiling: float | None, profile: bool = False) -> dict:
    """One run of `train()`: warm-up and timed steps, then with `profile` `--profile-steps` more
    under the profiler (left out of the timed figures) -> the timed figures."""
    cuda = target.device.type == "cuda"
    timed_end = args.warmup + args.steps
    steps = timed_end + (args.profile_steps if profile else 0)
    samples = random_samples(args.batch * steps + 2, args.seq, args.prompt, target.vocab_size)
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    out_dir = tempfile.mkdtemp(prefix="bench_online_", dir=args.work)  # train() writes final/ there
    cfg = load_config(None, [f"train.output_dir={out_dir}", f"train.max_steps={steps}", f"train.batch_size={args.batch}",
                             "train.micro_batch_size=1", f"train.anchors_per_seq={anchors}", "train.eval_samples=1",
                             "train.eval_every=1000000", "train.save_every=1000000", "train.tensorboard=false",
                             f"train.log_every={steps}", f"data.max_length={args.seq}",
                             f"drafter.mask_token_id={target.vocab_size - 1}", f"target.device={target.device}",
                             *overrides])
    phases, flops = Phases(cuda), []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_wall: list[float] = []
    real_step = train_mod.Trainer.step
    prof = profiler(cuda) if profile else None

    def step(self, batches, n):
        if prof is not None and len(step_wall) == timed_end:
            prof.start()
        t = time.perf_counter()
        out = real_step(self, batches, n)  # ends in a host read of the step's statistics
        step_wall.append(time.perf_counter() - t)
        if prof is not None and len(step_wall) == steps:
            prof.stop()
        return out

    # No resumable checkpoint: at the 27B shape one is 26 GB (weights, master copy, moments).
    real_save, train_mod.save_checkpoint = train_mod.save_checkpoint, lambda *a, **k: None
    train_mod.Trainer.step = step
    try:
        with instrumented(phases, flops):
            train_mod.train(cfg, target=target, samples=samples)
    finally:
        train_mod.Trainer.step, train_mod.save_checkpoint = real_step, real_save
        if prof is not None and timed_end <= len(step_wall) < steps:  # a step failed while profiled
            prof.stop()
    res = figures(shape_name, anchors, args, target, cfg, overrides, ceiling, phases, flops, step_wall)
    if prof is not None and RANK == 0:
        write_profile(prof, cuda, args, res, step_wall[timed_end:])
    return res


def figures(shape_name: str, anchors: int, args: argparse.Namespace, target: Target, cfg: Any, overrides: list[str],
            ceiling: float | None, phases: Phases, flops: list[float], step_wall: list[float]) -> dict:
    """The timed steps' medians (the steps after `--warmup`, before any profiled one), rates,
    MFU and peak memory."""
    cuda = target.device.type == "cuda"
    w, b = args.warmup, args.batch // WORLD  # this rank's samples per optimiser step
    end = w + args.steps
    target_ms = statistics.median(phases.ms("target", w * b, end * b))  # per sample
    acc_ms = statistics.median(phases.ms("accumulate", w, end))  # per optimiser step: b samples' target + f+b
    update_ms = statistics.median(phases.ms("update", w, end))
    fb_ms = acc_ms / b - target_ms
    wall = statistics.median(step_wall[w:end])
    host = phases.host_s[w * b:end * b]
    answer = args.seq - args.prompt
    fl_drafter = statistics.fmean(flops[w * b:end * b]) * b  # this rank's
    deepest = max(default_target_layer_ids(target.num_layers, cfg.drafter.num_taps))
    fl_target = target_flops(target, deepest, args.seq) * b
    res = {"shape": shape_name, "anchors": anchors, "seq": args.seq, "batch": args.batch, "gpus": WORLD,
           "overrides": overrides,
           "steps_timed": args.steps, "step_s": round(wall, 3),
           "target_ms_per_sample": round(target_ms, 2), "drafter_fwd_bwd_ms_per_sample": round(fb_ms, 2),
           "optimizer_ms_per_step": round(update_ms, 2),
           "host_batch_ms_per_sample": round(1e3 * statistics.median(host), 2) if host else None,
           "samples_per_s": round(args.batch / wall, 2), "samples_per_s_per_gpu": round(b / wall, 2),
           "answer_tokens_per_s": round(args.batch * answer / wall),
           "tflop_per_step": round((fl_target + fl_drafter) / 1e12, 2),
           "tflops": round((fl_target + fl_drafter) / wall / 1e12, 1),
           "drafter_tflops": round(fl_drafter / (b * fb_ms / 1e3) / 1e12, 1)}
    if ceiling:
        res["mfu"] = round(res["tflops"] / ceiling, 3)
        res["drafter_mfu"] = round(res["drafter_tflops"] / ceiling, 3)
    if cuda:
        res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        res["reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return res


def write_profile(prof: Any, cuda: bool, args: argparse.Namespace, res: dict, wall_s: list[float]) -> None:
    """bench_online-profile.json (and with `--trace` the Chrome trace) in --out: the profiled
    steps' kinds, wall and device-busy time, beside the timed steps' phases scaled to a step."""
    b = args.batch // WORLD
    host = res["host_batch_ms_per_sample"]
    report = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              **{k: res[k] for k in ("shape", "anchors", "seq", "batch", "gpus", "overrides")},
              **summarize(prof, cuda, len(wall_s)),
              "wall_ms_per_step": round(1e3 * statistics.fmean(wall_s), 1),
              "timed_phases_ms_per_step": {  # from the timed (unprofiled) steps, bench_online.json's figures
                  "step": round(1e3 * res["step_s"], 1),
                  "target_forward": round(res["target_ms_per_sample"] * b, 1),
                  "drafter_fwd_bwd": round(res["drafter_fwd_bwd_ms_per_sample"] * b, 1),
                  "optimizer": res["optimizer_ms_per_step"],
                  "host_batch_overlapped": None if host is None else round(host * b, 1)}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_online-profile.json").write_text(json.dumps(report, indent=1))
    if args.trace:
        prof.export_chrome_trace(str(out / "bench_online-profile-trace.json.gz"))
    print(format_table(report))
    print(f"wall {report['wall_ms_per_step']} ms/step profiled; timed phases per step (ms): "
          f"{report['timed_phases_ms_per_step']}", flush=True)


def print_table(rows: list[dict]) -> None:
    cols = [("shape", 12), ("anchors", 8), ("settings", 24), ("target ms", 10), ("f+b ms", 8), ("opt ms", 8),
            ("host ms", 8), ("step s", 7), ("samples/s", 10), ("ans tok/s", 10), ("MFU", 6), ("peak GiB", 9)]
    print("".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}" for i, (c, w) in enumerate(cols)))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<12}{r['anchors']:<8}{' '.join(r['overrides'])[:23]:<24} ERROR {r['error'][:300]}")
            continue
        vals = [r["target_ms_per_sample"], r["drafter_fwd_bwd_ms_per_sample"], r["optimizer_ms_per_step"],
                r["host_batch_ms_per_sample"], r["step_s"], r["samples_per_s"], r["answer_tokens_per_s"], r.get("mfu"),
                r.get("peak_gib")]
        print(f"{r['shape']:<12}{r['anchors']:<8}{' '.join(r['overrides'])[:23]:<24}"
              + "".join(f"{str(v):>{w}}" for v, (_, w) in zip(vals, cols[3:])))
    print("target / f+b / host: per sample (micro-batch); opt: per optimiser step; f+b includes waiting for the "
          "host's batch when the GPU outruns it, and with train.optimizer_state=host for the last update, which "
          "streams on its own stream while the step's first target forwards run (opt: its part on the main stream)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized hybrid target (smoke test)")
    ap.add_argument("--anchors", default="256", help="comma-separated anchors per sample, one run each")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sample (no loss)")
    ap.add_argument("--batch", type=int, default=16, help="samples per optimiser step")
    ap.add_argument("--steps", type=int, default=4, help="timed optimiser steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (compilation)")
    ap.add_argument("--variants", default="", help="';'-separated sets of extra overrides, each run after the plain one "
                    "(e.g. 'train.optimizer_state=host')")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_online.json")
    ap.add_argument("--work", default=None, help="folder for the runs' output directories (the drafter's final/: "
                    "3.7 GB at the 27B shape); default: the system's temporary folder")
    ap.add_argument("--memory-cap", type=float, default=None, metavar="GIB",
                    help="cap the process's GPU memory (torch.cuda.set_per_process_memory_fraction): a run that "
                    "completes fits that much")
    ap.add_argument("--profile", action="store_true", help="after the first run's timed steps, profile "
                    "--profile-steps more and write bench_online-profile.json (kernel time by kind)")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps under the profiler (with --profile)")
    ap.add_argument("--trace", action="store_true", help="with --profile, also write the Chrome trace "
                    "(bench_online-profile-trace.json.gz; large at real shapes)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (section.field=value)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = (torch.device("cuda", LOCAL_RANK), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if cuda:
        torch.cuda.set_device(device)
    if args.tiny:
        args.seq, args.prompt, args.batch, args.steps, args.warmup = min(args.seq, 96), 16, 2, 2, 1
    shape_name = "tiny" if args.tiny else args.shape
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "runs": []}
    report["matmul_tflops"] = round(matmul_ceiling(device), 1) if cuda else None
    if cuda and args.memory_cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap * 2**30 / total))
        report["memory_cap_gib"] = args.memory_cap
    t = time.perf_counter()
    target = random_target(SHAPES[shape_name], device, dtype)
    report["target_build_s"] = round(time.perf_counter() - t, 1)
    report["target_gib"] = round(sum(p.numel() * p.element_size() for p in target.model.parameters()) / 2**30, 2)
    out = Path(args.out) / f"bench_online_{shape_name}.json"
    variants = [[]] + [v.split() for v in args.variants.split(";") if v.strip()]
    for anchors in [int(a) for a in args.anchors.split(",")]:
        for extra in variants:
            overrides = [*args.overrides, *extra]
            try:
                r = run(shape_name, anchors, args, target, overrides, report["matmul_tflops"],
                        profile=args.profile and not report["runs"])
            except Exception as e:  # report and carry on (an out-of-memory run is a result)
                r = {"shape": shape_name, "anchors": anchors, "overrides": overrides,
                     "error": f"{type(e).__name__}: {e}"[:2000]}
                if cuda:
                    r["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            report["runs"].append(r)
            if RANK == 0:
                print(json.dumps(r), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
            if cuda:
                torch.cuda.empty_cache()
    if RANK == 0:
        print_table(report["runs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
