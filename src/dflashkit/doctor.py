"""`dflashkit doctor`: check a drafter against a target, and a training data set against the
evaluation settings, before anyone spends GPU hours.

Every finding is one line: severity (error / warning / ok), the check, what was found and what to
do. The target is read without its weights (`load_target(weights=False)`): its config, tokenizer
and generation config hold every fact checked here. Exit code 1 when there is an error.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.checkpoint import CheckpointError, load_config, load_drafter, target_problems
from dflashkit.drafter import SLIDING, DrafterConfig, default_gamma
from dflashkit.progress import progress

ERROR, WARNING, OK = "error", "warning", "ok"

# A reasoning block as Qwen3-style templates and models write it; an unclosed one (a generation cut
# by its length limit) still counts. An empty block is what templates insert with thinking off.
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)


@dataclass
class Finding:
    severity: str  # ERROR, WARNING or OK
    check: str
    message: str  # what was found and, unless OK, what to do

    def __str__(self) -> str:
        return f"{self.severity.upper():<7} {self.check}: {self.message}"


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR]


# ---- drafter vs target --------------------------------------------------------------------------

_RETRAIN = "a drafter is tied to one target: doctor it against the target it was trained for, or train one for this target"
# target_problems() field prefix -> (check, what to do); its sentences name the field first.
_TARGET_CHECKS = {
    "hidden_size": ("hidden size", _RETRAIN),
    "vocab_size": ("vocabulary", "the drafter uses the target's embedding and LM head; " + _RETRAIN),
    "num_target_layers": ("target layers", _RETRAIN),
    "target_layer_ids": ("layer ids", "tap layers that exist: set drafter.target_layer_ids and retrain"),
    "mask_token_id": ("mask token", ""),  # mask_token_problems() already says what to do
}


def check_target(config: DrafterConfig, target: Any) -> list[Finding]:
    """Shape, vocabulary, layer, mask, RoPE, sliding-window and block-size checks."""
    problems = target_problems(config, target)
    ok = {
        "hidden_size": f"{config.hidden_size}, the target's",
        "vocab_size": f"{config.vocab_size} rows, the target's embedding",
        "num_target_layers": f"{config.num_target_layers}, the target's decoder layers",
        "target_layer_ids": f"{config.target_layer_ids} within 0..{target.num_layers - 1} (tap k = output of layer k)",
        "mask_token_id": _mask_ok(config.mask_token_id, target.tokenizer),
    }
    findings = []
    for field, (check, todo) in _TARGET_CHECKS.items():
        mine = [p for p in problems if p.startswith(field)]
        findings += [Finding(ERROR, check, f"{p}; {todo}" if todo else p) for p in mine]
        if not mine:
            findings.append(Finding(OK, check, ok[field]))
    findings += [Finding(ERROR, "target", p) for p in problems if not p.startswith(tuple(_TARGET_CHECKS))]
    findings += _layer_id_warnings(config, target)
    findings.append(_tokenizer_check(target))
    findings += _rope_checks(config, target)
    findings.append(_sliding_check(config))
    findings.append(_block_check(config))
    return findings


def _mask_ok(mask_id: int, tokenizer: Any) -> str:
    if tokenizer is None or mask_id >= len(tokenizer):
        return f"{mask_id}, a spare embedding row"
    return f"{mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}): not BOS/EOS/PAD/stop, not text, not in the chat template"


def _layer_id_warnings(config: DrafterConfig, target: Any) -> list[Finding]:
    ids, L = config.target_layer_ids, target.num_layers
    out = []
    if len(set(ids)) != len(ids):
        out.append(Finding(WARNING, "layer ids", f"{ids} taps a layer twice: fc gets the same features twice; "
                                                 "choose distinct layers"))
    if L - 1 in ids:
        out.append(Finding(WARNING, "layer ids", f"{ids} taps the last layer ({L - 1}): the vLLM speculators format "
                                                 "cannot express it (export --format reference still works)"))
    return out


def _tokenizer_check(target: Any) -> Finding:
    tok, rows = target.tokenizer, target.vocab_size
    if tok is None:
        return Finding(WARNING, "tokenizer", "the target has no tokenizer: the mask token was checked against the "
                                             "embedding size only; pass a target directory that has one")
    if len(tok) > rows:
        return Finding(ERROR, "tokenizer", f"{len(tok)} tokens but the target's embedding has {rows} rows: ids >= {rows} "
                                           "cannot be embedded; use the tokenizer that belongs to this target")
    return Finding(OK, "tokenizer", f"{len(tok)} tokens, {rows} embedding rows ({rows - len(tok)} spare)")


def _rope_checks(config: DrafterConfig, target: Any) -> list[Finding]:
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", None))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = []
    if theta is not None and float(theta) != config.rope_theta:
        out.append(Finding(WARNING, "rope", f"rope_theta {config.rope_theta:g} != target's {float(theta):g}: drafters are "
                                            "built with the target's; keep it only if it was trained this way, else "
                                            "rebuild the drafter config for this target"))
    if kind != "default":
        out.append(Finding(WARNING, "rope", f"the target uses '{kind}' RoPE scaling, the drafter plain RoPE (theta "
                                            f"{config.rope_theta:g}): expect lower acceptance at long positions; "
                                            "evaluate at the context lengths you serve"))
    target_max = getattr(tc, "max_position_embeddings", None)
    if target_max and config.max_position_embeddings < target_max:
        out.append(Finding(WARNING, "rope", f"max_position_embeddings {config.max_position_embeddings} < target's "
                                            f"{target_max}: engines may cap the context at the drafter's limit; raise it "
                                            "in config.json if the drafter was trained on long sequences"))
    if not out:
        out.append(Finding(OK, "rope", f"rope_theta {config.rope_theta:g}, plain RoPE, as the target"))
    return out


def _sliding_check(config: DrafterConfig) -> Finding:
    sliding = [i for i, t in enumerate(config.layer_types) if t == SLIDING]
    W, B = config.sliding_window, config.block_size
    if not sliding:
        if W:
            return Finding(WARNING, "sliding window", f"sliding_window {W} is set but no layer is '{SLIDING}' "
                                                      "(layer_types): it has no effect; drop it or mark layers sliding")
        return Finding(OK, "sliding window", f"none: all {config.num_hidden_layers} layers use full attention")
    if W < B:
        return Finding(WARNING, "sliding window", f"layers {sliding} slide over {W} context tokens, fewer than a block "
                                                  f"({B}): they see almost no context; use hundreds to thousands")
    return Finding(OK, "sliding window", f"layers {sliding} of {config.num_hidden_layers} see the last {W} context tokens")


def _block_check(config: DrafterConfig) -> Finding:
    B = config.block_size
    if B > 32:
        return Finding(WARNING, "block size", f"{B}: every round verifies {B} tokens while few drafts are accepted past "
                                              "the first ten or so; published DFlash drafters use 10 or 16")
    return Finding(OK, "block size", f"{B}: {len(config.draft_slots)} draft tokens per round (num_speculative_tokens), "
                                     f"loss decay gamma {default_gamma(B):g}")


def _kind_check(config: DrafterConfig) -> Finding:
    """The family member and its declared modules (the engine decodes both layouts)."""
    return Finding(OK, "kind", config.summary())


# ---- training data vs evaluation ------------------------------------------------------------------


def has_reasoning(text: str) -> bool:
    """Whether `text` holds a non-empty <think> block (written with thinking on)."""
    return any(m.group(1).strip() for m in _THINK.finditer(text))


def check_data(path: str | Path, config: DrafterConfig, tokenizer: Any, *, thinking: bool,
               thinking_field: str = "data.thinking", limit: int | None = 1000) -> list[Finding]:
    """A regenerated JSONL (`messages`) or a tokenized JSONL (`input_ids`) against the chat template,
    the evaluation's thinking mode and the mask token."""
    path = Path(path)
    if not path.is_file():
        return [Finding(ERROR, "data", f"{path} does not exist: pass the regenerated or tokenized JSONL")]
    if tokenizer is None:
        return [Finding(ERROR, "data", "the target has no tokenizer: data cannot be checked")]
    tokenized = _is_tokenized(path)
    try:
        samples = _tokenized_samples(path, tokenizer, limit) if tokenized else \
            _conversation_samples(path, tokenizer, thinking, limit)
    except (ValueError, OSError) as e:
        return [Finding(ERROR, "data", f"{e}")]
    texts, ids, findings = samples
    n = len(texts)
    what = f"{n} {'tokenized samples' if tokenized else 'conversations'} of {path.name}"
    findings.append(_thinking_check(texts, tokenizer, thinking, thinking_field, what))
    findings.append(_mask_in_data_check(ids, config.mask_token_id, tokenizer, what))
    return findings


