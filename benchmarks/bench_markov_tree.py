"""DSpark's drafts from the Markov-biased conditionals against DDTree over the unbiased marginals.

Two measurements, on a CPU:

- acceptance (greedy τ) on a synthetic first-order target (its next token's logits A[last], V
  tokens, A of rank `rank` plus noise): the unbiased drafter drafts each slot from its exact marginal given the
  round's context (the best any drafter whose slots ignore each other can do), the DSpark drafter
  from the same slot-0 distribution plus a vanilla Markov head of rank `rank` holding the
  target's transition logits (their best rank-r approximation). So it measures what a Markov head
  of that rank can add on a target whose next token follows the token before, not a trained
  drafter.
- time per draft tree at a real drafter's shapes (default SmolLM2's: V 49152, H 576, 15 slots,
  rank 256), random weights: `tree.drafted` (DDTree over the marginals, DFlash's chain) against
  `markov.markov_tree` / `markov_chain` (vanilla and rnn heads).

    python3 benchmarks/bench_markov_tree.py --json docs/results/markov-tree-cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflashkit.decode.markov import MarkovDraft, markov_chain, markov_tree
from dflashkit.decode.tree import ancestors, drafted, walk
from dflashkit.family import MarkovHead


def synthetic_tau(V: int, S: int, budgets: list[int | None], rank: int, peak: float, rows: int, seed: int) -> dict:
    """Mean greedy τ per round of each drafter and budget (None: the chain) over `rows` contexts."""
    g = torch.Generator().manual_seed(seed)
    # Target logits after token t: A[t], of rank `rank` (what a head of that rank can hold) plus noise.
    A = peak * (torch.randn(V, rank, generator=g) @ torch.randn(rank, V, generator=g) / rank**0.5
                + 0.3 * torch.randn(V, V, generator=g))
    P = torch.softmax(A, -1)
    first = torch.randint(0, V, (rows,), generator=g)
    marg = [P[first]]  # the exact marginal of each slot given the context
    for _ in range(S - 1):
        marg.append(marg[-1] @ P)
    unary = torch.stack(marg, 1).log()  # [rows, S, V]
    head = MarkovHead(V, 8, rank, "vanilla")
    U, sv, Vh = torch.linalg.svd(A - A.mean(-1, keepdim=True))
    with torch.no_grad():  # bias W2 W1[prev] = the rank-r part of the (centred) transition logits
        head.markov_w1.weight.copy_(U[:, :rank] * sv[:rank])
        head.markov_w2.weight.copy_(Vh[:rank].T)
    spark_unary = torch.cat([unary[:, :1], torch.zeros(rows, S - 1, V)], 1)  # slot 0: the context's exact
    spark_unary[:, 0] -= head.bias(head.embed(first))  # (its bias after the bonus cancels: slot 0 stays exact)
    spark = MarkovDraft(spark_unary, torch.zeros(rows, S, 8), first, head, None, False)
    out = {}
    for budget in budgets:
        name = "chain" if budget is None else f"ddtree-{budget}"
        with torch.no_grad():
            plain = drafted(unary, budget, None, scored=True)
            biased = markov_chain(spark) if budget is None else markov_tree(spark, budget, None)
        out[name] = {"marginals": _tau(plain, first, A), "markov": _tau(biased, first, A)}
    return out


def _tau(trees, first, A) -> float:
    nodes = torch.cat([first[:, None], trees.tokens], 1)
    walked = walk(trees, ancestors(trees.parents), A[nodes].argmax(-1))
    return round(float(walked.accepted.double().mean()) + 1, 4)


def tree_seconds(V: int, H: int, S: int, rank: int, budgets: list[int | None], reps: int, seed: int) -> dict:
    """Seconds per draft tree of one row at these shapes: marginals vs the Markov beam (vanilla, rnn)."""
    g = torch.Generator().manual_seed(seed)
    unary, hidden = torch.randn(1, S, V, generator=g), torch.randn(1, S, H, generator=g)
    first = torch.randint(0, V, (1,), generator=g)
    heads = {kind: MarkovHead(V, H, rank, kind) for kind in ("vanilla", "rnn")}
    with torch.no_grad():
        for head in heads.values():
            head.markov_w2.weight.normal_(0, 0.02, generator=g)
    out = {}
    for budget in budgets:
        name = "chain" if budget is None else f"ddtree-{budget}"
        runs = {"marginals": lambda: drafted(unary, budget, None, scored=True)}
        for kind, head in heads.items():
            spark = MarkovDraft(unary, hidden, first, head, None, False)
            runs[f"markov-{kind}"] = (lambda s=spark: markov_chain(s)) if budget is None else \
                (lambda s=spark: markov_tree(s, budget, None))
        out[name] = {k: round(_time(fn, reps) * 1e3, 2) for k, fn in runs.items()}
    return out


@torch.no_grad()
def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--slots", type=int, default=15)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--budgets", default="chain,16,64")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    budgets = [None if b == "chain" else int(b) for b in a.budgets.split(",")]
    syn = dict(V=64, S=7, rank=16, peak=2.5, rows=4000, seed=0)
    result = {"synthetic": {**syn, "tau": synthetic_tau(budgets=budgets, **syn)},
              "seconds": {"vocab": a.vocab, "hidden": a.hidden, "slots": a.slots, "rank": a.rank,
                          "threads": a.threads, "ms_per_tree": tree_seconds(a.vocab, a.hidden, a.slots, a.rank,
                                                                            budgets, a.reps, 0)}}
    print("greedy tau, synthetic first-order target (V 64, 7 slots, Markov head rank 16):")
    print(f"{'draft':>10} {'marginals':>10} {'markov':>8}")
    for name, r in result["synthetic"]["tau"].items():
        print(f"{name:>10} {r['marginals']:>10.3f} {r['markov']:>8.3f}")
    print(f"ms per draft tree, V {a.vocab}, H {a.hidden}, {a.slots} slots, rank {a.rank}, {a.threads} threads:")
    for name, r in result["seconds"]["ms_per_tree"].items():
        print(f"{name:>10} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
