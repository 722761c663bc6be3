"""`dflashkit check-features`: compare two feature sources layer by layer (docs/conventions.md, mistake 7).

A source is a feature cache directory (`dflashkit extract` output) or the target itself
(`target`, or `target:device=cuda,dtype=bfloat16,path=...`): two back-ends, devices, dtypes, a
cache against a recompute, or bf16 against fp8. `runner=static` takes the features from the
decoding engine's own layers instead of Transformers' forward: `target:runner=static target`
checks that serving sees what training saw (for hybrids: the PyTorch delta rule against the
installed GPU kernels). Per tapped layer: cosine similarity between the
two feature vectors of each token (mean and min over tokens), max absolute error, and that error
relative to the largest reference value.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.checkpoint import atomic_write_json


@dataclass
class LayerReport:
    layer: int
    tokens: int
    cosine_mean: float
    cosine_min: float
    max_abs_err: float
    max_rel_err: float  # max_abs_err / max |reference|


class Comparison:
    """Accumulates per-layer statistics over samples; `a` is the reference."""

    def __init__(self, layer_ids: list[int]) -> None:
        n = len(layer_ids)
        self.layer_ids = list(layer_ids)
        self.tokens = 0
        self.cos_sum = torch.zeros(n, dtype=torch.float64)
        self.cos_min = torch.full((n,), float("inf"), dtype=torch.float64)
        self.err = torch.zeros(n, dtype=torch.float64)
        self.ref = torch.zeros(n, dtype=torch.float64)

    def add(self, a: Tensor, b: Tensor) -> None:
        """a, b: [T, n_taps * H] features of the same tokens."""
        if a.shape != b.shape:
            raise ValueError(f"feature shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
        T, n = a.shape[0], len(self.layer_ids)
        a, b = a.double().reshape(T, n, -1), b.double().reshape(T, n, -1)
        cos = F.cosine_similarity(a, b, dim=-1)  # [T, n]
        self.tokens += T
        self.cos_sum += cos.sum(0)
        self.cos_min = torch.minimum(self.cos_min, cos.amin(0))
        self.err = torch.maximum(self.err, (a - b).abs().amax((0, 2)))
        self.ref = torch.maximum(self.ref, a.abs().amax((0, 2)))

    def report(self) -> list[LayerReport]:
        return [LayerReport(layer=l, tokens=self.tokens, cosine_mean=float(self.cos_sum[j] / max(self.tokens, 1)),
                            cosine_min=float(self.cos_min[j]), max_abs_err=float(self.err[j]),
                            max_rel_err=float(self.err[j] / self.ref[j]) if self.ref[j] else 0.0)
                for j, l in enumerate(self.layer_ids)]


def format_report(rows: list[LayerReport]) -> str:
    lines = [f"{'layer':>5} {'tokens':>8} {'cos mean':>10} {'cos min':>10} {'max abs err':>12} {'max rel err':>12}"]
    lines += [f"{r.layer:>5} {r.tokens:>8} {r.cosine_mean:>10.6f} {r.cosine_min:>10.6f} {r.max_abs_err:>12.4g} "
              f"{r.max_rel_err:>12.3g}" for r in rows]
    return "\n".join(lines)


# ---- sources ----------------------------------------------------------------------------------------


class CacheSource:
    def __init__(self, path: str) -> None:
        from dflashkit.data.features import FeatureCache

        self.name, self.cache = path, FeatureCache(path)
        self.layer_ids = self.cache.layer_ids
        self.index = {sid: i for i, sid in enumerate(self.cache.ids)}

    def samples(self, limit: int) -> list[tuple[str, list[int]]]:
        return [(s.id, s.input_ids.tolist()) for s in (self.cache[i] for i in range(min(limit, len(self.cache))))]

    def features(self, sid: str, input_ids: list[int]) -> Tensor:
        if sid not in self.index:
            raise ValueError(f"{self.name}: has no sample {sid!r}")
        s = self.cache[self.index[sid]]
        if s.input_ids.tolist() != input_ids:
            raise ValueError(f"{self.name}: sample {sid!r} has other tokens than the reference's; compare caches of the same data")
        return s.features


class TargetSource:
    """Features recomputed by a target loaded with this source's options (over the config's)."""

    def __init__(self, spec: str, target_cfg: Any) -> None:
        from dflashkit.commands import resolve_device
        from dflashkit.target import load_target

        opts = dict(kv.split("=", 1) for kv in spec.split(":", 1)[1].split(",") if kv) if ":" in spec else {}
        unknown = set(opts) - {"path", "gguf_file", "device", "dtype", "runner"}
        if spec.split(":", 1)[0] != "target" or unknown or opts.get("runner", "hf") not in ("hf", "static"):
            raise ValueError(f"source {spec!r}: expected a feature cache directory or "
                             "'target[:path=..,gguf_file=..,device=..,dtype=..,runner=hf|static]'")
        self.name, self.runner = spec, opts.get("runner", "hf")
        self.target = load_target(opts.get("path", target_cfg.path), gguf_file=opts.get("gguf_file", target_cfg.gguf_file),
                                  dtype=opts.get("dtype", target_cfg.dtype),
                                  device=resolve_device(opts.get("device", target_cfg.device)))
        self.layer_ids: list[int] = []

    def features(self, sid: str, input_ids: list[int]) -> Tensor:
        """runner=hf: Transformers' forward (what extraction and training see, with whatever kernels
        are installed); runner=static: the decoding runner's own layers (what serving sees)."""
        from dflashkit.data.features import online_features
        from dflashkit.decode.static import runner_features

        ids = torch.tensor([input_ids], device=self.target.device)
        if self.runner == "hf":
            return online_features(self.target, ids, self.layer_ids)[0].float().cpu()
        return runner_features(self.target, ids[0], self.layer_ids).float().cpu()


