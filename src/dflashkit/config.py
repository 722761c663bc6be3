"""One typed configuration for every stage, validated once at the edge.

Defaults are the recipe of SPEC.md. Load from YAML, override from the command line with
`section.field=value` (the value is parsed as YAML: `train.lr=3e-4`, `drafter.layer_types=[...]`).
A wrong field gives one line naming it and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(_Section):
    path: str | None = Field(None, description="local dir, hub id, or .gguf file; None = embedded SmolLM2 default")
    gguf_file: str | None = Field(None, description="GGUF file name inside `path`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1'...")


class DrafterSettings(_Section):
    num_layers: int = Field(5, ge=1)
    num_taps: int = Field(5, ge=1)
    target_layer_ids: list[int] | None = Field(None, description="None = SPEC default formula")
    block_size: int = Field(16, ge=2)
    mask_token_id: int | None = Field(None, ge=0, description="None = SPEC rule (spare row / mask / unused special)")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: int | None = Field(None, ge=1)
    init_from: str | None = Field(None, description="start from this reference-format drafter directory")

    @model_validator(mode="after")
    def _sliding_needs_window(self) -> "DrafterSettings":
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window must be set when a layer is 'sliding_attention'")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != self.num_taps:
            raise ValueError(f"target_layer_ids has {len(self.target_layer_ids)} entries, num_taps is {self.num_taps}")
        return self


class DataConfig(_Section):
    prompts: str = Field("builtin", description="'builtin', 'humaneval', a JSONL/JSON/Parquet file or a datasets name")
    limit: int | None = Field(None, ge=1)
    regenerated: str | None = Field(None, description="JSONL of target-written answers (output of `regenerate`)")
    tokenized: str | None = Field(None, description="JSONL of token ids + loss masks (output of `tokenize`)")
    features: str | None = Field(None, description="feature cache dir (output of `extract`); None = online")
    feature_dtype: Literal["bfloat16", "float16", "float32", "fp8"] = "bfloat16"
    max_length: int = Field(2048, ge=8)
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    thinking: bool = Field(False, description="passed to the chat template as enable_thinking")
    batch_size: int = Field(8, ge=1)
    seed: int = Field(0, description="sampling seed of `regenerate` when temperature > 0")


class TrainConfig(_Section):
    output_dir: str = "runs/train"
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    batch_size: int = Field(16, ge=1, description="sequences per optimiser step (global)")
    micro_batch_size: int = Field(1, ge=1, description="sequences per forward pass and process")
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="overrides epochs")
    time_budget_s: float | None = Field(None, gt=0, description="wall-clock budget from the start of `train`; "
                                        "overrides epochs (max_steps still caps): the schedule is fitted to the "
                                        "steps that fit, timed over the first steps")
    anchors_per_seq: int = Field(512, ge=1)
    loss: Literal["ce", "kl", "dpace"] = "ce"
    gamma: float | None = Field(None, gt=0, description="slot decay; None = 7 (B=16), 5 (B=10), 4 (B=8)")
    kl_weight: float = Field(1.0, ge=0, le=1, description="share of KL in the 'kl' loss; rest is hard CE")
    kl_temperature: float = Field(1.0, gt=0)
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="confidence smoothing of the 'dpace' loss")
    feature_noise: float = Field(0.0, ge=0, description="std of Gaussian noise on fc inputs only")
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    compile: bool | None = Field(None, description="torch.compile the drafter layers; None = on CUDA")
    parallel: Literal["auto", "ddp", "fsdp"] = Field("auto", description="under torchrun: DDP (auto) or FSDP2")
    eval_every: int = Field(200, ge=1)
    eval_samples: int = Field(64, ge=1, description="held-out sequences for the tau_sim evaluation")
    save_every: int = Field(500, ge=1)
    keep_last: int = Field(2, ge=1, description="step checkpoints kept (the best one is kept apart)")
    seed: int = 0
    log_every: int = Field(10, ge=1)
    tensorboard: bool = True
    wandb_project: str | None = Field(None, description="log to Weights & Biases too (needs `wandb` installed)")


class EvalConfig(_Section):
    prompts: str | None = Field(None, description="one prompt set instead of the suites (same sources as data.prompts)")
    suites: list[str] = Field(default_factory=lambda: ["humaneval", "code", "math", "chat", "multiturn"],
                              description="evaluation suites reported side by side when `prompts` is None")
    limit: int | None = Field(None, ge=1, description="at most this many prompts per suite (or of `prompts`)")
    max_new_tokens: int = Field(128, ge=1, description="answer length for `prompts` (each suite has its own)")
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    ddtree_budgets: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    ddtree_top_k: int = Field(4, ge=1)
    seed: int = 0


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
            tree = yaml.safe_load(p.read_text()) or {}
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


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
