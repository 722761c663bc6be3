"""What a join costs: continuous batching's admissions, timed part by part.

A SmolLM2-shaped target with random weights (no testbed needed on the GPU machine) and the
bundled drafter; `--rows` rows, refilled at every round that has a free row (the worst case for
joins), prompts of 100-300 random tokens, token limits drawn between 32 and 128, DFlash. After an
untimed pass (compilation, graph capture), one timed pass reports tokens/s and, summed over its
joins (each part synchronised): the joining prompts' prefill, the drafter's context from their
features, the row copies, and graph captures (each pass first captures every join shape, as
`serve`'s warm-up does). `--cudnn-eager` lets eager passes use cuDNN's
attention (as before it was left to graph captures) and `--compiled-eager` runs joins' short
eager passes on the compiled layer functions: the two A/Bs of docs/benchmarks.md (serving,
"where a join's 125 ms went").

    python benchmarks/profile_joins.py --json out.json                       # GPU
    python benchmarks/profile_joins.py --cudnn-eager --json before.json
    python benchmarks/profile_joins.py --device cpu --rows 3 --prompts 6 --max-new-tokens 4  # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from pathlib import Path

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.decode import cache as cache_mod
from dflashkit.decode import engine as engine_mod
from dflashkit.decode import static
from dflashkit.decode.loop import Request, decode_stream, make_engine
from dflashkit.target import Target

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "dflashkit" / "assets" / "smollm2-drafter"


def smollm2_shaped(device: torch.device, dtype: torch.dtype) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return Target(model, None, name="smollm2-shaped-random")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cudnn-eager", action="store_true", help="eager passes may use cuDNN's attention")
    p.add_argument("--compiled-eager", action="store_true", help="joins' short eager passes on the compiled functions")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    target = smollm2_shaped(device, torch.bfloat16 if cuda else torch.float32)
    drafter = load_drafter(BUNDLED, target, device=device, dtype=target.dtype)

    if args.cudnn_eager:
        engine_mod.attention_backends = lambda graph=False: contextlib.nullcontext()
    if args.compiled_eager:
        run = static.StaticRunner._run
        static.StaticRunner._run = lambda self, step, *a, graph=False: run(self, step, *a, graph=True)

    seconds, counts, joining = collections.defaultdict(float), collections.Counter(), [False]

    def timed(name: str, fn):
        def wrapped(*a, **kw):
            if not joining[0]:
                return fn(*a, **kw)
            sync()
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sync()
                seconds[name] += time.perf_counter() - t
                counts[name] += 1
        return wrapped

    join = engine_mod.Engine.join

    def timed_join(self, *a, **kw):
        joining[0] = True
        try:
            return timed("join", join)(self, *a, **kw)
        finally:
            joining[0] = False

    engine_mod.Engine.join = timed_join
    engine_mod.Engine.prefill = timed("prefill of the joining prompts", engine_mod.Engine.prefill)
    engine_mod.Engine.take_context = timed("drafter context from their features", engine_mod.Engine.take_context)
    cache_mod.KVCache.put_rows = timed("row copies", cache_mod.KVCache.put_rows)
    captures = {"graph captures": 0}
    graph_call = static.Graphs.__call__

    def counted(self, *a):
        key = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in a)
        captures["graph captures"] += self.buffers() != self.where or key not in self.graphs
        return graph_call(self, *a)

    static.Graphs.__call__ = counted
    g = torch.Generator().manual_seed(0)

    def one_pass(n: int) -> tuple[int, float]:
        engine = make_engine(target, drafter, "auto")
        prompts = [torch.randint(3, 49000, (int(k),), generator=g) for k in torch.randint(100, 300, (n,), generator=g)]
        # as `serve` does before it listens: every join shape captured (random lengths vary by pass)
        engine.prefill(prompts[:args.rows], capacity=512)
        engine.warm_joins(args.rows)
        limits = torch.randint(args.max_new_tokens // 4, args.max_new_tokens + 1, (n,), generator=g).tolist()
        queue = iter(range(args.rows, n))

        def admit(running: int) -> list[Request]:
            return [Request(prompts[i], limits[i]) for _, i in zip(range(args.rows - running), queue)]

        sync()
        t, tokens = time.perf_counter(), 0
        for step in decode_stream(engine, prompts[:args.rows], max_new_tokens=limits[:args.rows], method="dflash",
                                  admit=admit):
            tokens += sum(len(new) for _, new, _ in step)
        sync()
        return tokens, time.perf_counter() - t

    one_pass(max(args.rows * 5 // 2, args.rows + 1))  # untimed: compilation, graph capture
    seconds.clear()
    counts.clear()
    captures["graph captures"] = 0
    tokens, wall = one_pass(args.prompts)
    joins = counts["join"]
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": args.rows, "prompts": args.prompts,
           "cudnn_eager": args.cudnn_eager, "compiled_eager": args.compiled_eager, "tokens": tokens, "seconds": wall,
           "tokens_per_s": tokens / wall, "joins": joins, **captures,
           "ms_per_join": {k: 1e3 * v / max(joins, 1) for k, v in seconds.items()}}
    print(f"{tokens} tokens in {wall:.2f} s: {tokens / wall:,.0f} tokens/s; {joins} joins, "
          f"{captures['graph captures']} graph captures")
    print("| part of a join | ms per join |\n| --- | ---: |")
    for k, v in res["ms_per_join"].items():
        print(f"| {k} | {v:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