def _is_tokenized(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    return False  # the conversation loader reports the bad line
                return isinstance(rec, dict) and "input_ids" in rec
    return False


def _probe_ids(tokenizer: Any) -> set[int]:
    """Special tokens the chat template writes around a turn (its role markers)."""
    from dflashkit.data.chat import encode, render

    text = render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return {i for i in encode(tokenizer, text) if i in special}


def _tokenized_samples(path: Path, tokenizer: Any, limit: int | None) -> tuple[list[str], list[list[int]], list[Finding]]:
    from dflashkit.data.chat import load_tokenized

    samples = load_tokenized(path)[:limit]
    ids = [s.input_ids for s in samples]
    findings = []
    top = max((max(x) for x in ids if x), default=-1)
    if top >= len(tokenizer):
        findings.append(Finding(ERROR, "token ids", f"{path.name} holds token id {top}, beyond the target's "
                                                        f"{len(tokenizer)} tokens: it was tokenized for another model; "
                                                        "re-tokenize it with this target (dflashkit tokenize)"))
    markers = _probe_ids(tokenizer) if getattr(tokenizer, "chat_template", None) else set()
    bare = sum(1 for x in ids if markers and not markers & set(x))
    if bare:
        findings.append(Finding(ERROR, "chat template", f"{bare} of {len(ids)} samples contain none of the chat "
                                                        f"template's tokens {sorted(markers)}: they were not rendered "
                                                        "with this target's template; re-tokenize (dflashkit tokenize)"))
    elif not findings:
        findings.append(Finding(OK, "chat template", f"all {len(ids)} samples carry the target's chat template tokens"))
    unsupervised = sum(1 for s in samples if not any(s.loss_mask))
    if unsupervised:
        findings.append(Finding(WARNING, "data", f"{unsupervised} of {len(ids)} samples have no supervised token "
                                                 "(loss_mask all 0): they cost time and teach nothing"))
    V = len(tokenizer)
    texts = [tokenizer.decode([t for t in x if t < V]) for x in progress(ids, desc="doctor: decode", unit="sample")]
    return texts, ids, findings


def _conversation_samples(path: Path, tokenizer: Any, thinking: bool,
                          limit: int | None) -> tuple[list[str], list[list[int]], list[Finding]]:
    from dflashkit.data.chat import ChatTemplateError, encode, render
    from dflashkit.data.prompts import load_prompts_report

    convs, problems = load_prompts_report(str(path), limit=limit)
    findings = []
    if problems:
        findings.append(Finding(WARNING, "data", f"{len(problems)} malformed records skipped (first: {problems[0]}); "
                                                 "fix or drop them"))
    answered = [c for c in convs if c.messages[-1]["role"] == "assistant"]
    if len(answered) < len(convs):
        findings.append(Finding(WARNING, "data", f"{len(convs) - len(answered)} of {len(convs)} conversations end "
                                                 "without an answer: regenerate them (dflashkit regenerate)"))
    texts, ids = [], []
    try:
        for c in progress(answered, desc="doctor: render", unit="conv"):
            # What training will see: the target's template with the configured thinking mode.
            ids.append(encode(tokenizer, render(tokenizer, c.messages, thinking=thinking)))
            texts.append("\n".join(m["content"] for m in c.messages if m["role"] == "assistant"))
    except ChatTemplateError as e:
        return [], [], [*findings, Finding(ERROR, "chat template", f"{e}: use a target whose tokenizer has one")]
    findings.append(Finding(OK, "chat template", f"conversations are rendered with the target's template when "
                                                 f"tokenized ({len(answered)} answered)"))
    return texts, ids, findings


def _template_ignores_thinking(tokenizer: Any) -> bool:
    from dflashkit.data.chat import render

    m = [{"role": "user", "content": "Hi"}]
    return render(tokenizer, m, thinking=True, generation_prompt=True) == \
        render(tokenizer, m, thinking=False, generation_prompt=True)


def _thinking_check(texts: list[str], tokenizer: Any, thinking: bool, field: str, what: str) -> Finding:
    n = len(texts)
    on = sum(has_reasoning(t) for t in texts)
    setting = f"{field}={str(thinking).lower()}"
    if not n:
        return Finding(WARNING, "thinking mode", f"no sample to check in {what}")
    if not thinking and on:
        sev = ERROR if on * 2 >= n else WARNING
        return Finding(sev, "thinking mode", f"{on} of {n} samples hold <think> reasoning (written with thinking on) "
                                             f"but evaluation runs with thinking off ({setting}): regenerate the data "
                                             f"with thinking off, or evaluate with {field}=true")
    if thinking and _template_ignores_thinking(tokenizer):
        return Finding(WARNING, "thinking mode", f"{setting} but the target's chat template ignores enable_thinking: "
                                                 f"set {field}=false")
    if thinking and on * 2 < n:
        return Finding(ERROR, "thinking mode", f"only {on} of {n} samples hold <think> reasoning but evaluation runs "
                                               f"with thinking on ({setting}): regenerate the data with thinking on, "
                                               f"or evaluate with {field}=false")
    return Finding(OK, "thinking mode", f"{on} of {n} samples hold reasoning, consistent with {setting} ({what})")


def _mask_in_data_check(ids: list[list[int]], mask_id: int, tokenizer: Any, what: str) -> Finding:
    hits = [sum(1 for t in x if t == mask_id) for x in ids]
    samples, total = sum(1 for h in hits if h), sum(hits)
    if total:
        name = tokenizer.convert_ids_to_tokens(mask_id) if mask_id < len(tokenizer) else mask_id
        return Finding(ERROR, "mask in data", f"mask token {mask_id} ({name!r}) occurs {total} times in {samples} of "
                                            f"{len(ids)} samples: the drafter cannot tell a mask slot from real text; "
                                            "choose another mask token (drafter.mask_token_id) or clean the data")
    return Finding(OK, "mask in data", f"{mask_id} never occurs in the {what}")


# ---- the whole check -------------------------------------------------------------------------------


def doctor(drafter_dir: str | Path, target: Any, *, data: str | Path | None = None, thinking: bool = False,
           thinking_field: str = "data.thinking", limit: int | None = 1000) -> list[Finding]:
    """All findings for a drafter directory (reference format) against `target` (a `Target`,
    weights optional) and, optionally, a training data file."""
    try:
        config = load_config(drafter_dir)
    except CheckpointError as e:  # its message names the file, the cause and what to do
        return [Finding(ERROR, "config", str(e))]
    findings = [Finding(OK, "config", f"{Path(drafter_dir) / 'config.json'}: {config.num_hidden_layers} layers, "
                                      f"{config.num_taps} taps"), _kind_check(config)]
    try:
        drafter = load_drafter(drafter_dir)
        findings.append(Finding(OK, "weights", f"{drafter.num_parameters() / 1e6:.1f}M parameters "
                                               f"({next(drafter.parameters()).dtype})"))
    except CheckpointError as e:  # a damaged or missing file as much as weights of another shape
        findings.append(Finding(ERROR, "weights", str(e)))
    findings += check_target(config, target)
    findings += check_layers(target)
    if data is not None:
        findings += check_data(data, config, target.tokenizer, thinking=thinking, thinking_field=thinking_field,
                               limit=limit)
    return findings


def check_layers(target: Any) -> list[Finding]:
    """The target's layer kinds, the decoding engine that will run them and, for hybrids, which
    Gated DeltaNet kernels run where."""
    from dflashkit.decode.static import supported
    from dflashkit.target import fla_missing

    kinds = target.layer_kinds
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    window = getattr(target.config, "sliding_window", None)
    names = {"full_attention": "full attention", "sliding_attention": f"sliding window ({window})",
             "linear_attention": "linear attention (Gated DeltaNet)"}
    found = [Finding(OK, "layers", f"{len(kinds)} layers: " + ", ".join(f"{n} {names.get(k, k)}" for k, n in counts.items()))]
    why = supported(target)
    if "linear_attention" not in counts:
        engine = "the static runner (CUDA graphs on GPU)" if why is None else f"the Transformers runner ({why})"
        return found + [Finding(OK, "decoding", f"eval, generate and serve run {engine}")]
    if why is not None:
        return found + [Finding(ERROR, "decoding", f"{why}: linear-attention layers must be rolled back after each "
                                                    "draft, which only the static runner does (Qwen3.5 / Qwen3.6 / Qwen3-Next layers); "
                                                    "eval, generate and serve refuse this target")]
    found.append(Finding(OK, "decoding", "eval, generate and serve run the static runner: the Gated DeltaNet state of "
                                         "each draft tree in one block, rolled back to the accepted leaf (PyTorch, any device)"))
    cfg = target.config
    if getattr(cfg, "num_experts", None):
        found.append(Finding(OK, "mlp", f"mixture of experts ({cfg.num_experts} experts, {cfg.num_experts_per_tok} per "
                                        "token, Transformers' own module): the target's layers run without CUDA graphs "
                                        "(routing has data-dependent shapes); the drafter's step is still captured"))
    if fla_missing(target):
        found.append(Finding(WARNING, "kernels", "fla-core is not installed: extraction and online training run "
                                                 "Transformers' PyTorch fallbacks for the linear layers (correct, slow on "
                                                 "GPU); pip install 'dflashkit[fla]' there, then compare with "
                                                 "`dflashkit check-features target:runner=static target`"))
    else:
        found.append(Finding(OK, "kernels", "fla-core installed: extraction and online training use its Triton kernels "
                                            "for the linear layers; `dflashkit check-features target:runner=static "
                                            "target` compares them with the decoding runner"))
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options, positive_int

    p.add_argument("drafter", metavar="DRAFTER", help="reference-format drafter directory")
    p.add_argument("--target", metavar="PATH", help="target model: directory, hub id or .gguf (default: target.path, "
                                                    "else the embedded SmolLM2); its weights are not read")
    p.add_argument("--data", metavar="JSONL", help="training data: regenerated conversations (messages) or tokenized "
                                                   "samples (input_ids); default: data.tokenized, else data.regenerated")
    p.add_argument("--limit", type=positive_int, default=1000, metavar="N", help="check the first N samples (default 1000)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args
    from dflashkit.target import load_target

    cfg = config_from_args(args)
    target = load_target(args.target or cfg.target.path, gguf_file=cfg.target.gguf_file, weights=False)
    # Evaluation renders prompts with the same chat-template switch as the data pipeline unless
    # the eval section has its own.
    field = "eval.thinking" if getattr(cfg.eval, "thinking", None) is not None else "data.thinking"
    thinking = bool(getattr(cfg.eval, "thinking", None) if field == "eval.thinking" else cfg.data.thinking)
    data = args.data or cfg.data.tokenized or cfg.data.regenerated
    findings = doctor(args.drafter, target, data=data, thinking=thinking, thinking_field=field, limit=args.limit)
    for f in findings:
        print(f)
    n_err, n_warn = len(errors(findings)), sum(f.severity == WARNING for f in findings)
    print(f"doctor: {n_err} error(s), {n_warn} warning(s) for {args.drafter} against {target.name}"
          + (f" and {data}" if data else ""))
    return 1 if n_err else 0
