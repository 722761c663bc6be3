"""Attention for few queries over a KV cache: which kernel a decoding pass should use.

A verification pass attends 16 (DFlash) or 65 (DDTree-64) queries per row over the cache under an
additive mask (the tree's visibility), one call per layer. At batch 1 that is little work spread
over few thread blocks, and on an H200 cuDNN's flash kernel takes ~18 us a call. This script times the candidates side by side, each replayed
from a CUDA graph as the engine replays its passes, on the shapes of a Qwen3-8B target (32 query
heads, 8 KV heads, head dim 128), and checks each against the math reference:

- `cudnn` / `efficient` / `math`: SDPA's backends over the engine's layout (the query heads of a KV
  group folded into the query axis, mask [b, 1, g*t, n]);
- `gqa-cudnn`: cuDNN over [b, heads, t, d] with `enable_gqa` (the mem-efficient kernel refuses it);
- `compiled`: q k^T, softmax and p v written out and compiled (cuBLAS for the products, one fused
  softmax);
- `flex`: FlexAttention with the mask as a score modification (Triton; short queries take its
  split-KV decoding kernel);
- `fused`: `few_attention.attend`, one Triton pass over spans of keys and a combine (what the
  engine uses on CUDA for passes of several rows, and for one row from `few_attention.FROM_KEYS`
  slots; one row below that, it writes the attention out); `fused-direct`: the same kernel with one
  span per program at every length (what it does up to `few_attention.DIRECT_KEYS` slots).

    python3 benchmarks/bench_attention.py --queries 16,65 --keys 768 --batches 1,16 --json out.json
    python3 benchmarks/bench_attention.py --queries 1,16,65 --keys 4096,16384 --only compiled,fused
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflashkit import few_attention


def folded(q: torch.Tensor, g: int) -> torch.Tensor:
    """[b, heads, t, d] -> [b, kv, g * t, d] (the engine's layout: the g heads of a KV group in a row)."""
    b, h, t, d = q.shape
    return q.reshape(b, h // g, g * t, d)


def candidates(g: int, scale: float) -> dict:
    def sdpa(backend):
        def run(q, k, v, m, m_gqa):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(folded(q, g), k, v, attn_mask=m, scale=scale)
        return run

    def sdpa_gqa(backend):
        def run(q, k, v, m, m_gqa):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m_gqa, scale=scale, enable_gqa=True)
        return run

    def written_out(q, k, v, m, m_gqa):
        s = (folded(q, g) @ k.transpose(-1, -2)).float() * scale + m
        return (s.softmax(-1).to(v.dtype)) @ v

    def fused(q, k, v, m, m_gqa):
        return few_attention.attend(folded(q, g), k, v, m, scale)

    def fused_direct(q, k, v, m, m_gqa):  # one span over every length (`few_attention.DIRECT_KEYS`)
        keep, few_attention.DIRECT_KEYS = few_attention.DIRECT_KEYS, k.shape[2]
        try:
            return few_attention.attend(folded(q, g), k, v, m, scale)
        finally:
            few_attention.DIRECT_KEYS = keep

    out = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
           "math": sdpa(SDPBackend.MATH), "gqa-cudnn": sdpa_gqa(SDPBackend.CUDNN_ATTENTION),
           "compiled": torch.compile(written_out, dynamic=False)}
    if few_attention.triton is not None:
        out["fused"], out["fused-direct"] = fused, fused_direct
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

        def run_flex(q, k, v, m, m_gqa):
            bias = m_gqa[:, 0]  # [b, t, n]

            def add_mask(score, b, h, qi, kv):
                return score + bias[b, qi, kv]
            return flex(q, k, v, score_mod=add_mask, scale=scale, enable_gqa=True)
        out["flex"] = run_flex
    except ImportError:
        pass
    return out


SWEEP_KNOBS = {"w": "NUM_WARPS", "s": "NUM_STAGES", "n": "BLOCK_N", "f": "FILL"}


