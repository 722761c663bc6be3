"""Training-step speed of the trainer at real shapes, random weights.

Default shapes: a 5-layer drafter for a Qwen3-8B-shaped target (hidden 4096, intermediate 12288,
32/8 heads, head dim 128, vocab 151936, taps [1, 9, 17, 25, 33]), one sequence of 3072 tokens,
512 anchors, block 16, bf16. Only the target's embedding and LM head are needed (random), and
random features stand in for its 36 layers. Reports ms per step (forward + backward, and the full
optimiser step), block-tokens/s, model FLOP/s and MFU against an 8192^3 bf16 matmul measured in
the same run, and memory, for each attention path (FlexAttention block-sparse, dense mask) and
each objective: ours (the chunked LM head of `objective.py`) and SpecForge's DFlash loss
(`--objectives ours,specforge`: the same drafter, masks and batch; the LM head on every block slot at once, its
[slots, vocab] logits kept for backward, `F.cross_entropy`; see `specforge_objective`), and each
drafter kind (`--kinds dflash,dflash2`: the same backbone with DFlash 2's block convolutions and
candidate selector, `KINDS`; `--smollm2` at the bundled SmolLM2 drafter's shape and batch, where the
two were compared).

Memory columns (GiB): `resident` = what lives between steps (bf16 drafter, the target's embedding
and LM head, the batch, fp32 master weights and AdamW moments); `f+b w-only` = the
peak of forward + backward counted on bf16 weights alone (no master copy, no optimiser state: the
footing of a bare objective measurement); `peak GiB` = the trainer's peak over forward + backward and
the full optimiser step, everything resident. All three count from what was in use before the
variant started (`baseline_gib` in the JSON). On CPU they are the process's resident set (VmRSS /
VmHWM): a coarser count than the CUDA allocator's.

`--max-seq GIB`: the longest sequence (anchors per sequence fixed at the recipe's) whose full
training step fits in GIB: the trainer's peak measured at two lengths, extrapolated linearly, then
checked under `torch.cuda.set_per_process_memory_fraction` by a bisection around that prediction
(`bisect_longest`; the limit lies between `fits` and `fails_at`). The target model itself is not
resident here.

    python benchmarks/bench_train.py                      # GPU, the shapes above
    python benchmarks/bench_train.py --tiny               # CPU smoke test of the same code
    python benchmarks/bench_train.py --mid --variants sdpa:eager --objectives ours,specforge   # CPU memory
    python benchmarks/bench_train.py --variants flex:compile --objectives ours,specforge --max-seq 40
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --scaling   # DDP weak scaling
    python benchmarks/bench_train.py --variants pipeline  # `train()` end to end, SmolLM2-shaped random target
    python benchmarks/bench_train.py --smollm2 --variants flex:compile --kinds dflash,dflash2   # a DFlash 2 step's cost
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dflashkit import masks
from dflashkit import objective as objective_mod
from dflashkit.bench.memory import bisect_longest
from dflashkit.drafter import DFlashDrafter, DrafterConfig, training_hidden
from dflashkit.objective import IGNORE, LossOut, micro_batch, pad_anchors, sample_anchors, slot_weights
from dflashkit.train import SEQ_MULTIPLE, Dist, Trainer, init_distributed

QWEN3_8B = dict(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, target_layers=36,
                taps=[1, 9, 17, 25, 33], layers=5, block=16, seq=3072, anchors=512, prompt=256)
TINY = dict(hidden=64, inter=128, heads=4, kv=2, head_dim=16, vocab=512, target_layers=8, taps=[1, 3, 5],
            layers=2, block=8, seq=96, anchors=16, prompt=8)
# The bundled SmolLM2-135M drafter's shape and recipe batch: 16 sequences of 1024 tokens, 512 anchors each.
SMOLLM2 = dict(hidden=576, inter=1536, heads=9, kv=3, head_dim=64, vocab=49152, target_layers=30, taps=[1, 8, 14, 20, 27],
               layers=4, block=16, seq=1024, anchors=512, prompt=256, seqs=16, frequent_head=True)
# A CPU-sized drafter with Qwen3's full vocabulary: where the LM head's memory shows on a CPU.
MID = dict(hidden=256, inter=768, heads=4, kv=2, head_dim=64, vocab=151936, target_layers=36, taps=[1, 9, 17, 25, 33],
           layers=2, block=16, seq=1024, anchors=128, prompt=64)


# The family's modules per kind (`--kinds`): DFlash 2 as the SmolLM2 comparison ran it.
KINDS = {"dflash": {}, "dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)}


def train_settings(**kw) -> SimpleNamespace:
    """The TrainConfig fields the Trainer reads (recipe values)."""
    base = dict(lr=6e-4, weight_decay=0.0, warmup_ratio=0.04, grad_clip=1.0, parallel="auto", optimizer_state="device",
                loss="ce", gamma=None,
                kl_weight=1.0, kl_temperature=1.0, dpace_alpha=0.5, selector_loss_alpha=1.0, confidence_head_alpha=1.0)
    return SimpleNamespace(**{**base, **kw})


def matmul_ceiling(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """bf16 n^3 matmul TFLOP/s: median of `reps` after warm-up, rotating 3 random input sets."""
    xs = [(torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16))
          for _ in range(3)]
    for a, b in xs:
        a @ b
    times = []
    for i in range(reps):
        a, b = xs[i % 3]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0, kind: str = "dflash"):
    """(drafter, embedding, LM head weight) at `shape`, random; a drafter of `kind` (`KINDS`)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
                        vocab_size=shape["vocab"], num_target_layers=shape["target_layers"], target_layer_ids=shape["taps"],
                        mask_token_id=shape["vocab"] - 1, block_size=shape["block"], **KINDS[kind])
    with torch.device(device):
        drafter = DFlashDrafter(cfg)
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dtype).requires_grad_(False)
        head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
        if shape.get("frequent_head"):
            # A trained head's top-K holds the frequent tokens in most rows (what the selector's codebook
            # gradient sums): rows with norms falling along the vocabulary give random hidden states that
            # skew (top-16: the first token in ~1/4 of rows, the first 100 ~60 % of all candidates).
            head *= 1 + 6 / (1 + torch.arange(cfg.vocab_size, dtype=torch.float32)[:, None] / 16).sqrt()
        head = head.to(dtype)
    return drafter, embed, head


