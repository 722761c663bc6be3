"""Speculative decoding speed per round at real shapes, random weights.

Target: Qwen3-8B-shaped (36 layers, hidden 4096, intermediate 12288, 32/8 heads, head dim 128,
vocab 151936, bf16); drafter: 5 layers, taps [1, 9, 17, 25, 33], block 16. With random weights
nothing is accepted (τ = 1), so every round does the full work of its shape: this measures
milliseconds per round and per stage (draft, tree build, verify, commit), for plain
autoregressive steps, DFlash (one chain of 15) and DDTree at several node budgets.

The floor is reading target + drafter weights once over the measured copy bandwidth. Engines
(one `Engine`, different runners of the target's layers): `hf` (the target's own Transformers
forward, eager launches), `static` (own layers, eager), `graphs` (static + CUDA graphs),
`compiled` (graphs + torch.compile of the per-layer functions), `fused` (compiled, with q/k/v and
gate/up weights concatenated), `fused-cd` (fused, and the drafter's whole step compiled too:
what `make_engine`'s 'auto' gives on CUDA). Stage times
synchronise the GPU at each stage boundary; "round" is the same loop without those extra
synchronisations.

`--target qwen3.6-27b`: a Qwen3.6-27B-shaped hybrid instead (64 layers: 48 Gated DeltaNet, 16
gated full attention; hidden 5120; vocab 248320), drafted by the published drafter's shape (5
layers, taps [1, 16, 31, 46, 61], four sliding-window layers of 2048 and one full); the commit
stage is then the state rollback. `--check-features` compares, per tapped layer, the decoding
runner's PyTorch path with Transformers' forward (its GPU kernels where installed, e.g. fla)
on the same prompt, in bf16 and in fp32 (cosine, max error).

`--temperature 0.7`: the rounds sample, each speculative method under both acceptance rules
(`match`, `rejection`) side by side: what the rejection rule's draws and checks cost a round.

`--kinds dflash,dflash2`: each speculative method with a DFlash 2 drafter too (its rows labelled
`[dflash2]`): the same backbone with the reference DFlash 2 modules (block convolutions of 2 taps,
groups of 16 channels; a candidate selector of rank 256 over the top 16), fresh; its rounds
draft over the selector's lattice (the walk, the lattice's trees). What DFlash 2 costs a round
beside DFlash's. `dspark`: a DSpark drafter alike (a vanilla Markov head of rank 256 and a
confidence head, bonus-first as the backbone; its chain the sequential argmax of the biased
logits, its trees the beam over the biased conditionals, `decode/markov.py`).

Besides batch 1 per engine: `--batches 1,4,16,64` times DFlash rounds of the `fused-cd` engine at
each batch size, at τ = 1 (random drafts) and with every draft accepted (τ = B: the acceptance
walk replaced, timing only); `--long 16384` times a round after a prompt of that
many tokens against the `--prompt-len` one, with the peak memory of each prefill.

    python benchmarks/bench_decode.py --json out.json        # GPU
    python benchmarks/bench_decode.py --tiny                 # CPU smoke test of the same code
    python benchmarks/bench_decode.py --target qwen3.6-27b --budgets 16,64 --check-features --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from dflashkit import few_attention
from dflashkit.commands import positive_int
from dflashkit.decode.engine import Engine
from dflashkit.decode.generation import Sampling
from dflashkit.decode.loop import generate, generate_batch
from dflashkit.decode import static as static_mod
from dflashkit.decode.static import runner_features, static_engine
from dflashkit.decode.tree import Walk, walk
from dflashkit.config import DrafterSettings
from dflashkit.drafter import DFlashDrafter, drafter_config_for_target, upgraded
from dflashkit.kernels import heads as heads_mod
from dflashkit.method import TOP_K
from dflashkit.target import Target

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
TINY_HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64)  # a Llama: the real testbed's shapes, random weights
SHAPES = {"qwen3-8b": (QWEN3_8B, TINY), "qwen3.6-27b": (QWEN36_27B, TINY_HYBRID), "smollm2": (SMOLLM2, TINY)}  # (real, --tiny)
DRAFTER_LAYERS = {"smollm2": 4}  # the bundled drafter's; else 5, as the published Qwen3 drafters


def make_models(shape: dict, device: torch.device, dtype: torch.dtype, drafter_layers: int,
                llama: bool = False) -> tuple[Target, DFlashDrafter]:
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    hybrid = "linear_num_key_heads" in shape
    if hybrid:  # three Gated DeltaNet layers, then one full attention, as in Qwen3.5 / 3.6
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(shape["num_hidden_layers"])]
        cfg = Qwen3_5TextConfig(**shape, layer_types=types, max_position_embeddings=262144, tie_word_embeddings=False)
    elif llama:  # SmolLM2: tied embeddings
        cfg = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=100_000.0, tie_word_embeddings=True)
    else:
        cfg = Qwen3Config(**shape, max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=False)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Qwen3_5ForCausalLM if hybrid else LlamaForCausalLM if llama else Qwen3ForCausalLM)(cfg)
    finally:
        torch.set_default_dtype(prev)
    target = Target(model.to(device=device, dtype=dtype), None, name=f"{cfg.model_type}-random")
    dcfg = drafter_config_for_target(cfg, mask_token_id=cfg.vocab_size - 1, num_layers=drafter_layers, num_taps=5)
    return target, DFlashDrafter(dcfg).to(device=device, dtype=dtype)


def kind_drafters(drafter: DFlashDrafter, kinds: str) -> dict[str, DFlashDrafter]:
    """The drafters timed side by side (`--kinds`): the DFlash one, and DFlash 2 / DSpark ones upgraded
    from it with the reference modules (`DrafterSettings`' defaults: convolutions 2/16, selector 256/16;
    a vanilla Markov head of rank 256 and a confidence head)."""
    out = {}
    for kind in kinds.split(","):
        if kind not in ("dflash", "dflash2", "dspark"):
            raise SystemExit(f"--kinds: expected a comma list of dflash, dflash2, dspark, got {kind!r}")
        out[kind] = drafter if kind == "dflash" else upgraded(drafter, DrafterSettings(kind=kind))
    return out


def check_features(target: Target, ids: torch.Tensor, layer_ids: list[int]) -> list[dict]:
    """Per tapped layer: the decoding runner's features (PyTorch path) against Transformers'
    forward (its kernels as installed) on the same prompt, in the target's dtype."""
    from dflashkit.data.check import Comparison
    from dflashkit.data.features import online_features

    cmp = Comparison(layer_ids)
    cmp.add(online_features(target, ids, layer_ids)[0].float().cpu(), runner_features(target, ids[0], layer_ids).float().cpu())
    rows = cmp.report()
    print(f"features {target.dtype}: runner (PyTorch) vs Transformers' forward, per tapped layer: "
          + ", ".join(f"L{r.layer} cos {r.cosine_mean:.6f} (min {r.cosine_min:.6f}) err {r.max_abs_err:.3g}"
                      for r in rows), flush=True)
    return [r.__dict__ for r in rows]