def sweep_candidates(g: int, scale: float, spec: str) -> dict:
    """`fused` under other launch settings: spec is a comma list of settings such as w8s3n64f512
    (num_warps 8, num_stages 3, BLOCK_N 64, FILL 512; a knob left out keeps the module's value)."""
    import re

    out = {}
    for name in spec.split(","):
        knobs = {SWEEP_KNOBS[k]: int(v) for k, v in re.findall(r"([wsnf])(\d+)", name)}
        if not knobs or "".join(k + str(v) for k, v in re.findall(r"([wsnf])(\d+)", name)) != name:
            raise SystemExit(f"bench_attention: --sweep: cannot read {name!r}; expected e.g. w8s3n64f512")

        def run(q, k, v, m, m_gqa, _knobs=knobs):
            keep = {a: getattr(few_attention, a) for a in _knobs}
            for a, val in _knobs.items():
                setattr(few_attention, a, val)
            try:
                return few_attention.attend(folded(q, g), k, v, m, scale)
            finally:
                for a, val in keep.items():
                    setattr(few_attention, a, val)
        out["fused@" + name] = run
    return out


def time_graph(fn, args, iters: int) -> float:
    """Microseconds per call of fn(*args), replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--queries", default="1,16,65", help="queries per row, comma list")
    ap.add_argument("--keys", default="768", help="slots attended over, comma list")
    ap.add_argument("--batches", default="1,16", help="rows, comma list")
    ap.add_argument("--iters", type=int, default=100, help="calls per timed graph replay")
    ap.add_argument("--only", help="comma list of the candidates to time (default: all; flex takes tens of ms a "
                    "call at 65 queries, math hundreds of us over long caches)")
    ap.add_argument("--sweep", help="also time `fused` under these launch settings, e.g. w4s2,w8s3n32,f512 "
                    "(w num_warps, s num_stages, n BLOCK_N keys per step, f FILL programs wanted)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    g, scale = H // KV, D ** -0.5
    fns = candidates(g, scale)
    if args.sweep:
        fns.update(sweep_candidates(g, scale, args.sweep))
    reference = fns["math"]
    if args.only:
        only = args.only.split(",")
        unknown = sorted(set(only) - set(fns))
        if unknown:
            raise SystemExit(f"bench_attention: --only: unknown candidate(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(fns)}")
        fns = {k: fn for k, fn in fns.items() if k in only or k.startswith("fused@")}
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: needs a CUDA device (it times CUDA graph replays)")
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "heads": H, "kv_heads": KV, "head_dim": D, "results": []}
    print(f"{'batch':>5} {'queries':>7} {'keys':>5}  " + "  ".join(f"{k:>13}" for k in fns))
    for b in map(int, args.batches.split(",")):
        for t in map(int, args.queries.split(",")):
            for n in map(int, args.keys.split(",")):
                q = torch.randn(b, H, t, D, device=dev, dtype=dt)
                k, v = (torch.randn(b, KV, n, D, device=dev, dtype=dt) for _ in range(2))
                # A tree's visibility: the committed prefix (n - t - 64 slots; the rest is garbage
                # beyond the rows' lengths), then a random ancestor pattern with the diagonal.
                vis = torch.zeros(b, t, n, dtype=torch.bool, device=dev)
                pre = n - t - 64
                vis[:, :, :pre] = True
                vis[:, :, pre:pre + t] = torch.rand(b, t, t, device=dev) < 0.3
                vis[:, :, pre:pre + t] |= torch.eye(t, dtype=torch.bool, device=dev)
                m_gqa = torch.zeros(b, 1, t, n, device=dev, dtype=dt).masked_fill(~vis[:, None], float("-inf"))
                m = m_gqa.repeat(1, 1, g, 1)
                ref = reference(q, k, v, m, m_gqa).float()
                cells = {}
                for name, fn in fns.items():
                    try:
                        got = fn(q, k, v, m, m_gqa).float()
                        got = got if got.shape == ref.shape else folded(got, g)
                        err = (got - ref).abs().max().item()
                        us = time_graph(fn, (q, k, v, m, m_gqa), args.iters)
                        cells[name] = {"us": us, "max_abs_err": err}
                    except Exception as e:  # a backend without this shape or feature
                        cells[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
                res["results"].append({"batch": b, "queries": t, "keys": n, "us": cells})
                print(f"{b:5d} {t:7d} {n:5d}  " + "  ".join(
                    f"{c['us']:8.1f} us{'!' if c['max_abs_err'] > 0.05 else ' '} " if "us" in c else f"{'n/a':>13}"
                    for c in cells.values()), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(res, indent=2))
    print("('!': differs from the math reference by more than 0.05; n/a: the backend refused the call)")
    for r in res["results"]:
        for name, c in r["us"].items():
            if "error" in c:
                print(f"  b{r['batch']} t{r['queries']} n{r['keys']} {name}: {c['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