def build_batch(shape: dict, cfg: DrafterConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                seq: int | None = None):
    """One micro-batch: `shape['seqs']` (default 1) sequences of `seq` tokens (default the shape's),
    `shape['anchors']` anchors each."""
    T, n = seq or shape["seq"], shape.get("seqs", 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size - 1, (n, T), generator=g)
    loss_mask = torch.ones(n, T, dtype=torch.bool)
    loss_mask[:, : shape["prompt"]] = False
    anchors, valid = pad_anchors([sample_anchors(m, shape["anchors"], g) for m in loss_mask])
    feats = torch.randn(n, T, cfg.num_taps * cfg.hidden_size, device=device, dtype=dtype,
                        generator=torch.Generator(device).manual_seed(seed))
    return micro_batch(ids, loss_mask, torch.ones_like(loss_mask), feats, anchors, valid, cfg.block_size).to(device)


def specforge_objective(model, embed, head_weight: torch.Tensor, mb, settings, backend: str) -> LossOut:
    """SpecForge's DFlash loss (`OnlineDFlashModel.forward`, loss_type 'dflash', decay gamma) on
    our drafter, masks and batch: the LM head on every block slot at once ([slots, vocab] logits,
    kept for backward with their log-softmax), `F.cross_entropy` per slot, the decay-weighted mean
    over labelled slots, argmax accuracy. Same loss value as ours; only the memory layout differs."""
    B = model.config.block_size
    hidden = training_hidden(model, embed, mb.input_ids, mb.features, mb.anchors, mb.ctx_valid, backend)
    logits = (hidden @ head_weight.T).flatten(0, 1)  # [b * n * B, V]
    labels = mb.labels.flatten()
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    w = slot_weights(B, settings.gamma, logits.device).repeat(labels.numel() // B) * valid
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
    slot = torch.arange(labels.numel(), device=labels.device) % B
    return LossOut(loss_sum=(w * ce).sum(), weight_sum=w.sum().detach(),
                   slot_correct=torch.zeros(B, device=ce.device).index_add_(0, slot, hit.float()),
                   slot_count=torch.zeros(B, device=ce.device).index_add_(0, slot, valid.float()),
                   accept_len=1 + hit.view(-1, B)[:, 1:].long().cumprod(-1).sum(-1),
                   block_valid=valid.view(-1, B).any(-1))


OBJECTIVES = ("ours", "specforge")


class Memory:
    """Bytes in use now and at peak since `reset`: the CUDA caching allocator's counters on GPU; on
    a Linux CPU the process's resident set (VmRSS, VmHWM reset through /proc/self/clear_refs)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @staticmethod
    def _status(key: str) -> float | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def now(self) -> float | None:
        return float(torch.cuda.memory_allocated()) if self.cuda else self._status("VmRSS")

    def peak(self) -> float | None:
        return float(torch.cuda.max_memory_allocated()) if self.cuda else self._status("VmHWM")


def gib(x: float | None) -> float | None:
    return None if x is None else round(x / 2**30, 2)


def step_flops(cfg: DrafterConfig, mb) -> float:
    """Model FLOPs of one forward + backward: 3x forward for trained matmuls, 2x for the fc input
    (no input gradient) and the frozen LM head (no weight gradient), attention over visible pairs."""
    H, I, L, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim
    h, kv, V, B = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.block_size
    T = mb.input_ids.shape[1] * mb.input_ids.shape[0]
    q = mb.anchors.numel() * B
    rows = mb.label_rows.numel()
    block = L * q * 2 * (2 * H * h * d + 2 * H * kv * d + 3 * H * I)
    ctx_kv = L * T * 2 * (2 * H * kv * d)
    fc = T * 2 * cfg.num_taps * H * H
    pairs = float((B * (mb.anchors.float() + B)).sum())  # each slot sees the context before its anchor + its block
    attn = L * pairs * h * d * 4
    head = 2 * rows * H * V
    return 3 * (block + ctx_kv + attn) + 2 * (fc + head)


def make_trainer(shape: dict, device, dtype, backend: str, compile_: bool, d: Dist, objective: str, mem: Memory,
                 kind: str = "dflash"):
    """A Trainer on a random drafter of `kind`, its `_forward` swapped for `objective`; and the bytes in
    use once the bf16 weights (drafter, embedding, LM head) exist, before the trainer's fp32 state."""
    drafter, embed, head = build_model(shape, device, dtype, seed=d.rank, kind=kind)
    drafter.to(dtype)  # as the trainer will: count bf16 weights, not the fp32 they were drawn in
    weights = mem.now()
    trainer = Trainer(drafter, embed, head, train_settings(), total_steps=10_000, device=device, dtype=dtype, d=d,
                      backend=backend, compile=compile_)
    del head  # the trainer keeps its own reference
    if objective == "specforge":
        trainer._forward = lambda mb: specforge_objective(trainer.model, trainer.embed, trainer.head_weight, mb,
                                                          trainer.settings, backend)
    return trainer, weights


def time_variant(shape: dict, device, dtype, backend: str, compile_: bool, iters: int, warmup: int, d: Dist,
                 micro: int = 1, objective: str = "ours", kind: str = "dflash") -> tuple[dict, Trainer]:
    mem = Memory(device)
    base = mem.now()  # whatever an earlier variant left behind (interpreter and libraries on CPU): not ours
    trainer, weights = make_trainer(shape, device, dtype, backend, compile_, d, objective, mem, kind)
    drafter = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    before = mem.now()
    mb = build_batch(shape, drafter.config, device, dtype, seed=d.rank)
    if weights is not None:
        weights += mem.now() - before  # the batch belongs to both footings
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):  # compile + autotune happen here; the first step allocates the AdamW moments
        trainer.step([mb] * micro, micro)
    sync()
    warm_s = time.perf_counter() - t0

    loss = []

    def fwd_bwd():
        out = trainer._forward(mb)
        out.loss_sum.backward()
        loss[:] = [out.loss_sum.detach() / out.weight_sum]
        for p in trainer.params:
            p.grad = None

    res = {"backend": backend, "compile": compile_, "kind": kind, "objective": objective, "warmup_s": round(warm_s, 1),
           "micro_batches": micro}
    resident = mem.now()
    peaks = {}
    for name, fn in (("fwd_bwd", fwd_bwd), ("step", lambda: trainer.step([mb] * micro, micro))):
        times = []
        mem.reset()
        for _ in range(iters):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        peaks[name] = mem.peak()
        res[f"{name}_ms"] = round(1e3 * statistics.median(times), 2)
        res[f"{name}_ms_min"] = round(1e3 * min(times), 2)
    res["loss"] = round(float(loss[0]), 5)  # the same weights and batch: the objectives must agree
    # Mask construction alone (inside fwd_bwd already): how much of the step it is.
    layout = masks.training_layout(mb.anchors, drafter.config.block_size, mb.ctx_valid)
    sync()
    t = time.perf_counter()
    for _ in range(5):
        masks.layer_masks(layout, drafter.config.layer_types, None, backend)
    sync()
    res["mask_build_ms"] = round(1e3 * (time.perf_counter() - t) / 5, 2)
    flops = step_flops(drafter.config, mb)  # the useful work, whichever objective does it
    res["model_tflop_per_step"] = round(flops / 1e12, 2)
    res["tflops"] = round(flops / (res["fwd_bwd_ms"] / 1e3) / 1e12, 1)
    res["block_tokens_per_s"] = round(mb.anchors.numel() * drafter.config.block_size / (res["fwd_bwd_ms"] / 1e3))
    if resident is not None and None not in peaks.values():
        res["baseline_gib"] = gib(base)
        res["resident_gib"] = gib(resident - base)
        res["fwd_bwd_peak_gib"] = gib(peaks["fwd_bwd"] - base)
        res["step_peak_gib"] = gib(peaks["step"] - base)
        res["peak_mem_gib"] = gib(max(peaks.values()) - base)  # the trainer's peak, everything resident
        # The same forward + backward counted on bf16 weights alone: what it adds on top of resident.
        res["fwd_bwd_weights_only_gib"] = gib(weights - base + peaks["fwd_bwd"] - resident)
    return res, trainer