def rollback_designs(shape: dict, device: torch.device, reps: int = 10) -> dict:
    """The three ways to give each linear layer its state after the accepted prefix of a block of
    q verified tokens, timed on the shape's state alone (batch 1, fp32 state, all linear layers):
    fold (dflashkit: the state of the accepted leaf from the block's keys, updates and decays),
    replay (re-run the recurrence over the accepted tokens from the pre-round state) and
    snapshots (keep every token's state during verification, copy the accepted one back)."""
    from dflashkit.decode import delta

    L = sum(1 for i in range(shape["num_hidden_layers"]) if i % 4 != 3)
    h, dk, dv = shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    state = torch.randn(L, 1, h, dk, dv, device=device)
    out: dict = {"layers": L, "state_mib": state.nbytes / 2**20}

    def timed(fn) -> float:
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return 1e3 * (time.perf_counter() - t) / reps

    for q in (16, 65):
        a = q // 2  # accepted tokens
        k = torch.nn.functional.normalize(torch.randn(L, 1, h, q, dk, device=device), dim=-1)
        d, G = torch.randn(L, 1, h, q, dv, device=device), -torch.rand(L, 1, h, q, device=device).cumsum(-1)
        incl = torch.ones(q, q, dtype=torch.bool, device=device).tril()[a - 1][None, None, None]
        leaf = torch.full((L, 1, 1, 1), a - 1, device=device)
        v, g, beta = torch.randn(L, 1, h, a, dv, device=device), -torch.rand(L, 1, h, a, device=device), torch.rand(L, 1, h, a, device=device)

        def replay() -> None:
            S = state.clone()
            for t in range(a):
                S = S * g[..., t, None, None].exp()
                delta_t = (v[..., t, :] - (S * k[..., t, :, None]).sum(-2)) * beta[..., t, None]
                S = S + k[..., t, :, None] * delta_t[..., None, :]
            state.copy_(S)

        def snapshot_copy() -> float | None:
            """The accepted token's state copied back from q kept ones (None: they do not fit)."""
            try:
                snaps = torch.empty(L, q, h, dk, dv, device=device)
            except torch.OutOfMemoryError:
                return None
            return timed(lambda: state[:, 0].copy_(snaps[:, a - 1]))

        r = {"fold_ms": timed(lambda: state.copy_(delta.fold(state, k, d, G, incl, leaf))),
             "replay_ms": timed(replay), "accepted": a, "snapshot_mib": q * state.nbytes / 2**20,
             "snapshot_copy_ms": snapshot_copy()}
        out[f"q{q}"] = r
        print(f"rollback, {L} layers, block of {q}, {a} accepted: fold {r['fold_ms']:.3f} ms | replay "
              f"{r['replay_ms']:.3f} ms | snapshots {r['snapshot_mib']:.0f} MiB per sequence, copy back "
              + (f"{r['snapshot_copy_ms']:.3f} ms" if r["snapshot_copy_ms"] is not None else "n/a"), flush=True)
    return out


