"""`dflashkit eval`: acceptance length and speed of drafters, online or offline (docs/conventions.md).

- `online`: the target verifies for real; every drafter with DFlash and DDTree beside plain
  autoregressive decoding of the same prompt, greedy outputs checked token by token.
- `offline`: from cached target features (`--features DIR`), no target layers at all; decoding
  rounds replayed over the cached answers equal online greedy rounds.
- `suites`: the held-out suites of `data.prompts.EVAL_SUITES`, each with its own prompt count and
  answer length, side by side; the headline is the mean over suites, beside the worst suite.
- `partings`: where a greedy speculative output parts from the autoregressive one, proof that it
  is a numerical near-tie (anything else fails the evaluation).
- `report`: Markdown, report.json and PNG plots; `command`: the CLI.

τ of a round = accepted draft tokens + 1; the final round of an answer counts only the tokens up
to its end (stop token or length limit), online and offline alike. Reports: τ mean, histogram,
per-slot acceptance P(τ > k), rounds, tokens/s and speed-up.
"""

from dflashkit.evaluate.command import add_arguments, parse_drafters, run
from dflashkit.evaluate.offline import (FeatureItem, accepted, answer_spans, draft_spans, drafted_blocks,
                                        evaluate_offline, heldout_items, load_target_head, offline_accepted)
from dflashkit.evaluate.online import Prompt, eval_prompts, evaluate_online, warm_up
from dflashkit.evaluate.partings import (arbitrate_parting, check_partings, classify_parting, exact_logits,
                                         parting_summary, rounding_bound, unexplained_partings, where_parted)
from dflashkit.evaluate.report import markdown, plots, tau_sim_vs_online, training_tau_sim, write_report
from dflashkit.evaluate.suites import (bootstrap_intervals, evaluate_suites, paired_differences, pool_reports,
                                       prompt_rounds)
from dflashkit.evaluate.summary import method_labels, summarize
from dflashkit.objective import replay_rounds

__all__ = [
    "FeatureItem", "Prompt", "accepted", "add_arguments", "answer_spans", "arbitrate_parting", "bootstrap_intervals",
    "check_partings", "classify_parting", "draft_spans", "drafted_blocks", "eval_prompts", "evaluate_offline",
    "evaluate_online", "evaluate_suites", "exact_logits", "heldout_items", "load_target_head", "markdown",
    "method_labels", "offline_accepted", "paired_differences", "parse_drafters", "parting_summary", "plots",
    "pool_reports", "prompt_rounds", "replay_rounds", "rounding_bound", "run", "summarize", "tau_sim_vs_online",
    "training_tau_sim", "unexplained_partings", "warm_up", "where_parted", "write_report",
]
