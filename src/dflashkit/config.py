"""One typed configuration for every stage, validated once at the edge.

Defaults are the published recipe (docs/recipe.md, docs/conventions.md). Load from YAML, override from the command line with
`section.field=value` (the value is parsed as YAML: `train.lr=3e-4`, `drafter.layer_types=[...]`).
A wrong field gives one line naming it and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, field_validator,
                      model_validator)

from dflashkit.method import TOP_K


def _not_bool(value: Any) -> Any:
    # bool is an int subclass: without this, `max_steps: true` would silently become 1.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


# Numbers: no booleans (YAML strings such as "3e-4" still parse); floats must be finite (the
# models set allow_inf_nan=False); booleans must be true/false, not 1/"yes".
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = Annotated[bool, Strict()]
Seed = Annotated[Int, Field(ge=0, le=2**63 - 1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TargetConfig(_Section):
    path: str | None = Field(None, description="local dir, hub id, or .gguf file; None = embedded SmolLM2 default")
    gguf_file: str | None = Field(None, description="GGUF file name inside `path`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1'...")
    parallel: Literal["replicate", "shard"] = Field(
        "replicate", description="under torchrun (train, extract): 'replicate' = the whole target in every "
        "process; 'shard' = its decoder layers' weights split over the processes (FSDP2; each layer gathered "
        "for the forward, every process on its own batch), for a target larger than one GPU (docs/training.md)")
    compile: Bool | None = Field(None, description="torch.compile the target's decoder layers up to the deepest tap "
                                 "for online training's feature pass (CUDA; 1.16x whole-step samples/s at the Qwen3-8B "
                                 "shape); None = on for targets without linear-attention layers")


class DrafterSettings(_Section):
    num_layers: Int = Field(5, ge=1, description="drafter decoder layers")
    num_taps: Int = Field(5, ge=1, description="target layers whose hidden states feed the drafter")
    target_layer_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(None, description="None = the default formula (docs/conventions.md, Layer taps)")
    block_size: Int = Field(16, ge=2, description="tokens per block: the bonus token + block_size - 1 drafted")
    mask_token_id: Int | None = Field(None, ge=0, description="None = the default rule (spare row / mask / unused special)")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="per drafter layer; None = all full attention")
    sliding_window: Int | None = Field(None, ge=1, description="context positions a sliding layer sees")
    intermediate_size: Int | None = Field(None, ge=1, description="the MLP width; None = the target's (3x hidden "
                                          "for a mixture-of-experts target, which has no dense width)")
    init_from: str | None = Field(None, description="start from this reference-format drafter directory")
    grow_layers: Int = Field(0, ge=0, description="with init_from: append this many layers that start as "
                             "the identity, so training begins at the loaded drafter's acceptance with more capacity")
    kind: Literal["dflash", "dflash2", "dspark"] | None = Field(
        None, description="the family member: 'dflash' (the backbone), 'dflash2' (block convolutions + candidate "
        "selector), 'dspark' (Markov head + confidence head); None = 'dflash', or init_from's kind. With init_from "
        "a DFlash drafter, 'dflash2' / 'dspark' add their modules as fresh (convolutions identity, Markov bias zero)")
    conv_kernel_size: Int = Field(2, ge=1, description="dflash2: taps of each block convolution")
    conv_group_size: Int = Field(16, ge=1, description="dflash2: channels sharing one dynamic kernel")
    selector_rank: Int = Field(256, ge=1, description="dflash2: rank of the candidate selector")
    selector_top_k: Int = Field(16, ge=1, description="dflash2: unary candidates per slot the selector reranks")
    markov_rank: Int = Field(256, ge=1, description="dspark: rank of the Markov head")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field("vanilla", description="dspark: the Markov head's kind")
    enable_confidence_head: Bool = Field(True, description="dspark: attach the acceptance-probability head")
    confidence_head_with_markov: Bool = Field(True, description="dspark: the confidence head also reads the Markov embedding")
    sample_from_anchor: Bool | None = Field(None, description="anchor-first layout (slot 0 drafts too); None = "
                                            "true for dspark, false otherwise")

    @field_validator("target_layer_ids")
    @classmethod
    def _distinct_taps(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError(f"{ids} taps a layer twice; expected distinct layers (a tap repeated gives the drafter "
                             "the same features twice)")
        return ids

    @model_validator(mode="after")
    def _sliding_needs_window(self) -> "DrafterSettings":
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window must be set when a layer is 'sliding_attention'")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
        if self.grow_layers and not self.init_from:
            raise ValueError("grow_layers needs init_from (the drafter to grow)")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != self.num_taps:
            raise ValueError(f"target_layer_ids has {len(self.target_layer_ids)} entries, num_taps is {self.num_taps}")
        return self


class DataConfig(_Section):
    prompts: str = Field("builtin", description="'builtin' (2,200 prompts), 'builtin:N' (N of the same "
                         "generator), 'self:N' (N written by the target), 'humaneval', a JSONL/JSON/Parquet "
                         "file, a datasets name, or several joined by '+' (self:16000+builtin:8000)")
    limit: Int | None = Field(None, ge=1, description="use at most this many prompts / samples")
    regenerated: str | None = Field(None, description="JSONL of target-written answers (output of `regenerate`)")
    tokenized: str | None = Field(None, description="JSONL of token ids + loss masks (output of `tokenize`)")
    features: str | None = Field(None, description="feature cache dir (output of `extract`); None = online")
    feature_dtype: Literal["bfloat16", "float16", "float32", "fp8"] = Field(
        "bfloat16", description="how `extract` stores features (fp8: e4m3 with a float32 scale per token and tap)")
    max_length: Int = Field(2048, ge=8, description="tokens per training sequence (longer ones are cut)")
    max_new_tokens: Int = Field(512, ge=1, description="answer length `regenerate` allows")
    temperature: Float = Field(0.0, ge=0.0, description="`regenerate` sampling; 0 = greedy, what greedy serving accepts")
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    thinking: Bool = Field(False, description="passed to the chat template as enable_thinking")
    batch_size: Int = Field(8, ge=1, description="`regenerate` (local) and self:N: rows decoded together")
    self_prompts: str | None = Field(None, description="YAML of the categories, openers and shares that "
                                     "'self:N' writes (None: the bundled dflashkit/assets/self_prompts.yaml)")
    seed: Seed = Field(0, description="sampling seed of `regenerate` when temperature > 0, and of "
                      "the prompts 'self:N' writes")


class TrainConfig(_Section):
    output_dir: str = Field("runs/train", description="checkpoints, best/, final/, metrics.jsonl, curves.png")
    lr: Float = Field(6e-4, gt=0, description="AdamW peak learning rate (fine-tuning: ~2e-4)")
    weight_decay: Float = Field(0.0, ge=0)
    warmup_ratio: Float = Field(0.04, ge=0, lt=1, description="share of steps of linear warm-up, then cosine to 0")
    grad_clip: Float = Field(1.0, gt=0, description="gradient-norm clip")
    batch_size: Int = Field(16, ge=1, description="sequences per optimiser step (global)")
    micro_batch_size: Int = Field(1, ge=1, description="sequences per forward pass and process")
    epochs: Float = Field(1.0, gt=0, description="passes over the training split")
    max_steps: Int | None = Field(None, ge=1, description="overrides epochs")
    probes: str | None = Field(None, description="prompts whose answers by the target training replays decoding "
                               "rounds on, never trained on (needs online features): 'suites' (the evaluation "
                               "suites, each its own answer length) or a prompt set (file, dataset, 'builtin:N') "
                               "answered to data.max_new_tokens; best.json: tau_rounds_probes")
    time_budget_s: Float | None = Field(None, gt=0, description="wall-clock budget from the start of `train`; "
                                        "overrides epochs (max_steps still caps): the schedule is fitted to the "
                                        "steps that fit, timed over the first steps")
    anchors_per_seq: Int = Field(512, ge=1, description="blocks trained per sequence (anchors drawn without replacement)")
    loss: Literal["ce", "kl", "dpace"] = Field("ce", description="ce: the recipe (hard labels, slot decay gamma)")
    gamma: Float | None = Field(None, gt=0, description="slot decay; None = 7 (B=16), 5 (B=10), 4 (B=8)")
    kl_weight: Float = Field(1.0, ge=0, le=1, description="share of KL in the 'kl' loss; rest is hard CE")
    kl_temperature: Float = Field(1.0, gt=0)
    dpace_alpha: Float = Field(0.5, gt=0, le=1, description="confidence smoothing of the 'dpace' loss")
    selector_loss_alpha: Float = Field(1.0, ge=0, description="dflash2: weight of the selector's K-way cross-entropy")
    confidence_head_alpha: Float = Field(1.0, ge=0, description="dspark: weight of the confidence head's BCE against "
                                         "sum_v min(p_v, q_v), the slot's acceptance chance under the rejection rule")
    feature_noise: Float = Field(0.0, ge=0, description="std of Gaussian noise on fc inputs only")
    attention: Literal["auto", "sdpa", "flex"] = Field("auto", description="auto: flex on GPU, sdpa on CPU")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: bfloat16 on GPU, float32 on CPU")
    compile: Bool | None = Field(None, description="torch.compile the drafter layers; None = on CUDA")
    parallel: Literal["auto", "ddp", "fsdp"] = Field("auto", description="under torchrun: DDP (auto) or FSDP2")
    dist_timeout: Float = Field(600.0, ge=10, description="under torchrun: seconds a collective waits for a rank "
                                "that does not arrive before the job fails (torchrun --max-restarts then restarts "
                                "it); cover the longest wait of a sound job: loading the target, a checkpoint save")
    optimizer_state: Literal["device", "host"] = Field(
        "device", description="where the fp32 master weights and AdamW moments live: 'host' streams them through "
        "the GPU at each optimiser step (same results, ~24 bytes per drafter parameter over PCIe per step), for a "
        "drafter that does not fit beside its target")
    eval_every: Int = Field(200, ge=1, description="steps between held-out tau_sim evaluations (and best/ updates)")
    eval_samples: Int = Field(64, ge=1, description="held-out sequences for the tau_sim evaluation")
    eval_anchors_per_seq: Int = Field(512, ge=1, description="anchors per held-out sequence for tau_sim (default: "
                                      "about every answer position), apart from training's: a few random anchors "
                                      "make tau_sim too noisy to pick the best step by")
    save_every: Int = Field(500, ge=1, description="steps between resumable checkpoints (also at the end, and on SIGTERM / SIGINT)")
    keep_last: Int = Field(2, ge=1, description="step checkpoints kept (the best one is kept apart)")
    async_save: Bool = Field(True, description="sharded checkpoints (several ranks): training goes on while the "
                             "shards are written, the loop stalling only to copy its state to host memory (one copy "
                             "of each rank's weights and AdamW moments, kept in host memory)")
    seed: Seed = 0
    log_every: Int = Field(10, ge=1, description="steps between metrics.jsonl records")
    tensorboard: Bool = Field(True, description="TensorBoard events in output_dir/tb")
    wandb_project: str | None = Field(None, description="log to Weights & Biases too (needs `wandb` installed)")


class EvalConfig(_Section):
    prompts: str | None = Field(None, description="one prompt set instead of the suites (same sources as data.prompts)")
    suites: list[str] = Field(default_factory=lambda: ["humaneval", "code", "math", "chat", "multiturn"],
                              description="evaluation suites reported side by side when `prompts` is None")
    limit: Int | None = Field(None, ge=1, description="at most this many prompts per suite (or of `prompts`)")
    max_new_tokens: Int = Field(128, ge=1, description="answer length for `prompts` (each suite has its own)")
    temperature: Float = Field(0.0, ge=0.0, description="online sampling temperature (0: greedy) on a CPU, or when "
                               "`eval --temperature` is not given and the target is not on a GPU")
    temperatures: list[Annotated[Float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [0.0, 0.7], min_length=1,
        description="on a GPU, without `eval --temperature`: one evaluation per temperature, the first reported in "
                    "--out, each other in --out/T<temperature> (greedy τ, then sampled τ under each --acceptance rule)")
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    ddtree_budgets: list[Int] = Field(default_factory=lambda: [8, 16, 32, 64], description="DDTree node budgets evaluated")
    ddtree_top_k: Int | None = Field(TOP_K, ge=1, description="DDTree's candidates per slot (None: the node budget)")
    seed: Seed = 0


class Config(_Section):
    target: TargetConfig = TargetConfig()
    drafter: DrafterSettings = DrafterSettings()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()


class ConfigError(ValueError):
    """Invalid configuration; the message names each field and what was expected."""


def _format(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown field '{where}'")
        else:
            got = e.get("input")
            lines.append(f"{source}: field '{where}': {e['msg']} (got {got!r})")
    return "\n".join(lines)


def apply_override(tree: dict[str, Any], override: str) -> None:
    """`a.b=value` -> tree['a']['b'] = yaml(value)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected section.field=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override '{override}': expected section.field=value (e.g. train.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{override}': value is not valid YAML ({e})") from None
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{p}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (invalid UTF-8); expected a YAML config") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: expected a mapping of sections (target, drafter, data, train, eval)")
    for o in overrides:
        apply_override(tree, o)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format(e, source if not overrides else f"{source} + overrides")) from None


def _choices(annotation: Any) -> list[str]:
    """The values a Literal field (possibly optional) takes."""
    if get_origin(annotation) is Literal:
        return [str(a) for a in get_args(annotation)]
    return [c for a in get_args(annotation) for c in _choices(a)]


def dump_config(cfg: Config, comments: bool = False) -> str:
    """The config as YAML that `load_config` reads back; `comments`: each field's meaning (and a
    Literal field's choices) as a comment on its line."""
    if not comments:
        return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
    lines = []
    for section in Config.model_fields:
        lines.append(f"{section}:")
        sub = getattr(cfg, section)
        for name, field in type(sub).model_fields.items():
            value = getattr(sub, name)
            line = (f"{name}: " + yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, list)
                    else yaml.safe_dump({name: value}).strip())
            note = [field.description] if field.description else []
            if choices := _choices(field.annotation):
                note.append("values: " + ", ".join(choices))
            lines.append(f"  {line}" + (f"  # {'; '.join(note)}" if note else ""))
    return "\n".join(lines) + "\n"