def state_memory(engine: Engine) -> dict:
    """MiB per sequence of a hybrid's linear-layer state (conv windows + recurrent state)."""
    lin = engine.cache.linear
    per_row = (lin.conv[:, :1].nbytes + lin.rec[:, :1].nbytes) if lin is not None and lin.conv is not None else 0
    return {"state_mib_per_seq": per_row / 2**20}


def copy_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    x = torch.randn(int(gib * 2**30) // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * x.numel() * 4 / times[len(times) // 2]


def weight_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def self_check(device: torch.device, hybrid: bool = False) -> str:
    """Greedy outputs of every engine on this device equal the target's own `generate` (tiny fp32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_tiny_drafter, make_tiny_hybrid, make_tiny_target

    target = make_tiny_hybrid() if hybrid else make_tiny_target()
    target.model.to(device)
    target = Target(target.model, None)
    drafter = make_tiny_drafter(target).to(device)
    ids = torch.randint(3, 120, (1, 20), device=device)
    ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    bad = []
    for name, make in engines(device, compile_ok=False, hybrid=hybrid).items():
        for method, budget in [("ar", None), ("dflash", None), ("ddtree", 12)]:
            try:
                eng = make(target, drafter if method != "ar" else None)
                if generate(eng, ids, max_new_tokens=24, method=method, budget=budget).tokens != ref:
                    bad.append(f"{name}/{method}")
            except Exception as e:  # report it with the others: one engine failing must not hide the rest
                bad.append(f"{name}/{method} ({type(e).__name__}: {e})"[:300])
    return "ok" if not bad else "MISMATCH " + ", ".join(bad)


def engines(device: torch.device, compile_ok: bool, hybrid: bool = False) -> dict:
    """The fast engines first, so that a time limit only cuts the baselines (a hybrid has no
    Transformers engine: its layers cannot roll their state back)."""
    out = {}
    if device.type == "cuda":
        out["graphs"] = lambda t, d, **kw: static_engine(t, d, cuda_graphs=True, fuse=False, **kw)
        if compile_ok:
            out["compiled"] = lambda t, d, **kw: static_engine(t, d, cuda_graphs=True, compile=True, fuse=False, **kw)
            out["fused"] = lambda t, d, **kw: static_engine(t, d, cuda_graphs=True, compile=True, fuse=True, **kw)
            out["fused-cd"] = lambda t, d, **kw: static_engine(t, d, cuda_graphs=True, compile=True, fuse=True,
                                                               compile_drafter=True, **kw)
    if not hybrid:
        out["hf"] = Engine
    out["static"] = lambda t, d, **kw: static_engine(t, d, cuda_graphs=False, fuse=False, **kw)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compaction_ms(engine: Engine, nodes: int = 8, reps: int = 20) -> float:
    """One tree commit that moves `nodes` non-contiguous accepted nodes together (random weights
    accept nothing, so the measured rounds never pay it)."""
    cache = engine.cache
    path = [[0] + [2 * i + 1 for i in range(1, nodes)]]
    lengths, lengths_t = cache.lengths, cache.lengths_t
    sync(lengths_t.device)
    t = time.perf_counter()
    for _ in range(reps):
        cache.lengths, cache.lengths_t = [lengths[0] - 2 * nodes - 2], lengths_t - 2 * nodes - 2  # inside the written region
        cache.commit(path)
    sync(lengths_t.device)
    cache.lengths, cache.lengths_t = lengths, lengths_t
    return 1e3 * (time.perf_counter() - t) / reps


def accept_everything(trees, anc, picked, chain=False):
    """A stand-in for the acceptance walk (`tree.walk`) of chains that accepts every draft: rounds
    do the work of τ = B (timing only: random weights never agree with random drafts)."""
    b, m = trees.tokens.shape
    return Walk(torch.full_like(picked[:, 0], m), torch.arange(m + 1, device=picked.device).expand(b, -1), picked)


def batch_rows(target: Target, drafter: DFlashDrafter, ids: torch.Tensor, batches: list[int], new_tokens: int,
               device: torch.device, kernels: int = 0, draft_tokens: int | None = None) -> dict:
    """DFlash rounds of the `fused-cd` engine (what `make_engine` gives on CUDA; the static engine
    elsewhere) at each batch size: τ = 1 (random drafts) and every draft accepted (`accept_everything`),
    beside an AR step at the same batch size (what a round must beat). Accepting everything, a generation
    runs B times the tokens, so that both kinds time as many rounds (three rounds of 16 tokens
    were noise: their draft stage varied by 3 ms from one batch size to the next). draft_tokens:
    the engine's (`Engine`; default the drafter's whole block)."""
    from dflashkit.decode import round as round_mod

    make = engines(device, compile_ok=True).get("fused-cd") or engines(device, compile_ok=False)["static"]
    out: dict = {}
    for b in batches:
        for kind in ("ar", "tau1", "accept-all"):
            method = "ar" if kind == "ar" else "dflash"
            eng = make(target, drafter, draft_tokens=draft_tokens)
            round_mod.walk = accept_everything if kind == "accept-all" else walk
            prompts = [ids[0]] * b
            n = new_tokens * (eng.block if kind == "accept-all" else 1)
            generate_batch(eng, prompts, max_new_tokens=n, method=method)  # capture graphs / compile
            sync(device)
            gens = generate_batch(eng, prompts, max_new_tokens=n, method=method)
            prof = generate_batch(eng, prompts, max_new_tokens=n, method=method, profile=True)[0]
            if kernels and kind != "accept-all":
                key = f"b{b}-{kind}-kernels" if kind == "ar" else f"b{b}-kernels"
                run = partial(generate_batch, eng, prompts, max_new_tokens=n, method=method)
                out[key] = kernel_table(lambda: run()[0], device, kernels)
                if device.type == "cuda":
                    out[key]["stages"] = stage_kernels(lambda: run(profile=True)[0], kernels)
            round_mod.walk = walk
            g = gens[0]
            r = {"round_ms": 1e3 * g.decode_seconds / g.rounds, "tau": g.tau,
                 "tokens_per_s": sum(len(x.tokens) - 1 for x in gens) / g.decode_seconds,
                 "stages_ms": {k: 1e3 * v / prof.rounds for k, v in prof.stage_seconds.items()}}
            out[f"b{b}-{kind}"] = r
            print(f"batch {b:3d} {kind:10s} round {r['round_ms']:7.2f} ms  tau {r['tau']:5.2f}  "
                  f"{r['tokens_per_s']:9.1f} tokens/s  | " + " ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items()),
                  flush=True)
            del eng
    return out


def long_context(target: Target, drafter: DFlashDrafter, lengths: list[int], new_tokens: int, device: torch.device) -> dict:
    """A DFlash round and the prefill's peak memory after prompts of each length (fused engine)."""
    make = engines(device, compile_ok=True).get("fused") or engines(device, compile_ok=False)["static"]
    out: dict = {}
    for T in lengths:
        ids = torch.randint(0, target.vocab_size - 2, (1, T), device=device)
        eng = make(target, drafter)
        generate(eng, ids, max_new_tokens=new_tokens, method="dflash")  # warm-up: graphs for these spans, compilation
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        g = generate(eng, ids, max_new_tokens=new_tokens, method="dflash")
        r = {"round_ms": 1e3 * g.decode_seconds / g.rounds, "prefill_s": g.prefill_seconds}
        if device.type == "cuda":
            r["prefill_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        out[f"prompt{T}"] = r
        print(f"prompt {T:6d}: round {r['round_ms']:.2f} ms, prefill {r['prefill_s']:.2f} s"
              + (f", peak extra {r['prefill_peak_extra_gib']:.2f} GiB" if "prefill_peak_extra_gib" in r else ""), flush=True)
        del eng
    return out


# First match wins: Triton's kernels are named after the ops they fuse ("triton_..._to_copy_cat_..."),
# so they are told apart before the copy kernels.
KERNEL_KINDS = (("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk")),
                ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
                ("fused elementwise / reduction (triton)", ("triton",)),
                ("copy", ("memcpy", "memset", "copy", "cat", "index", "scatter")))


