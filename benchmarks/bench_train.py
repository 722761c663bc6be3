"""Training-step speed of the trainer at real shapes, random weights.

Default shapes: a 5-layer drafter for a Qwen3-8B-shaped target (hidden 4096, intermediate 12288,
32/8 heads, head dim 128, vocab 151936, taps [1, 9, 17, 25, 33]), one sequence of 3072 tokens,
512 anchors, block 16, bf16. Only the target's embedding and LM head are needed (random), and
random features stand in for its 36 layers. Reports ms per step (forward + backward, and the full
optimiser step), block-tokens/s, model FLOP/s and MFU against an 8192^3 bf16 matmul measured in
the same run, and peak memory, for each attention path (FlexAttention block-sparse, dense mask).

    python benchmarks/bench_train.py                      # GPU, the shapes above
    python benchmarks/bench_train.py --tiny               # CPU smoke test of the same code
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --scaling   # DDP weak scaling
    python benchmarks/bench_train.py --variants pipeline  # `train()` end to end, SmolLM2-shaped random target
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dflashkit import masks
from dflashkit.drafter import DFlashDrafter, DrafterConfig
from dflashkit.objective import micro_batch, pad_anchors, sample_anchors
from dflashkit.train import Dist, Trainer, init_distributed

QWEN3_8B = dict(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, target_layers=36,
                taps=[1, 9, 17, 25, 33], layers=5, block=16, seq=3072, anchors=512, prompt=256)
TINY = dict(hidden=64, inter=128, heads=4, kv=2, head_dim=16, vocab=512, target_layers=8, taps=[1, 3, 5],
            layers=2, block=8, seq=96, anchors=16, prompt=8)


def train_settings(**kw) -> SimpleNamespace:
    """The TrainConfig fields the Trainer reads (recipe values)."""
    base = dict(lr=6e-4, weight_decay=0.0, warmup_ratio=0.04, grad_clip=1.0, parallel="auto", loss="ce", gamma=None,
                kl_weight=1.0, kl_temperature=1.0, dpace_alpha=0.5)
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


def build_case(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(drafter, embedding, LM head weight, one micro-batch) at `shape`, random."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
                        vocab_size=shape["vocab"], num_target_layers=shape["target_layers"], target_layer_ids=shape["taps"],
                        mask_token_id=shape["vocab"] - 1, block_size=shape["block"])
    with torch.device(device):
        drafter = DFlashDrafter(cfg)
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dtype).requires_grad_(False)
        head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(dtype)
    T = shape["seq"]
    ids = torch.randint(0, cfg.vocab_size - 1, (1, T))
    loss_mask = torch.ones(1, T, dtype=torch.bool)
    loss_mask[:, : shape["prompt"]] = False
    anchors, valid = pad_anchors([sample_anchors(loss_mask[0], shape["anchors"], torch.Generator().manual_seed(seed))])
    feats = torch.randn(1, T, cfg.num_taps * cfg.hidden_size, device=device, dtype=dtype)
    mb = micro_batch(ids, loss_mask, torch.ones_like(loss_mask), feats, anchors, valid, cfg.block_size).to(device)
    return drafter, embed, head, mb


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


def time_variant(shape: dict, device, dtype, backend: str, compile_: bool, iters: int, warmup: int, d: Dist,
                 micro: int = 1) -> dict:
    drafter, embed, head, mb = build_case(shape, device, dtype, seed=d.rank)
    trainer = Trainer(drafter, embed, head, train_settings(), total_steps=10_000, device=device, dtype=dtype, d=d,
                      backend=backend, compile=compile_)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):  # compile + autotune happen here
        trainer.step([mb] * micro, micro)
    sync()
    warm_s = time.perf_counter() - t0

    def fwd_bwd():
        out = trainer._forward(mb)
        out.loss_sum.backward()
        for p in trainer.params:
            p.grad = None

    res = {"backend": backend, "compile": compile_, "warmup_s": round(warm_s, 1), "micro_batches": micro}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for name, fn in (("fwd_bwd", fwd_bwd), ("step", lambda: trainer.step([mb] * micro, micro))):
        times = []
        for _ in range(iters):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        res[f"{name}_ms"] = round(1e3 * statistics.median(times), 2)
        res[f"{name}_ms_min"] = round(1e3 * min(times), 2)
    # Mask construction alone (inside fwd_bwd already): how much of the step it is.
    layout = masks.training_layout(mb.anchors, drafter.config.block_size, mb.ctx_valid)
    sync()
    t = time.perf_counter()
    for _ in range(5):
        masks.layer_masks(layout, drafter.config.layer_types, None, backend)
    sync()
    res["mask_build_ms"] = round(1e3 * (time.perf_counter() - t) / 5, 2)
    flops = step_flops(drafter.config, mb)
    res["model_tflop_per_step"] = round(flops / 1e12, 2)
    res["tflops"] = round(flops / (res["fwd_bwd_ms"] / 1e3) / 1e12, 1)
    res["block_tokens_per_s"] = round(mb.anchors.numel() * drafter.config.block_size / (res["fwd_bwd_ms"] / 1e3))
    res["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
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
    t = time.perf_counter()
    train(cfg, target=target, samples=samples)
    wall = time.perf_counter() - t
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["kind"] == "train"]
    return {"steps": steps, "micro_batch": micro, "wall_s": round(wall, 1),
            "block_tokens_per_s_last": round(tr[-1]["block_tokens_per_s"]) if tr else None,
            "loss_first_last": [tr[0]["loss"], tr[-1]["loss"]] if tr else None,
            "tau_sim": [r["tau_sim"] for r in rows if r["kind"] == "eval"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (smoke test)")
    ap.add_argument("--variants", default="flex:compile,sdpa:compile",
                    help="comma-separated backend:compile|eager, or 'pipeline' (train() end to end)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--scaling", action="store_true", help="under torchrun: DDP step time with --micro micro-batches per rank")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per optimiser step (per rank)")
    ap.add_argument("--pipeline", type=int, default=20, metavar="STEPS", help="steps of the 'pipeline' variant (train())")
    ap.add_argument("--pipeline-micro", type=int, default=16)
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_train.json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.tiny
    d = init_distributed(cuda)
    device = torch.device("cuda", d.local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.tiny else QWEN3_8B
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                    "shape": shape, "world": d.world, "variants": []}
    if cuda and not args.no_ceiling and d.main:
        report["matmul_tflops"] = round(matmul_ceiling(device), 1)
        print(f"bf16 8192^3 matmul: {report['matmul_tflops']} TFLOP/s", flush=True)
    out = Path(args.out) / f"bench_train{'_tiny' if args.tiny else ''}{'_x' + str(d.world) if d.world > 1 else ''}.json"
    for v in args.variants.split(","):
        if v == "pipeline":
            if d.main:
                try:
                    r = pipeline(args.pipeline, device, "/tmp/bench_pipeline", args.pipeline_micro, args.tiny)
                except Exception as e:
                    r = {"error": f"{type(e).__name__}: {e}"[:2000]}
                report["pipeline"] = r
                print(json.dumps(r), flush=True)
            continue
        backend, mode, *micro = v.split(":")  # backend:compile|eager[:micro-batches per step]
        micro = int(micro[0]) if micro else args.micro
        if backend == "flex" and not cuda:
            continue  # no FlexAttention backward on CPU
        try:
            r = time_variant(shape, device, dtype, backend, mode == "compile", args.iters, args.warmup, d, micro)
        except Exception as e:  # report and carry on with the other variants
            r = {"backend": backend, "compile": mode == "compile", "error": f"{type(e).__name__}: {e}"[:2000]}
        if "matmul_tflops" in report and "tflops" in r:
            r["mfu"] = round(r["tflops"] / report["matmul_tflops"], 3)
        report["variants"].append(r)
        if d.main:
            print(json.dumps(r), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))  # after each variant: a killed run keeps what it measured
    if d.main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"{'variant':<16}{'fwd+bwd ms':>11}{'step ms':>9}{'TFLOP/s':>9}{'MFU':>7}{'blk-tok/s':>11}{'peak GiB':>10}{'mask ms':>9}")
        for r in report["variants"]:
            if "error" in r:
                print(f"{r['backend']}:{'compile' if r['compile'] else 'eager':<10} ERROR {r['error'][:200]}")
                continue
            print(f"{r['backend'] + (':compile' if r['compile'] else ':eager'):<16}{r['fwd_bwd_ms']:>11}{r['step_ms']:>9}"
                  f"{r['tflops']:>9}{r.get('mfu', float('nan')):>7}{r['block_tokens_per_s']:>11}{str(r['peak_mem_gib']):>10}"
                  f"{r['mask_build_ms']:>9}")
    if d.world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