def step_peak(trainer: Trainer, mb, mem: Memory) -> float:
    """Peak bytes over one full training step on `mb` (after one unmeasured step: compilation)."""
    trainer.step([mb], 1)
    mem.reset()
    trainer.step([mb], 1)
    return mem.peak()


def longest_sequence(trainer: Trainer, shape: dict, device, dtype, budget_gib: float, seed: int, tries: int = 8) -> dict:
    """Longest sequence whose training step fits in `budget_gib`: the peak is about affine in the
    length at a fixed anchor count, so measure two lengths and extrapolate; then, under a memory
    cap (CUDA), bisect around that prediction (growth is not linear that far: the first H200 run
    ran out of memory 10, 20 and 27 % below it)."""
    cfg, mult, mem = trainer.cfg, SEQ_MULTIPLE, Memory(device)  # lengths as the trainer pads them
    t0, t1 = shape["seq"], 2 * shape["seq"]
    p0 = step_peak(trainer, build_batch(shape, cfg, device, dtype, seed, t0), mem)
    p1 = step_peak(trainer, build_batch(shape, cfg, device, dtype, seed, t1), mem)
    per_token = (p1 - p0) / (t1 - t0)
    budget = budget_gib * 2**30
    predicted = int(t0 + (budget - p0) / per_token) // mult * mult if per_token > 0 else None
    res = {"budget_gib": budget_gib, "peak_gib_at": {t0: gib(p0), t1: gib(p1)},
           "mib_per_1k_tokens": round(per_token * 1000 / 2**20, 1), "predicted": predicted, "fits": None}
    if device.type != "cuda" or predicted is None or predicted <= shape["prompt"] + shape["block"]:
        return res  # no allocator cap to check it against

    def fits(T: int) -> bool:
        torch.cuda.empty_cache()
        try:
            trainer.step([build_batch(shape, cfg, device, dtype, seed, T)], 1)
            return True
        except torch.cuda.OutOfMemoryError:
            trainer.optimizer.zero_grad(set_to_none=True)
            for p in trainer.params:
                p.grad = None
            return False

    total = torch.cuda.get_device_properties(device).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
        res.update(bisect_longest(fits, predicted, t1 if p1 <= budget else None, mult, tries))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    return res