def kernel_table(run, device: torch.device, top: int) -> dict:
    """Where a round's GPU time goes: `run()` (a generation, already warmed up) profiled, its
    kernels grouped by kind and the `top` largest, in microseconds per round."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        g = run()
        sync(device)
    rows = [(e.key, e.self_device_time_total if cuda else e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    rows = sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])
    per_round = {"rounds": g.rounds, "total_us": sum(r[1] for r in rows) / g.rounds, "kinds": {},
                 "top": [{"kernel": k[:120], "us": t / g.rounds, "launches": c / g.rounds} for k, t, c in rows[:top]]}
    for k, t, c in rows:
        kind = next((name for name, keys in KERNEL_KINDS if any(x in k.lower() for x in keys)), "other")
        d = per_round["kinds"].setdefault(kind, {"us": 0.0, "launches": 0.0})
        d["us"] += t / g.rounds
        d["launches"] += c / g.rounds
    print(f"  kernels per round: {per_round['total_us']:.0f} us in all; "
          + ", ".join(f"{k} {v['us']:.0f} us ({v['launches']:.0f} launches)" for k, v in per_round["kinds"].items()))
    for r in per_round["top"]:
        print(f"    {r['us']:8.1f} us {r['launches']:6.1f}x  {r['kernel']}")
    if cuda:
        per_round["gaps"] = device_gaps(prof, g.rounds, top)
    return per_round


def stage_kernels(run, top: int) -> dict:
    """The kernels of each stage of a round (draft, tree, verify, commit), per round: `run()` is a
    generation with `profile=True`, whose loop synchronises CUDA at every stage boundary and marks
    it in the trace (`round.STAGE_END`), so a kernel belongs to the stage of the first mark after it
    starts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from dflashkit.decode.round import STAGE_END

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        g = run()
    events = prof.events()
    marks = sorted((e.time_range.start, e.name[len(STAGE_END):]) for e in events if e.name.startswith(STAGE_END))
    times = [t for t, _ in marks]
    out: dict[str, dict] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.name.startswith(STAGE_END):
            continue
        i = bisect.bisect_left(times, e.time_range.start)
        d = out.setdefault(marks[i][1] if i < len(marks) else "outside", {"us": 0.0, "launches": 0.0, "kernels": {}})
        d["us"] += e.time_range.elapsed_us() / g.rounds
        d["launches"] += 1 / g.rounds
        d["kernels"][e.name[:90]] = d["kernels"].get(e.name[:90], 0.0) + e.time_range.elapsed_us() / g.rounds
    for stage, d in out.items():
        d["kernels"] = dict(sorted(d["kernels"].items(), key=lambda kv: -kv[1])[:top])
        print(f"  stage {stage}: {d['us']:.0f} us, {d['launches']:.0f} kernels per round; largest:")
        for k, us in d["kernels"].items():
            print(f"    {us:8.1f} us  {k}")
    return out


