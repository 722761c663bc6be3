"""The GEMMs of a verification pass: which way of multiplying reads the weights fastest.

At batch 1 a DFlash round on a Qwen3-8B-shaped target is mostly GEMMs over 16 rows (the block):
memory-bound, so their time is the weight bytes over the bandwidth the kernel reaches. This script
times, side by side in one process, the GEMM sequence of one verification pass (per layer: the
fused q/k/v, the output projection, the fused gate/up, the down projection; then the LM head),
each variant replayed from a CUDA graph over distinct weights per layer (nothing served from L2):

- `cublas`: `F.linear(x, W)` with W [out, in], as the engine multiplies today;
- `cublas-kn`: `x @ Wt` with the weight stored transposed, [in, out];
- `cublaslt` / `cublaslt-kn`: the same with `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `triton` / `triton-kn`: `torch.compile(mode="max-autotune-no-cudagraphs")` of the product,
  Inductor's autotuned Triton templates beside cuBLAS (slow to compile: `--triton-rows` limits it).

It prints per row count the pass's GEMM time, the bandwidth reached (weight bytes / time) and its
share of the device-to-device copy bandwidth, then per shape the same; `--json` writes them.

    python3 benchmarks/bench_gemm.py --rows 1,16,256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from bench_decode import QWEN3_8B, copy_bandwidth


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each GEMM of one layer, and of the LM head."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, cfg["num_attention_heads"] * d), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (cfg["vocab_size"], h)}


def variants(names: list[str]) -> dict[str, tuple[Callable, bool, str]]:
    """name -> (product fn(x, w), weight stored [in, out], preferred BLAS library)."""
    def nk(x, w):
        return F.linear(x, w)

    def kn(x, w):
        return x @ w
    table = {"cublas": (nk, False, "cublas"), "cublas-kn": (kn, True, "cublas"),
             "cublaslt": (nk, False, "cublaslt"), "cublaslt-kn": (kn, True, "cublaslt")}
    if any(n.startswith("triton") for n in names):
        torch._dynamo.config.cache_size_limit = 256
        auto = dict(mode="max-autotune-no-cudagraphs", dynamic=False)
        table["triton"] = (torch.compile(nk, **auto), False, "cublas")
        table["triton-kn"] = (torch.compile(kn, **auto), True, "cublas")
    return {n: table[n] for n in names}


def time_graph(calls: list[Callable[[], object]], reps: int) -> float:
    """Milliseconds per replay of a CUDA graph that runs `calls` in order (median of `reps`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    out.sort()
    return out[len(out) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,256", help="rows per GEMM (16 = one DFlash block at batch 1), comma list")
    ap.add_argument("--variants", default="cublas,cublas-kn,cublaslt,cublaslt-kn,triton,triton-kn")
    ap.add_argument("--triton-rows", default="16,256", help="row counts the triton variants are timed at")
    ap.add_argument("--layers", type=int, default=QWEN3_8B["num_hidden_layers"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm: needs a CUDA device (it times CUDA graph replays)")
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    names = args.variants.split(",")
    fns = variants(names)
    sh = shapes(QWEN3_8B)
    layer_shapes = [k for k in sh if k != "lm_head"]
    # One weight per layer and shape (the LM head once), in both layouts.
    w_nk = {k: [torch.randn(*sh[k], device=dev, dtype=dt) * 0.02 for _ in range(1 if k == "lm_head" else args.layers)]
            for k in sh}
    w_kn = {k: [w.t().contiguous() for w in ws] for k, ws in w_nk.items()}
    bw = copy_bandwidth(dev)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_tb_s": bw / 1e12, "layers": args.layers, "shapes": sh, "pass": [], "per_shape": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.layers} layers + LM head")
    triton_rows = set(map(int, args.triton_rows.split(",")))
    header = f"{'rows':>5} {'variant':>12} {'pass ms':>8} {'TB/s':>6} {'% copy':>6}  " + "  ".join(f"{k:>14}" for k in sh)
    print(header)
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, sh[k][1], device=dev, dtype=dt) for k in sh}
        for name, (fn, transposed, lib) in fns.items():
            if name.startswith("triton") and m not in triton_rows:
                continue
            ws = w_kn if transposed else w_nk
            torch.backends.cuda.preferred_blas_library(lib)
            try:
                per = {}
                for k in sh:
                    x = xs[k]
                    for w in ws[k][:2]:  # compile / autotune outside the graph
                        fn(x, w)
                    calls = [lambda x=x, w=w: fn(x, w) for w in ws[k]]
                    ms = time_graph(calls, args.reps)
                    nbytes = sum(w.numel() * w.element_size() for w in ws[k])
                    per[k] = dict(ms=ms, tb_s=nbytes / ms / 1e9)
                calls = [lambda x=xs[k], w=ws[k][i]: fn(x, w) for i in range(args.layers) for k in layer_shapes]
                calls.append(lambda: fn(xs["lm_head"], ws["lm_head"][0]))
                ms = time_graph(calls, args.reps)
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            nbytes = sum(w.numel() * w.element_size() for k in sh for w in ws[k])
            row = dict(rows=m, variant=name, pass_ms=ms, tb_s=nbytes / ms / 1e9, copy_share=nbytes / ms / 1e-3 / bw)
            res["pass"].append(row)
            res["per_shape"] += [dict(rows=m, variant=name, shape=k, **v) for k, v in per.items()]
            cells = "  ".join(f"{per[k]['ms']:7.3f}/{per[k]['tb_s']:5.2f}" for k in sh)
            print(f"{m:>5} {name:>12} {ms:8.3f} {row['tb_s']:6.2f} {100 * row['copy_share']:5.1f}%  {cells}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
    print("(per shape: ms over all layers / TB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
