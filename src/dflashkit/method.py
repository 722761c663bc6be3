"""What a decoding method is: the leaf that the CLI, the configuration and the decoding package share.

A `Method` is made once where a request's settings come in (`Method.of`: the CLI's `--method`,
the API's `method=`, a configuration's fields) and carries what every round asks of it: whether
it drafts, whether its trees are chains, and the node budget and candidates of a DDTree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Kind = Literal["ar", "dflash", "ddtree"]
METHODS: tuple[str, ...] = get_args(Kind)

# How a sampled round accepts drafted tokens (greedy rounds accept the target's argmax either way):
# 'rejection' draws the draft from the drafter's distribution and accepts with min(1, p/q)
# (decode/accept.py); 'match' drafts the drafter's most likely tokens and accepts one when it
# equals the target's own sample (what an engine that verifies without the drafter's
# probabilities gets). Both are exact (docs/conventions.md).
Acceptance = Literal["match", "rejection"]
ACCEPTANCES: tuple[str, ...] = get_args(Acceptance)
# The default of decoding, `generate`, `eval` and `serve`: the faster one as measured. With SmolLM2
# and its bundled drafter on an H100, the rejection rule raises τ (T 0.7: DFlash 1.92 to 2.08,
# DDTree-64 2.90 to 2.95; T 1.0: 1.47 to 1.72, 2.10 to 2.17), but its draws and checks, replayed
# from CUDA graphs, cost more than that gains on a target whose round takes 1.6 ms (T 0.7:
# speed-up 1.36x to 1.19x, 1.36x to 1.17x; T 1.0: 1.05x to 0.99x, 0.99x to 0.87x; docs/benchmarks.md).
DEFAULT_ACCEPTANCE: Acceptance = "match"

# DDTree's candidates per slot, the default of decoding, `generate`, `eval` and `serve`. None: as
# many as the tree's node budget, so that `best_first` picks the budget's best prefixes among all
# of them (fewer leave out likely siblings where the drafter is unsure: with SmolLM2's bundled
# drafter, DDTree-64's τ on every evaluation suite rose by 0.21-0.39 from 4 candidates to 64,
# chat's the most; docs/benchmarks.md).
TOP_K: int | None = None


@dataclass(frozen=True)
class Method:
    """'ar': no draft (a round verifies the bonus token alone); 'dflash': one chain of the draft
    block's argmax tokens; 'ddtree': a best-first tree of `budget` nodes from the top-`top_k`
    tokens of each slot (None: `budget` of them). acceptance: how its sampled rounds accept
    (`Acceptance`)."""

    kind: Kind = "dflash"
    budget: int | None = None
    top_k: int | None = TOP_K
    acceptance: Acceptance = DEFAULT_ACCEPTANCE

    def __post_init__(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.kind!r}")
        if self.acceptance not in ACCEPTANCES:
            raise ValueError(f"acceptance: expected one of {ACCEPTANCES}, got {self.acceptance!r}")
        if self.kind == "ddtree" and (self.budget is None or self.budget < 1):
            raise ValueError(f"ddtree needs a node budget >= 1, got {self.budget}")
        top_k = self.top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k (DDTree's candidates per slot): expected None (the node budget) or an int >= 1, "
                             f"got {top_k!r}")

    @classmethod
    def of(cls, method: str | Method, budget: int | None = None, top_k: int | None = TOP_K,
           acceptance: str = DEFAULT_ACCEPTANCE) -> Method:
        """The method a caller names: a `Method` as it is, or its kind with DDTree's budget and
        candidates (ignored by the other kinds) and the acceptance rule of its sampled rounds."""
        if isinstance(method, Method):
            return method
        if method == "ddtree":
            return cls(method, budget, top_k, acceptance)  # type: ignore[arg-type]
        return cls(method, acceptance=acceptance)  # type: ignore[arg-type]

    @property
    def drafts(self) -> bool:
        """A round drafts (needs a drafter)."""
        return self.kind != "ar"

    @property
    def chain(self) -> bool:
        """Every row's tree is a chain (DFlash; AR's tree of no node too)."""
        return self.kind != "ddtree"

    @property
    def tree_budget(self) -> int | None:
        """What the draft step builds: None, DFlash's chain; else DDTree's node budget."""
        return self.budget if self.kind == "ddtree" else None

    @property
    def label(self) -> str | None:
        """The name that statistics carry: None for AR, 'dflash', 'ddtree-<budget>'."""
        return None if self.kind == "ar" else f"ddtree-{self.budget}" if self.kind == "ddtree" else "dflash"

    def widest(self, block: int) -> int:
        """Nodes a round verifies per row at most (the bonus included), for an engine's `block`."""
        return 1 if self.kind == "ar" else block if self.kind == "dflash" else self.budget + 1