def device_gaps(prof, rounds: int, top: int) -> dict:
    """Where the device waits: the idle time between kernels (and copies), per round, in all and
    by the pair of kernels around each gap (a gap after the read of a round's tokens is host work
    before the next round's first launch; gaps between two kernels of one graph are launch latency)."""
    from torch.autograd import DeviceType

    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    pairs: dict[tuple[str, str], list[float]] = {}
    end, last, idle = None, "", 0.0
    for e in events:
        if end is not None and e.time_range.start > end:
            gap = e.time_range.start - end
            idle += gap
            pairs.setdefault((last[:60], e.name[:60]), []).append(gap)
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e.name
    busy_span = (end - events[0].time_range.start) if events else 0.0
    rows = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {"span_us": busy_span / rounds, "idle_us": idle / rounds,
           "top": [{"after": a, "before": b, "us": sum(v) / rounds, "count": len(v) / rounds} for (a, b), v in rows]}
    print(f"  device idle per round: {out['idle_us']:.0f} us of {out['span_us']:.0f} us; largest by neighbours:")
    for r in out["top"]:
        print(f"    {r['us']:8.1f} us {r['count']:6.1f}x  after {r['after']}  |  before {r['before']}")
    return out


def measure(engine, ids: torch.Tensor, method: str, budget: int | None, new_tokens: int, top_k: int | None,
            temperature: float = 0.0, acceptance: str = "match") -> dict:
    kw = dict(max_new_tokens=new_tokens, method=method, budget=budget, top_k=top_k, acceptance=acceptance,
              sampling=Sampling(temperature, 1.0, 0))
    generate(engine, ids, **kw)  # capture graphs / compile
    prof = generate(engine, ids, **kw, profile=True)
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    plain = generate(engine, ids, **kw)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    r = prof.rounds
    stages = {k: 1e3 * v / r for k, v in prof.stage_seconds.items()}
    return {"round_ms": 1e3 * plain.decode_seconds / plain.rounds, "stages_ms": stages,
            "staged_round_ms": sum(stages.values()), "rounds": r, "tau": plain.tau,
            "peak_extra_mib": peak}


