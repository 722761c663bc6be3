"""Batched decoding throughput: AR, DFlash and DDTree at several batch sizes on the SmolLM2 testbed
with the bundled drafter, first N HumanEval prompts through the chat template (as `dflashkit eval`).

Each configuration decodes the same N prompts in consecutive groups of `batch` (the last group
may be smaller), or in mode `continuous` (`--modes`) through `batch` rows that take the next
prompt once `--refill` of them are free (a group waits for its slowest row: at τ ≈ 2.7 some rows
need half as many rounds again as the mean), with `decode.loop.generate_batch` on one engine (`--engine`; 'auto' is the static
runner with CUDA graphs on a GPU). Rows stop at the target's stop tokens or `--max-new-tokens`, so
batches shrink as rows finish. tokens/s = generated tokens / wall time including prefill;
"vs AR" is against AR at the same batch size and mode, "speed-up" against AR at the smallest batch
size measured (1 by default); "tail" (groups
only): the row-rounds the groups ran (each row as many as its group's slowest) over those its
rows needed, what waiting for the slowest row costs. "rounds": the batch's verification passes in the
timed pass, "ms/round" the wall time per pass, "occupancy" the rows that decoded in a pass over the
rows a pass runs (`batch` on a CUDA-graph engine; elsewhere finished rows leave the batch and cost
nothing) (a finished row that waits for its group, or an idle row of a CUDA-graph batch
waiting for enough free rows to admit, costs as much as a decoding one), "joins" the admissions
(continuous; the JSON also counts the join groups prefilled eagerly, `eager_joins`: a prompt too long
for a staging pass), "captures" the CUDA graphs captured in the timed pass (0 unless it met a shape the
untimed passes did not). At each
batch size every method first runs its work untimed (CUDA-graph capture and compilation happen once
per shape; a shorter warm-up left them in whichever method ran first), again while a pass still
captured graphs (a cache that grew drops the graphs over its old buffers); then the methods take
turns for `--trials` timed passes each, and a row is its method's median trial (the JSON keeps
every trial's seconds). CUDA is synchronised before each clock read. "identical" counts rows
whose tokens equal AR's at the same batch size and mode (greedy; bf16 near-ties may part).

'+cost' and '+conf' decode cost-aware (`decode/cost.py`), and differ in what scores the draft,
the chance that the target accepts a path: '+cost' the drafter's probabilities (today's rule),
'+conf' its confidence head (a DSpark drafter's; refused for a drafter without one). Each runs on
its own engine (`Engine`'s confidence), so both rules decode the same drafter in one process; plain
dflash and ddtree-N decode on the default engine, which scores by the head where there is one.

    python benchmarks/bench_batch.py --prompts 8 --max-new-tokens 64 --json runs/bench-batch-cpu.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts 32 --json out.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts 128 \
        --max-new-tokens 64 --methods ar,dflash --modes groups,continuous --json out.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 32 --prompts 164 --repeat 4 \
        --max-new-tokens 256 --methods ar,dflash --modes continuous --draft-tokens 7 --trials 5 --json out.json
    python benchmarks/bench_batch.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --prompts 32 \
        --drafter runs/dspark/best --methods ar,dflash+cost,dflash+conf,ddtree-16+cost,ddtree-16+conf --json out.json
"""

from __future__ import annotations

import argparse

import torch

from bench_decode import add_baseline_options, apply_baseline_options
from dflashkit.bench.batch import check_confidence, drafter_engines, measure, parse_method, save, table
from dflashkit.checkpoint import load_drafter
from dflashkit.commands import DRAFT_TOKENS_HELP, positive_int
from dflashkit.decode.engine import round_block
from dflashkit.decode.loop import make_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.target import load_target


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="first N HumanEval prompts (default 8)")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--methods", default="ar,dflash,ddtree-16", help="comma list of ar, dflash, ddtree-N; "
                   "'+cost' after dflash or ddtree-N decodes cost-aware (`decode/cost.py`: verify only the draft "
                   "prefix that pays at this batch size, skip drafts that do not) on the drafter's probabilities, "
                   "'+conf' cost-aware on its confidence head (DSpark), e.g. dflash+cost,dflash+conf")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "static"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default="groups",
                   help="comma list: groups (consecutive groups of `batch` prompts, each run to its longest row), "
                   "continuous (continuous batching, as `serve`: every prompt through `batch` rows, a finished "
                   "row's place going to the next prompt); both side by side in one process")
    p.add_argument("--continuous", action="store_true", help="the same as --modes continuous")
    p.add_argument("--refill", type=float, default=0.25,
                   help="with --continuous: prompts join once this share of the rows is free (default 0.25)")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="K",
                   help="queue the prompts K times (default 1). A continuous run ends by draining its rows, and there "
                   "the rows slowest to decode run nearly alone (for DFlash, those of the lowest τ); K > 1 comes "
                   "closer to a server under steady load")
    p.add_argument("--trials", type=positive_int, default=1, metavar="N",
                   help="time each configuration N times, the methods taking turns, and report each method's median "
                   "trial (default 1). Trials in one process agreed to a few percent; processes differed more "
                   "(AR at batch 32: 1.42-1.83 ms a round over four on one H100), so run it more than once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--target", default=None, help="target path (default: the SmolLM2 testbed)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N", help=DRAFT_TOKENS_HELP)
    p.add_argument("--json", help="write settings and rows here")
    add_baseline_options(p)
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    baselines = apply_baseline_options(args)
    from dflashkit.data.prompts import load_prompts
    from dflashkit.evaluate import eval_prompts
    from dflashkit.vocab import stop_token_ids

    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    methods = args.methods.split(",")
    modes = ["continuous"] if args.continuous else args.modes.split(",")
    if not set(modes) <= {"groups", "continuous"}:
        raise SystemExit(f"--modes: expected a comma list of groups and continuous, got {args.modes!r}")
    for label in methods:
        parse_method(label)
    if methods[0] != "ar":
        raise SystemExit(f"--methods must start with ar (the baselines are AR's), got {args.methods!r}")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    drafter_name = str(args.drafter or "bundled smollm2-drafter")
    check_confidence(methods, drafter, drafter_name)
    prompts = [pr.ids for pr in eval_prompts(load_prompts("humaneval", limit=args.prompts), target.tokenizer)] * args.repeat
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))

    ar = make_engine(target, None, args.engine)
    spec = drafter_engines(target, drafter, methods, args.engine, args.draft_tokens)
    rows = measure(ar, spec, prompts, methods, sizes, modes, args.max_new_tokens, stops, args.refill, args.trials, args.json)
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    settings = {"prompts": len(prompts), "repeat": args.repeat, "trials": args.trials, "max_new_tokens": args.max_new_tokens, "modes": modes,
                "refill": args.refill if "continuous" in modes else None,
                "speedup_against_batch": sizes[0], "device": device, "dtype": args.dtype,
                "engine": args.engine, "runner": type(ar.run).__name__, **baselines,
                "threads": torch.get_num_threads(), "target": args.target or "SmolLM2-135M-Instruct (testbed)",
                "drafter": drafter_name, "draft_tokens": round_block(drafter, args.draft_tokens) - 1}
    print(f"\n{settings}\n\n{table(rows)}")
    save(args.json, {"settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