def pipeline(steps: int, device: torch.device, out_dir: str, micro: int, tiny: bool = False) -> dict:
    """`train()` end to end (online features, variable lengths, eval, checkpoints) on a random
    SmolLM2-shaped target: the trainer loop's own speed, compile behaviour included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflashkit.config import load_config
    from dflashkit.data.chat import TokenizedSample
    from dflashkit.target import Target
    from dflashkit.train import train

    torch.manual_seed(0)
    lc = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=6 if tiny else 30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     rope_theta=100000.0)
    with torch.device(device):
        model = LlamaForCausalLM(lc).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = Target(model, None, name="smollm2-shaped-random")
    g = torch.Generator().manual_seed(0)
    samples = []
    lo, hi = (40, 120) if tiny else (150, 900)
    for i in range(400):
        T = int(torch.randint(lo, hi, (1,), generator=g))
        p = int(torch.randint(10, T // 3, (1,), generator=g))
        samples.append(TokenizedSample(str(i), torch.randint(17, 49152, (T,), generator=g).tolist(), [0] * p + [1] * (T - p)))
    cfg = load_config(None, [f"train.output_dir={out_dir}", f"train.max_steps={steps}", "train.batch_size=16",
                             f"train.micro_batch_size={micro}", "train.eval_every=1000000", "train.eval_samples=16",
                             "train.log_every=5", "train.save_every=1000000", "train.tensorboard=false",
                             "drafter.mask_token_id=16", f"target.device={device}",
                             *(["train.anchors_per_seq=16", "drafter.num_layers=2", "train.batch_size=4"] if tiny else [])])
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    t = time.perf_counter()
    train(cfg, target=target, samples=samples)
    wall = time.perf_counter() - t
    graphs = counters["stats"]["unique_graphs"] - graphs  # Dynamo graphs compiled (layers, loss tails)
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["kind"] == "train"]
    return {"steps": steps, "micro_batch": micro, "wall_s": round(wall, 1), "compiled_graphs": graphs,
            "block_tokens_per_s_last": round(tr[-1]["block_tokens_per_s"]) if tr else None,
            "loss_first_last": [tr[0]["loss"], tr[-1]["loss"]] if tr else None,
            "tau_sim": [r["tau_sim"] for r in rows if r["kind"] == "eval"]}


def print_table(rows: list[dict]) -> None:
    cols = [("variant", 14), ("kind", 8), ("objective", 10), ("fwd+bwd ms", 11), ("step ms", 9), ("TFLOP/s", 8), ("MFU", 6),
            ("blk-tok/s", 10), ("resident", 9), ("f+b w-only", 11), ("peak GiB", 9), ("mask ms", 8)]
    print("".join(f"{c:>{w}}" if i > 2 else f"{c:<{w}}" for i, (c, w) in enumerate(cols)))
    for r in rows:
        name = f"{r['backend']}:{'compile' if r['compile'] else 'eager'}"
        if "error" in r:
            print(f"{name:<14}{r.get('kind', 'dflash'):<8}{r['objective']:<10} ERROR {r['error'][:200]}")
            continue
        vals = [r["fwd_bwd_ms"], r["step_ms"], r["tflops"], r.get("mfu"), r["block_tokens_per_s"], r.get("resident_gib"),
                r.get("fwd_bwd_weights_only_gib"), r.get("peak_mem_gib"), r["mask_build_ms"]]
        print(f"{name:<14}{r['kind']:<8}{r['objective']:<10}" + "".join(f"{str(v):>{w}}" for v, (_, w) in zip(vals, cols[3:])))
    for r in rows:
        m = r.get("max_seq")
        if m:
            print(f"longest sequence in {m['budget_gib']} GiB, {r['backend']} {r['objective']}: predicted {m['predicted']} "
                  f"tokens ({m['mib_per_1k_tokens']} MiB per 1k tokens; peaks {m['peak_gib_at']} GiB), "
                  f"fits under the cap: {m['fits']}" + (f", out of memory at {m['fails_at']} (tried {m['tried']})"
                                                        if m.get("fails_at") else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (smoke test)")
    ap.add_argument("--mid", action="store_true", help="CPU, a small drafter with Qwen3's 151936-token vocabulary")
    ap.add_argument("--smollm2", action="store_true", help="the bundled SmolLM2 drafter's shape, 16 x 512 anchors a step")
    ap.add_argument("--kinds", default="dflash", help=f"comma-separated drafter kinds among {', '.join(KINDS)}")
    ap.add_argument("--variants", default="flex:compile,sdpa:compile",
                    help="comma-separated backend:compile|eager, or 'pipeline' (train() end to end)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--scaling", action="store_true", help="under torchrun: DDP step time with --micro micro-batches per rank")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per optimiser step (per rank)")
    ap.add_argument("--pipeline", type=int, default=20, metavar="STEPS", help="steps of the 'pipeline' variant (train())")
    ap.add_argument("--pipeline-micro", type=int, default=16)
    ap.add_argument("--objectives", default="ours", help=f"comma-separated among {', '.join(OBJECTIVES)}")
    ap.add_argument("--max-seq", type=float, default=None, metavar="GIB",
                    help="also find the longest sequence whose training step fits in GIB (per variant and objective)")
    ap.add_argument("--head-chunk-logits", type=int, default=None, metavar="N",
                    help="logits per LM-head chunk of our objective (default objective.HEAD_CHUNK_LOGITS)")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_train.json")
    args = ap.parse_args()
    objectives = args.objectives.split(",")
    if args.head_chunk_logits:
        objective_mod.HEAD_CHUNK_LOGITS = args.head_chunk_logits
    if any(o not in OBJECTIVES for o in objectives):
        ap.error(f"--objectives: expected names among {OBJECTIVES}, got {args.objectives!r}")
    kinds = args.kinds.split(",")
    if any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: expected names among {tuple(KINDS)}, got {args.kinds!r}")

    cuda = torch.cuda.is_available() and not (args.tiny or args.mid)
    d = init_distributed(cuda)
    device = torch.device("cuda", d.local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.tiny else MID if args.mid else SMOLLM2 if args.smollm2 else QWEN3_8B
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                    "shape": shape, "head_chunk_logits": objective_mod.HEAD_CHUNK_LOGITS,
                    "world": d.world, "variants": []}
    if cuda and not args.no_ceiling and d.main:
        report["matmul_tflops"] = round(matmul_ceiling(device), 1)
        print(f"bf16 8192^3 matmul: {report['matmul_tflops']} TFLOP/s", flush=True)

    out = Path(args.out) / f"bench_train{'_tiny' if args.tiny else '_mid' if args.mid else '_smollm2' if args.smollm2 else ''}{'_x' + str(d.world) if d.world > 1 else ''}.json"

    def save(r: dict) -> None:  # after each measurement: a killed run keeps what it measured
        if d.main:
            print(json.dumps(r), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))

    for v in args.variants.split(","):
        if v == "pipeline":
            if d.main:
                try:
                    r = pipeline(args.pipeline, device, tempfile.mkdtemp(prefix="bench_pipeline_"), args.pipeline_micro, args.tiny)
                except Exception as e:
                    r = {"error": f"{type(e).__name__}: {e}"[:2000]}
                report["pipeline"] = r
                print(json.dumps(r), flush=True)
            continue
        backend, mode, *micro = v.split(":")  # backend:compile|eager[:micro-batches per step]
        micro = int(micro[0]) if micro else args.micro
        if backend == "flex" and not cuda:
            continue  # no FlexAttention backward on CPU
        for kind, objective in [(k, o) for k in kinds for o in objectives if k == "dflash" or o == "ours"]:
            gc.collect()  # the previous trainer (a reference cycle through its swapped `_forward`) must be gone
            if cuda:
                torch.cuda.empty_cache()
            trainer = None
            try:
                r, trainer = time_variant(shape, device, dtype, backend, mode == "compile", args.iters, args.warmup, d,
                                          micro, objective, kind)
            except Exception as e:  # report and carry on with the other variants
                r = {"backend": backend, "compile": mode == "compile", "kind": kind, "objective": objective,
                     "error": f"{type(e).__name__}: {e}"[:2000]}
            if "matmul_tflops" in report and "tflops" in r:
                r["mfu"] = round(r["tflops"] / report["matmul_tflops"], 3)
            report["variants"].append(r)
            save(r)
            if trainer is not None and args.max_seq:
                try:
                    r["max_seq"] = longest_sequence(trainer, shape, device, dtype, args.max_seq, d.rank)
                except Exception as e:
                    r["max_seq_error"] = f"{type(e).__name__}: {e}"[:2000]
                save(r)
            del trainer
    if d.main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print_table(report["variants"])
    if d.world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