SWITCHES = {  # flag -> the alternative code path it selects
    "--all-dynamic": "compile the target's layer functions with every size symbolic (torch.compile(dynamic=True)) "
                     "instead of automatic dynamic shapes (`static.compiled`)",
    "--row-major": "keep every weight [out, in] as loaded instead of storing the output, MLP and LM-head weights "
                   "[in, out] on CUDA (`static.COLUMN_WEIGHTS`)",
    "--combo-kernels": "compile with Inductor's combo kernels (independent kernels of a compiled function launched as "
                       "one; `static.COMBO_KERNELS`)",
    "--unfused-heads": "make the q/k/v heads (norms, RoPE, cache stores) with the compiled PyTorch code, several "
                       "kernels a layer, instead of `kernels/heads.py`'s one kernel (`heads.ENABLED`)",
    "--sdpa-rows": "passes of several rows attend through SDPA (cuDNN inside CUDA graphs, the output permuted "
                   "after it) instead of the fused few-query kernel (`few_attention.ROWS`)",
    "--token-heads": "one program per (token, head) in the heads kernel instead of `heads.BLOCK_T` tokens "
                     "per program",
    "--short-spans": "split short caches into spans of keys and combine them instead of writing one span "
                     "directly up to `few_attention.DIRECT_KEYS` slots",
}


def add_baseline_options(ap: argparse.ArgumentParser) -> None:
    """Other code paths of the static engine than its defaults, for side-by-side comparisons."""
    for flag, text in SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument("--few-attention", choices=("auto", "fused", "written"), default="auto",
                    help="one-row passes of few queries: 'auto' attends through the fused Triton kernel over "
                    "caches of `few_attention.FROM_KEYS` slots or more and writes q k^T, softmax and p v out below; "
                    "'fused' / 'written' use one of them at every length ('written': passes of several rows "
                    "through SDPA)")


