"""How predictable each evaluation suite's answers are: the target's own confidence along its
greedy answers, beside the DFlash τ the drafter reaches on them.

For each suite (SmolLM2 testbed and the bundled drafter by default), the suite's prompts are
answered greedily with DFlash (`decode.loop.generate_batch`, the static engine, the suite's answer
length, stopping at the target's stop tokens). τ is pooled over rounds, as `dflashkit eval`
reports it. Then one forward pass of the target over each prompt + answer gives, at every answer
position, the probability of the token it chose (its top-1): the lower it is, the flatter the
target's distribution and the harder its argmax is to draft. Reported per suite: the mean top-1
probability and the share of positions where it is below 0.5.

    python benchmarks/suite_confidence.py --json runs/suite-confidence.json                 # fp32 CPU
    python benchmarks/suite_confidence.py --dtype bfloat16 --suites chat --json out.json    # bf16 target + drafter
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.data.prompts import EVAL_SUITES, get_suite, load_prompts
from dflashkit.decode.loop import generate_batch
from dflashkit.decode.static import static_engine
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import eval_prompts, summarize
from dflashkit.target import load_target
from dflashkit.vocab import stop_token_ids


@torch.no_grad()
def top1_probabilities(target, prompt: torch.Tensor, answer: list[int]) -> list[float]:
    """The target's probability of each answer token given everything before it."""
    ids = torch.cat([prompt, torch.tensor(answer, dtype=prompt.dtype)])[None].to(target.device)
    logits = target.model(ids).logits[0, len(prompt) - 1:-1]
    return logits.float().softmax(-1).gather(1, ids[0, len(prompt):, None]).squeeze(1).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suites", default=",".join(s.name for s in EVAL_SUITES), help="comma list (default: every suite)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's and drafter's")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()
    suites = [get_suite(name) for name in args.suites.split(",")]
    target = load_target(None, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    engine = static_engine(target, drafter)
    rows = []
    for suite in suites:
        t0 = time.perf_counter()
        prompts = [pr.ids[0] for pr in eval_prompts(load_prompts(f"suite:{suite.name}"), target.tokenizer)]
        gens = generate_batch(engine, prompts, max_new_tokens=suite.max_new_tokens, method="dflash", stop_ids=stops)
        probs = [q for pr, g in zip(prompts, gens) for q in top1_probabilities(target, pr, g.tokens)]
        rows.append({"suite": suite.name, "prompts": len(prompts), "tokens": len(probs),
                     "tau": summarize([t for g in gens for t in g.accept_lengths], drafter.config.block_size)["tau"],
                     "top1_mean": statistics.mean(probs), "below_half": sum(q < 0.5 for q in probs) / len(probs),
                     "seconds": time.perf_counter() - t0})
        r = rows[-1]
        print(f"{r['suite']:10s} τ {r['tau']:.3f}  top-1 mean {r['top1_mean']:.3f}  below 0.5 {r['below_half']:.1%}"
              f"  ({r['tokens']} tokens, {r['seconds']:.0f} s)", flush=True)
    if args.json:
        settings = {"device": args.device, "dtype": args.dtype, "drafter": str(args.drafter or "bundled smollm2-drafter"),
                    "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
