"""Does DDTree pick better trees if the drafter's log-probabilities are recalibrated before the
best-first search? Offline, on the target's own greedy answers to each evaluation suite's prompts
(the replay equals online greedy decoding, `test_offline_tau_equals_online_tiny_trained`): τ of
DDTree with every slot scored by log_softmax(logits / T), scaled by s^(depth - 1), against the
drafter's own scores (T = 1, s = 1). T > 1 flattens each slot; s < 1 makes deep slots cheaper
(a deep slot's probability is marginal, its acceptance conditional on the path so far).

    python benchmarks/ddtree_scoring.py --limit 12 --json out.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch

from dflashkit.checkpoint import atomic_write_json, load_drafter
from dflashkit.data.features import online_features
from dflashkit.data.regenerate import probe_sets
from dflashkit.decode.tree import best_first, candidates
from dflashkit.demo import bundled_drafter_dir
from dflashkit.evaluate import accepted, draft_spans, drafted_blocks
from dflashkit.objective import replay_rounds
from dflashkit.target import load_target


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default=None, help="drafter directory (default: the bundled SmolLM2 drafter)")
    p.add_argument("--limit", type=int, default=12, help="prompts per suite")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget (as many candidates a slot)")
    p.add_argument("--temperatures", default="1,0.8,0.9,1.25,1.5,2", help="T, comma list")
    p.add_argument("--depth-scales", default="1,0.7,0.8,0.9,0.95,1.05,1.1", help="s, comma list")
    p.add_argument("--json")
    args = p.parse_args()
    target = load_target(dtype="float32")
    drafter = load_drafter(args.drafter or bundled_drafter_dir(), target, dtype=torch.float32)
    variants = [(T, s) for T in floats(args.temperatures) for s in floats(args.depth_scales)]
    depth = torch.arange(drafter.config.block_size - 1)[None, :, None]  # slot d-1 of [n, B-1, K]
    table: dict[str, dict[str, float]] = {}
    probes = probe_sets("suites", target, 0, limit=args.limit)  # (each suite answers to its own length)
    for suite, samples in probes.items():
        rounds: dict[tuple[float, float], list[int]] = {v: [] for v in variants}
        for sample in samples:
            ids = torch.tensor(sample.input_ids)
            item = SimpleNamespace(input_ids=ids, loss_mask=torch.tensor(sample.loss_mask),
                                   features=online_features(target, ids[None], drafter.config.target_layer_ids)[0])
            acc: dict[tuple[float, float], dict[int, int]] = {v: {} for v in variants}
            spans = draft_spans(item.loss_mask)
            for part, logits, roots, truth in drafted_blocks(drafter, target, item, spans):
                z = logits.float()
                # the same candidates for every T (monotone), as many as DDTree's default
                top, idx = z.topk(candidates(args.budget, None, z.shape[-1]), dim=-1)
                for T in {T for T, _ in variants}:
                    lp = top / T - torch.logsumexp(z / T, -1, keepdim=True)
                    for s in {s for t, s in variants if t == T}:
                        trees = best_first(lp * s ** depth, idx, args.budget)
                        acc[(T, s)].update(zip(part, accepted(trees, roots, truth).tolist()))
            for v in variants:
                rounds[v] += replay_rounds(acc[v], spans)[0]
        table[suite] = {f"T={T:g} s={s:g}": sum(r) / len(r) for (T, s), r in rounds.items()}
        base = table[suite]["T=1 s=1"]
        print(f"{suite}: τ {base:.3f} with the drafter's scores; best other "
              f"{max((x, k) for k, x in table[suite].items() if k != 'T=1 s=1')}", flush=True)
    names = list(next(iter(table.values())))
    print(f"\nDDTree-{args.budget} τ, first {args.limit} prompts a suite, minus the drafter's own scores' τ")
    print("| T, s | " + " | ".join(table) + " | mean |\n|---|" + "---:|" * (len(table) + 1))
    for k in names:
        diffs = [table[s][k] - table[s]["T=1 s=1"] for s in table]
        cells = [f"{table[s][k]:.3f}" if k == "T=1 s=1" else f"{d:+.3f}" for s, d in zip(table, diffs)]
        mean = sum(table[s][k] for s in table) / len(table) if k == "T=1 s=1" else sum(diffs) / len(diffs)
        print(f"| {k} | " + " | ".join(cells) + (f" | {mean:.3f} |" if k == "T=1 s=1" else f" | {mean:+.3f} |"))
    if args.json:
        atomic_write_json(Path(args.json), {"budget": args.budget, "limit": args.limit, "tau": table})


if __name__ == "__main__":
    main()