def apply_baseline_options(args: argparse.Namespace) -> dict:
    static_mod.ALL_DYNAMIC = args.all_dynamic
    static_mod.COLUMN_WEIGHTS = False if args.row_major else None
    static_mod.COMBO_KERNELS = args.combo_kernels
    heads_mod.ENABLED = not args.unfused_heads
    few_attention.FROM_KEYS = {"auto": few_attention.FROM_KEYS, "fused": 0, "written": None}[args.few_attention]
    few_attention.ROWS = not args.sdpa_rows
    heads_mod.BLOCK_T = 1 if args.token_heads else heads_mod.BLOCK_T
    few_attention.DIRECT_KEYS = 0 if args.short_spans else few_attention.DIRECT_KEYS
    switches = {name: getattr(args, name) for name in (flag[2:].replace("-", "_") for flag in SWITCHES)}
    return {**switches, "few_attention": args.few_attention, "few_attention_from_keys": few_attention.FROM_KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(SHAPES), default="qwen3-8b", help="target shape (default qwen3-8b)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same kind (CPU smoke test)")
    ap.add_argument("--check-features", action="store_true",
                    help="compare the runner's features with Transformers' forward per tapped layer (last)")
    ap.add_argument("--rollback", action="store_true",
                    help="hybrids: only time the rollback designs on the state's shapes (no model is built)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many of the target's layers")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on GPU")
    ap.add_argument("--json", metavar="PATH", help="write all numbers here (rewritten after each measurement)")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--top-k", type=int, default=TOP_K, help="DDTree's candidates per slot (default: the budget)")
    ap.add_argument("--engines", default=None, help="comma list among hf,static,graphs,compiled,fused (default: all that apply)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per measured generation (rounds, at τ=1)")
    ap.add_argument("--hf-new-tokens", type=int, default=12, help="fewer for the slow Transformers engine")
    ap.add_argument("--time-limit", type=float, default=480, help="seconds; later engines are skipped past it")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (seed 0): each speculative method under both acceptance rules, "
                    "'match' and 'rejection' (decode/accept.py), side by side")
    ap.add_argument("--kinds", default="dflash", help="comma list of drafter kinds timed side by side: dflash, dflash2, "
                    "dspark (the reference DFlash 2 / DSpark modules on the same backbone)")
    ap.add_argument("--batches", default="", help="comma list of batch sizes for the batched DFlash table (e.g. 1,4,16,64)")
    ap.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N",
                    help="the batched table's tokens drafted a round (default: the drafter's block_size - 1)")
    ap.add_argument("--long", type=int, default=0, help="also time a round after a prompt of this many tokens")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile each measured generation: GPU time per round by kernel kind and the N "
                    "largest kernels")
    add_baseline_options(ap)
    args = ap.parse_args()
    t_start = time.perf_counter()
    baselines = {**apply_baseline_options(args), "top_k": args.top_k}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SHAPES[args.target][1 if args.tiny else 0])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    hybrid = "linear_num_key_heads" in shape
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "shape": shape, "dtype": str(dtype), "batch": 1, "results": {},
                 **baselines}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))

    import transformers
    res["transformers"] = transformers.__version__
    res["self_check"] = self_check(device, hybrid)
    print(f"self-check (tiny, greedy == target.generate for every engine): {res['self_check']}", flush=True)
    if args.rollback:
        if not hybrid:
            ap.error("--rollback needs a hybrid --target (qwen3.6-27b)")
        res["rollback"] = rollback_designs(shape, device)
        save()
        return 0
    t_build = time.perf_counter()
    target, drafter = make_models(shape, device, dtype, drafter_layers=2 if args.tiny else DRAFTER_LAYERS.get(args.target, 5),
                                  llama=args.target == "smollm2")
    res["build_s"] = time.perf_counter() - t_build
    tb, db = weight_bytes(target.model), weight_bytes(drafter)
    res.update(target_gb=tb / 1e9, drafter_gb=db / 1e9)
    if device.type == "cuda":
        bw = copy_bandwidth(device)
        res.update(copy_tb_s=bw / 1e12, floor_ms=1e3 * (tb + db) / bw, ar_floor_ms=1e3 * tb / bw)
        print(f"weights: target {tb / 1e9:.2f} GB + drafter {db / 1e9:.2f} GB; copy bandwidth {bw / 1e12:.2f} TB/s; "
              f"floor {res['floor_ms']:.2f} ms per round ({res['ar_floor_ms']:.2f} ms per AR step)", flush=True)
    save()
    torch.manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"] - 2, (1, args.prompt_len), device=device)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    rules = ["match", "rejection"] if args.temperature > 0 else ["match"]
    methods = [("ar", None, "match")] + [(m, b, rule) for m, b in [("dflash", None)] + [("ddtree", b) for b in budgets]
                                        for rule in rules]
    chosen = engines(device, compile_ok=True, hybrid=hybrid)
    if args.engines:
        chosen = {k: v for k, v in chosen.items() if k in args.engines.split(",")}
    drafters = kind_drafters(drafter, args.kinds)
    runs = [(kind, m) for kind in drafters for m in methods if m[0] != "ar" or kind == next(iter(drafters))]
    for name, make in chosen.items():
        for kind, (method, budget, rule) in runs:
            if time.perf_counter() - t_start > args.time_limit:
                print(f"time limit reached: skipping {name} {method} {budget or ''}", flush=True)
                continue
            label = (method if budget is None else f"{method}-{budget}") + (f"+{rule}" if len(rules) > 1 and method != "ar" else "") \
                + ("" if kind == "dflash" or method == "ar" else f" [{kind}]")
            eng = None
            try:
                eng = make(target, drafters[kind] if method != "ar" else None)
                n = args.hf_new_tokens if name in ("hf", "static") else args.new_tokens
                r = measure(eng, ids, method, budget, n, args.top_k, args.temperature, rule)
                if hybrid:
                    r.update(state_memory(eng))
            except Exception as e:  # report and go on: one engine failing must not lose the others' numbers
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{name:9s} {label:28s} FAILED {r['error']}", flush=True)
            else:
                s = r["stages_ms"]
                floor = res.get("ar_floor_ms" if method == "ar" else "floor_ms")
                r["x_floor"] = r["round_ms"] / floor if floor else None
                r["tree_share"] = s.get("tree", 0.0) / r["staged_round_ms"]
                print(f"{name:9s} {label:28s} round {r['round_ms']:7.2f} ms" + (f" ({r['x_floor']:.2f}x floor)" if floor else "")
                      + "  | " + " ".join(f"{k} {v:.2f}" for k, v in s.items()) + f" | tree {100 * r['tree_share']:.1f}%", flush=True)
            if args.kernels and "error" not in r:
                r["kernels"] = kernel_table(functools.partial(generate, eng, ids, max_new_tokens=n, method=method, budget=budget,
                                                              top_k=args.top_k, acceptance=rule,
                                                              sampling=Sampling(args.temperature, 1.0, 0)),
                                            device, args.kernels)
            if name != "hf" and budget == budgets[-1] and rule == "match" and "error" not in r and not hybrid:
                r["compaction_ms_8_nodes"] = compaction_ms(eng)
                print(f"{name:9s} tree commit moving 8 accepted nodes: {r['compaction_ms_8_nodes']:.3f} ms", flush=True)
            res["results"].setdefault(name, {})[label] = r
            save()
            del eng
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{'engine':9s} {'method':28s} {'round ms':>9s} {'x floor':>8s} {'draft':>7s} {'tree':>7s} {'verify':>7s} {'commit':>7s} {'tree %':>7s}")
    for name, rows in res["results"].items():
        for label, r in rows.items():
            if "error" in r:
                continue
            s = r["stages_ms"]
            xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else "-"
            print(f"{name:9s} {label:28s} {r['round_ms']:9.2f} {xf:>8s} {s.get('draft', 0):7.2f} {s.get('tree', 0):7.2f} "
                  f"{s.get('verify', 0):7.2f} {s.get('commit', 0):7.2f} {100 * r['tree_share']:6.1f}%")
    if args.batches:
        res["batched"] = batch_rows(target, drafter, ids, [int(b) for b in args.batches.split(",")], args.new_tokens, device,
                                    args.kernels, args.draft_tokens)
        res["draft_tokens"] = args.draft_tokens
        save()
    if args.long:
        res["long_context"] = long_context(target, drafter, [args.prompt_len, args.long], args.new_tokens, device)
        save()
    if args.check_features:
        del chosen
        res["features"] = check_features(target, ids, drafter.config.target_layer_ids)
    res["wall_s"] = time.perf_counter() - t_start
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