def compare_sources(a: Any, b: Any, samples: list[tuple[str, list[int]]], layer_ids: list[int]) -> list[LayerReport]:
    from dflashkit.progress import progress

    cmp = Comparison(layer_ids)
    for sid, ids in progress(samples, desc="check-features", unit="sample"):
        cmp.add(a.features(sid, ids).float(), b.features(sid, ids).float())
    return cmp.report()


# ---- CLI ----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options, cosine, positive_int

    p.add_argument("a", help="reference source: a feature cache directory, or 'target[:device=..,dtype=..,path=..]'")
    p.add_argument("b", help="source to compare (same forms)")
    p.add_argument("--input", metavar="JSONL", help="tokenized samples when neither source is a cache (default: data.tokenized)")
    p.add_argument("--limit", type=positive_int, default=32, help="samples to compare (default 32)")
    p.add_argument("--min-cosine", type=cosine, default=0.999, help="fail (exit 1) when a layer's mean cosine is below this")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    add_config_options(p)


def is_report(path: Path) -> bool:
    """Whether `path` is an earlier --json report (or an empty file), which a run may replace."""
    try:
        raw = json.loads(path.read_bytes() or b"{}") if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return raw == {} or (isinstance(raw, dict) and {"a", "b", "layers"} <= raw.keys())


def run(args: argparse.Namespace) -> int:
    from dflashkit.rundir import output_path

    if not args.json:
        return compare_and_report(args)
    # Locked and checked before the sources load: the report replaces only an earlier report.
    with output_path(args.json, "check-features", is_report, "a check-features report (JSON with a, b, layers)"):
        return compare_and_report(args)


def compare_and_report(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args
    from dflashkit.drafter import default_target_layer_ids

    cfg = config_from_args(args)
    sources = [TargetSource(s, cfg.target) if s.startswith("target") else CacheSource(s) for s in (args.a, args.b)]
    caches = [s for s in sources if isinstance(s, CacheSource)]
    if caches:  # the caches decide the layers and the samples
        layer_ids, samples = caches[0].layer_ids, caches[0].samples(args.limit)
        if len(caches) == 2 and caches[1].layer_ids != layer_ids:
            raise ValueError(f"the caches hold different layers: {layer_ids} vs {caches[1].layer_ids}")
    else:
        from dflashkit.data.chat import load_tokenized

        src = args.input or cfg.data.tokenized
        if not src:
            raise ValueError("two target sources need samples: --input JSONL or data.tokenized=PATH")
        samples = [(s.id, s.input_ids) for s in load_tokenized(src)[:args.limit]]
        layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(sources[0].target.num_layers,
                                                                             cfg.drafter.num_taps)
    for s in sources:
        if isinstance(s, TargetSource):
            s.layer_ids = layer_ids
    rows = compare_sources(sources[0], sources[1], samples, layer_ids)
    print(f"{args.a}  vs  {args.b}  ({len(samples)} samples)")
    print(format_report(rows))
    if args.json:
        atomic_write_json(Path(args.json), {"a": args.a, "b": args.b, "samples": len(samples),
                                            "layers": [asdict(r) for r in rows]})
    bad = [r.layer for r in rows if r.cosine_mean < args.min_cosine]
    if bad:
        print(f"layers {bad}: mean cosine below {args.min_cosine}")
        return 1
    return 0
