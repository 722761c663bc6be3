"""`dflashkit train`: the DFlash recipe on one process, on many (torchrun: DDP or FSDP2), resumable.

* Data: token ids + loss masks (`data.tokenized`, features computed online by the target in this
  process) or an offline feature cache (`data.features`). A held-out slice (`train.eval_samples`)
  never trains; every `eval_every` steps it gives per-slot accuracy and the simulated acceptance
  length tau_sim (1 + leading slots whose argmax equals the data's token), and the best
  checkpoint by tau_sim is kept in `<output_dir>/best`.
* Order: optimiser step `s` consumes sequences `[s * batch_size, (s + 1) * batch_size)` of a
  seeded stream (one permutation per epoch); rank `r` takes a contiguous share. Anchors and
  noise of a sequence are drawn from generators seeded by its stream position. So a run is the
  same function of the config on any number of processes, and resuming needs only the step.
* Loss normalisation: each micro-batch back-propagates its *sum* of weighted slot losses; the
  gradients are divided by the global sum of weights (all micro-batches, all ranks) before
  clipping. That is exactly the single-process loss, also for D-PACE whose weights are only known
  after the forward pass.
* Precision: on GPU the drafter runs in bf16; the optimiser steps fp32 master weights with fp32
  AdamW state (FSDP2: fp32 shards, bf16 compute through its mixed-precision policy).
* Checkpoints: the reference format plus `training_state.pt` (fp32 weights, optimiser, scheduler,
  RNG, step, best tau), full tensors keyed by name, so any number of processes can resume them;
  written to a temporary directory and renamed, then `latest.json` is replaced atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils import get_total_norm

from dflashkit.checkpoint import (CONFIG, SHARDED_STATE, TRAINING_STATE, WEIGHTS, atomic_save, atomic_write_bytes,
                                  atomic_write_json, complete_lines, load_config, load_drafter, sha256_file,
                                  load_training_state, save_drafter, target_problems, temp_path, torch_save,
                                  writing)
from dflashkit import versions
from dflashkit.config import TrainConfig, dump_config
from dflashkit.drafter import DFlashDrafter, DrafterConfig, grow, upgraded
from dflashkit import shardstate
from dflashkit.jobgroup import Heartbeat, join_job, joined
from dflashkit.optim import HostAdamW
from dflashkit.objective import (CALIBRATION_BINS, LossSettings, MicroBatch, add_feature_noise, anchor_runs,
                                 block_loss, calibration_report, check_label_sources, family_metrics, family_sums,
                                 micro_batch, pad_anchors, replay_rounds, sample_anchors)
from dflashkit.progress import progress
from dflashkit.rundir import output_directory, replace_dir

log = logging.getLogger(__name__)

STATE_VERSION = 1
SEQ_MULTIPLE = 64  # sequences are right-padded to a multiple of this (fewer distinct shapes to compile)
ANCHOR_MULTIPLE = 8  # anchors per sequence padded to a multiple of this (B=16: 128 queries, one flex tile)
# Micro-batches built before a step's first is trained when the optimiser's state is on the host: their
# target forwards cover the last update's streaming (0.65 s a step at the 27B shape, 0.24 s a forward).
UPDATE_AHEAD = 3


# ---- processes -----------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(cuda: bool, timeout_s: float = TrainConfig.model_fields["dist_timeout"].default) -> Dist:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK (one node or many: its rendezvous does the rest);
    a collective that waits `timeout_s` seconds fails, so that torchrun can restart the job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    d = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if cuda:
        torch.cuda.set_device(d.local_rank)
    join_job("nccl" if cuda else "gloo", timeout_s)
    return d


def _all_sum(t: Tensor, d: Dist) -> Tensor:
    if d.world > 1:
        dist.all_reduce(t)
    return t


def _generator(seed: int, *keys: Any, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator that depends only on (seed, keys): the same on every rank and after a resume."""
    h = int.from_bytes(hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest(), "little")
    g = torch.Generator(device=device)
    g.manual_seed(h & ((1 << 63) - 1))
    return g


# ---- data ----------------------------------------------------------------------------------


def load_training_data(data_cfg, target: Any, dtype: torch.dtype) -> tuple[Sequence[Any], list[int] | None]:
    """(samples, layer ids of cached features or None for online features)."""
    if data_cfg.features:
        from dflashkit.data.features import FeatureCache

        cache = FeatureCache(data_cfg.features, dtype=dtype)
        problems = cache.target_problems(target)
        if problems:
            raise ValueError("; ".join(problems) + " (features of another target would train a useless drafter)")
        return cache, list(cache.layer_ids)
    if data_cfg.tokenized:
        from dflashkit.data.chat import load_tokenized

        return load_tokenized(data_cfg.tokenized), None
    raise ValueError("train needs data: set data.tokenized=PATH (features computed online by the target) "
                     "or data.features=DIR (offline cache from `dflashkit extract`)")


def sample_group(sample_id: str) -> str:
    """The suite label carried by a sample id: the id without its trailing number
    ('builtin-math-00017' -> 'builtin-math', 'HumanEval/3' -> 'HumanEval')."""
    return re.sub(r"[-_:/]?\d+$", "", sample_id) or sample_id


def split_eval(n: int, eval_samples: int, seed: int, ids: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): at most a fifth of the data is held out. When the ids
    carry suite labels (2 to `n_eval` distinct `sample_group`s), the held-out samples are drawn
    from every suite in turn, as evaluation reports them suite by suite."""
    n_eval = min(eval_samples, n // 5)
    perm = torch.randperm(n, generator=_generator(seed, "split")).tolist()
    groups = None if ids is None else [sample_group(i) for i in ids]
    if groups is not None and 2 <= len(set(groups)) <= n_eval:
        by_group: dict[str, list[int]] = {}
        for i in perm:
            by_group.setdefault(groups[i], []).append(i)
        # round-robin over the suites (in order of first appearance in the permutation)
        perm = [i for rank in zip_longest(*by_group.values()) for i in rank if i is not None]
    held = sorted(perm[:n_eval])
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], held


def sample_ids(samples: Sequence[Any]) -> list[str]:
    """Every sample's id; a feature cache lists them without reading features."""
    return list(samples.ids) if hasattr(samples, "ids") else [s.id for s in samples]


def held_out_groups(ids: Sequence[str], eval_idx: list[int]) -> dict[str, list[int]]:
    """Held-out indices by suite label, when there are several suites; else {}."""
    out: dict[str, list[int]] = {}
    for i in eval_idx:
        out.setdefault(sample_group(ids[i]), []).append(i)
    return out if len(out) > 1 else {}


class Batcher:
    """Sequences -> `MicroBatch`es on the device: padding, anchors, features (cached or from the
    target), the split of the fc input from the KL target, and noise on the fc input only."""

    def __init__(self, samples: Sequence[Any], feature_layer_ids: list[int] | None, target: Any,
                 cfg: DrafterConfig, tcfg, max_length: int, device: torch.device, dtype: torch.dtype) -> None:
        self.samples, self.target, self.cfg, self.tcfg = samples, target, cfg, tcfg
        self.max_length, self.device, self.dtype = max_length, device, dtype
        # The target's final hidden state: the KL loss's target, and a confidence head's (Σ min(p, q)).
        self.need_final = tcfg.loss == "kl" or cfg.enable_confidence_head
        last = cfg.num_target_layers - 1
        wanted = list(cfg.target_layer_ids) + ([last] if self.need_final else [])
        if feature_layer_ids is None:  # online: ask the target for exactly these layers, in this order
            self.online_layers: list[int] | None = wanted
            source = wanted
        else:
            missing = [i for i in wanted if i not in feature_layer_ids]
            if missing:
                use = "train.loss='kl'" if tcfg.loss == "kl" else "the confidence head"
                why = f" (layer {last} = the target's final hidden state, for {use})" if last in missing else ""
                raise ValueError(f"data.features holds target layers {feature_layer_ids}, but layers {missing} are "
                                 f"needed{why}; re-extract with those layers or train online")
            self.online_layers = None
            source = list(feature_layer_ids)
        H = cfg.hidden_size
        cols = lambda i: torch.arange(source.index(i) * H, (source.index(i) + 1) * H)  # noqa: E731
        self.tap_cols = torch.cat([cols(i) for i in cfg.target_layer_ids])
        self.final_cols = cols(last) if self.need_final else None

    def sample(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        s = self.samples[i]
        sid = getattr(s, "id", i)
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)[: self.max_length]
        mask = torch.as_tensor(s.loss_mask).bool()[: self.max_length]
        if ids.shape != mask.shape or ids.ndim != 1:
            raise ValueError(f"sample {sid}: input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} must be equal 1-d")
        if len(ids) and int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"sample {sid}: token id {int(ids.max())} is outside the target's vocabulary ({self.cfg.vocab_size})")
        feats = getattr(s, "features", None)
        if feats is not None:
            feats = feats[: self.max_length]
            if feats.shape[0] != len(ids):
                raise ValueError(f"sample {sid}: {feats.shape[0]} feature rows for {len(ids)} tokens")
        return ids, mask, feats

    @torch.no_grad()
    def build(self, items: list[tuple[Any, int]], held_out: bool = False) -> MicroBatch:
        """items: (key, sample index); `key` (the stream position, or ('eval', i)) seeds anchors and noise.
        held_out: for the τ_sim evaluation: clean features (the drafter is served on them) and
        `eval_anchors_per_seq` anchors per sequence."""
        seqs = [self.sample(i) for _, i in items]
        T = max(len(s[0]) for s in seqs)
        T = -(-T // SEQ_MULTIPLE) * SEQ_MULTIPLE
        b = len(seqs)
        ids = torch.zeros(b, T, dtype=torch.long)
        loss_mask = torch.zeros(b, T, dtype=torch.bool)
        valid = torch.zeros(b, T, dtype=torch.bool)
        for j, (x, m, _) in enumerate(seqs):
            ids[j, : len(x)], loss_mask[j, : len(x)], valid[j, : len(x)] = x, m, True
        seed = self.tcfg.seed
        n_anchors = self.tcfg.eval_anchors_per_seq if held_out else self.tcfg.anchors_per_seq
        anchors, anchor_valid = pad_anchors(
            [sample_anchors(m, n_anchors, _generator(seed, "anchors", k)) for (k, _), (_, m, _) in zip(items, seqs)],
            multiple=ANCHOR_MULTIPLE)
        if self.online_layers is not None:
            from dflashkit.data.features import online_features

            dev_ids = ids.pin_memory() if self.device.type == "cuda" else ids
            feats = online_features(self.target, dev_ids.to(self.device, non_blocking=True), self.online_layers)
        else:
            feats = torch.zeros(b, T, seqs[0][2].shape[-1], dtype=seqs[0][2].dtype)
            for j, (x, _, f) in enumerate(seqs):
                feats[j, : len(x)] = f
            feats = feats.to(self.device, non_blocking=True)
        # The KL target is split off *before* any noise: noise reaches the fc input only.
        final = feats[..., self.final_cols.to(feats.device)] if self.need_final else None
        taps = feats[..., self.tap_cols.to(feats.device)]
        if not held_out and self.tcfg.feature_noise > 0:
            for j, ((k, _), (x, _, _)) in enumerate(zip(items, seqs)):
                g = _generator(seed, "noise", k, device=taps.device)
                taps[j, : len(x)] = add_feature_noise(taps[j, : len(x)], self.tcfg.feature_noise, g)
        mb = micro_batch(ids, loss_mask, valid, taps, anchors, anchor_valid, self.cfg.block_size, final,
                         self.cfg.sample_from_anchor)
        return mb.to(self.device, self.dtype)


def step_items(step: int, batch_size: int, micro: int, d: Dist, train_idx: list[int], seed: int) -> list[list[tuple[int, int]]]:
    """This rank's micro-batches of optimiser step `step`: lists of (stream position, sample index)."""
    if batch_size % d.world:
        raise ValueError(f"train.batch_size={batch_size} must be a multiple of the number of processes ({d.world})")
    local = batch_size // d.world
    n = len(train_idx)
    first = step * batch_size + d.rank * local
    items = []
    for p in range(first, first + local):
        epoch, off = divmod(p, n)
        items.append((p, train_idx[_epoch_order(n, seed, epoch)[off]]))
    return [items[i: i + micro] for i in range(0, local, micro)]


_ORDER_CACHE: dict[tuple[int, int, int], list[int]] = {}


def built_ahead(build: Callable[[Any], MicroBatch], groups: list[Any], first: int) -> Iterator[MicroBatch]:
    """build(group) for each group, lazily, but the first `first` all built before the first is
    trained: with the optimiser's state on the host, their target forwards run while the last
    step's update streams (`HostAdamW.step`)."""
    made = deque(build(g) for g in groups[:first])
    while made:
        yield made.popleft()
    for g in groups[first:]:
        yield build(g)


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE.clear()
        _ORDER_CACHE[key] = torch.randperm(n, generator=_generator(seed, "epoch", epoch)).tolist()
    return _ORDER_CACHE[key]


def eval_items(eval_idx: list[int], micro: int, d: Dist) -> list[tuple[list[tuple[Any, int]], bool]]:
    """This rank's held-out micro-batches, each flagged `counted`. Every rank runs the same number
    of forward passes (FSDP needs it): short ranks repeat a sample that is not counted."""
    mine = eval_idx[d.rank:: d.world]
    n_batches = -(-math.ceil(len(eval_idx) / d.world) // micro)
    out = []
    for j in range(n_batches):
        chunk = mine[j * micro: (j + 1) * micro]
        out.append(([(("eval", i), i) for i in chunk], True) if chunk else ([(("eval", eval_idx[0]), eval_idx[0])], False))
    return out


# ---- the optimisation core -------------------------------------------------------------------


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine to zero at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """Wraps the drafter (compile, DDP / FSDP2), owns fp32 master weights, AdamW and the schedule.
    Knows nothing of files or data order: `step` takes micro-batches, `state_dict` is full tensors."""

    def __init__(self, drafter: DFlashDrafter, embed: Callable[[Tensor], Tensor], head_weight: Tensor, tcfg,
                 total_steps: int, *, device: torch.device, dtype: torch.dtype, d: Dist = Dist(),
                 backend: str = "sdpa", compile: bool = False) -> None:
        self.cfg = drafter.config
        self.embed, self.d, self.backend = embed, d, backend
        self.head_weight = head_weight.detach().to(device=device, dtype=dtype)
        self.settings = LossSettings.from_config(tcfg, self.cfg.block_size)
        self.grad_clip = tcfg.grad_clip
        self.parallel = "none" if d.world == 1 else ("ddp" if tcfg.parallel == "auto" else tcfg.parallel)
        self.names = [n for n, _ in drafter.named_parameters()]
        cuda = torch.device(device).type == "cuda"
        if self.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            drafter.to(device=device, dtype=torch.float32)
            self._compile(drafter, compile)
            mesh = init_device_mesh(torch.device(device).type, (d.world,))
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            # The family's heads run after the drafter's forward (on the LM head's candidates): each its
            # own unit, gathered by its own forward.
            heads = [m for m in (drafter.selector(), drafter.markov(), drafter.confidence()) if m is not None]
            for layer in [*drafter.layers, *heads]:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            self.model = fully_shard(drafter, mesh=mesh, mp_policy=mp)
            self.params = list(drafter.parameters())
            self.master = self.params  # fp32 shards, cast to `dtype` for compute by FSDP
        else:
            drafter.to(device=device, dtype=dtype)
            self._compile(drafter, compile)
            self.model = drafter
            if self.parallel == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                self.model = DistributedDataParallel(drafter, device_ids=[device] if cuda else None)
                self.model.config = drafter.config  # training_hidden reads the drafter's config
            self.params = list(drafter.parameters())
        self.host_state = tcfg.optimizer_state == "host"
        if self.host_state:
            if self.parallel == "fsdp":
                raise ValueError("train.optimizer_state='host' keeps a whole fp32 copy per process: use it with one "
                                 "process or DDP (under FSDP2 the optimiser state is already sharded over the ranks)")
            self.optimizer: torch.optim.Optimizer = HostAdamW(self.params, lr=tcfg.lr, weight_decay=tcfg.weight_decay)
            self.master = self.optimizer.master
        else:
            if self.parallel != "fsdp":
                self.master = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
            self.optimizer = torch.optim.AdamW(self.master, lr=tcfg.lr, weight_decay=tcfg.weight_decay,
                                               fused=cuda and self.parallel != "fsdp")
        self.warmup_ratio = tcfg.warmup_ratio
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._schedule(total_steps))

    def _schedule(self, total: int) -> Callable[[int], float]:
        warmup = max(1, round(self.warmup_ratio * total)) if self.warmup_ratio > 0 else 0
        return lambda s: lr_factor(s, total, warmup)

    def set_total_steps(self, total: int) -> None:
        """Refit the schedule (time-budgeted runs): valid while still inside the warm-up."""
        self.scheduler.lr_lambdas = [self._schedule(total)]

    @staticmethod
    def _compile(drafter: DFlashDrafter, enabled: bool) -> None:
        if enabled:  # per layer, in place: parameter names stay the reference names
            # A few graphs are expected (grad / no-grad, first layer's input without grad, dynamic
            # shapes); past the default limit dynamo would silently run eager FlexAttention.
            dc = torch._dynamo.config
            key = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"  # torch < 2.6
            setattr(dc, key, max(getattr(dc, key), 64))
            for layer in drafter.layers:
                layer.compile()

    def _sync(self, last: bool):
        """Gradients are reduced across ranks on the last micro-batch only."""
        if self.parallel == "ddp" and not last:
            return self.model.no_sync()
        if self.parallel == "fsdp":
            self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def _forward(self, mb: MicroBatch):
        if self.host_state:  # the last update may still be writing the weights (`HostAdamW.step`)
            self.optimizer.wait()
        return block_loss(self.model, self.embed, self.head_weight, mb, self.settings, self.backend)

    def step(self, batches: Iterable[MicroBatch], n: int) -> dict[str, float]:
        """One optimiser step over `n` micro-batches (this rank's share of the global batch)."""
        return self.update(self.accumulate(batches, n))

    def accumulate(self, batches: Iterable[MicroBatch], n: int) -> Tensor:
        """Forward + backward of each micro-batch, gradients summed; -> the step's statistics
        [loss sum, weight sum, per-slot correct, per-slot count, blocks], on the device."""
        self.model.train()
        B, extra = self.cfg.block_size, family_sums(self.cfg)
        acc = torch.zeros(3 + 2 * B + len(extra), dtype=torch.float64, device=self.head_weight.device)
        for i, mb in enumerate(batches):
            with self._sync(i == n - 1):
                out = self._forward(mb)
                out.loss_sum.backward()
            acc += torch.cat([out.loss_sum.detach()[None], out.weight_sum[None], out.slot_correct, out.slot_count,
                              out.block_valid.sum()[None], *(out.extra[k][None] for k in extra)]).double()
        return acc

    def update(self, acc: Tensor) -> dict[str, float]:
        """The optimiser step on the accumulated gradients: normalise by the global weight sum,
        clip, AdamW, schedule."""
        B = self.cfg.block_size
        _all_sum(acc, self.d)
        loss_sum, weight_sum = acc[0], acc[1]
        has_labels = bool(weight_sum > 0)
        # Each rank back-propagated its sum; DDP/FSDP averaged over ranks: x world / global weight sum.
        scale = self.d.world / float(weight_sum) if has_labels else 0.0
        gnorm = self._host_update(scale, has_labels) if self.host_state else self._device_update(scale, has_labels)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        correct, count = acc[2: 2 + B], acc[2 + B: 2 + 2 * B]
        names = family_sums(self.cfg)
        first = int(not self.cfg.sample_from_anchor)
        return {"loss": float(loss_sum / weight_sum) if has_labels else float("nan"),
                "acc": float(correct[first:].sum() / count[first:].sum().clamp(min=1)),
                "grad_norm": float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
                "lr": lr, "block_tokens": float(acc[2 + 2 * B]) * B,
                **family_metrics(self.cfg, dict(zip(names, acc[3 + 2 * B:].tolist())))}

    def _device_update(self, scale: float, has_labels: bool) -> Tensor:
        grads = []
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                continue
            if m is not p:
                m.grad = p.grad.float()
                p.grad = None
            grads.append(m.grad)
        if grads:
            torch._foreach_mul_(grads, scale)
        gnorm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip)
        if has_labels:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._master_to_model()
        return gnorm

    def _host_update(self, scale: float, has_labels: bool) -> Tensor:
        """`_device_update`'s arithmetic with the fp32 gradients made one parameter at a time (the
        master weights and moments stream through the device in `HostAdamW`)."""
        def fp32_grad(i: int) -> Tensor:
            g = self.params[i].grad.to(torch.float32, copy=True)
            torch._foreach_mul_([g], scale)
            return g

        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        norms = [get_total_norm([fp32_grad(i)]) for i in have]  # clip_grad_norm_'s per-tensor norms
        gnorm = get_total_norm(norms) if norms else torch.zeros(())
        coef = torch.clamp(self.grad_clip / (gnorm + 1e-6), max=1.0)

        def clipped(i: int) -> Tensor:
            g = fp32_grad(i)
            torch._foreach_mul_([g], coef)
            return g

        if has_labels and have:
            self.optimizer.step(grads=clipped, reads=[coef, *(self.params[i].grad for i in have)])
        for p in self.params:
            p.grad = None
        return gnorm

    @torch.no_grad()
    def _master_to_model(self) -> None:
        pairs = [(p, m) for p, m in zip(self.params, self.master) if m is not p]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[MicroBatch, bool]]) -> dict[str, Any]:
        """Held-out loss, per-slot accuracy, tau_sim (the mean acceptance length over anchors),
        tau_rounds (decoding rounds replayed over the anchors, as online decoding averages them;
        exact when every answer position is an anchor) and the histogram of acceptance lengths."""
        self.model.eval()
        B, cfg = self.cfg.block_size, self.cfg
        dev = self.head_weight.device
        names = family_sums(cfg)
        L = len(cfg.draft_slots) + 2  # τ = 1 + accepted drafts: 1 .. len(draft_slots) + 1
        calib = CALIBRATION_BINS * 4 if cfg.enable_confidence_head else 0
        acc = torch.zeros(2 + 2 * B + L + len(names) + calib, dtype=torch.float64, device=dev)
        replayed = [0, 0]  # tokens, rounds
        for mb, counted in batches:
            out = self._forward(mb)
            if not counted:
                continue
            hist = torch.bincount(out.accept_len[out.block_valid], minlength=L)
            acc += torch.cat([out.loss_sum[None], out.weight_sum[None], out.slot_correct, out.slot_count, hist,
                              *(out.extra[k][None] for k in names),
                              *([out.calibration.flatten()] if calib else [])]).double()
            n = mb.anchors.shape[1]
            for anchors, taus, valid in zip(mb.anchors.tolist(), out.accept_len.view(-1, n).tolist(),
                                            out.block_valid.view(-1, n).tolist()):
                accepted = {p: t - 1 for p, t, v in zip(anchors, taus, valid) if v}
                rounds = replay_rounds(accepted, anchor_runs(sorted(accepted)))[0]
                replayed[0] += sum(rounds)
                replayed[1] += len(rounds)
        acc = torch.cat([acc, torch.tensor(replayed, dtype=torch.float64, device=dev)])
        _all_sum(acc, self.d)
        correct, count, hist = acc[2: 2 + B], acc[2 + B: 2 + 2 * B], acc[2 + 2 * B: 2 + 2 * B + L]
        n_blocks = float(hist.sum())
        tau = float((hist * torch.arange(L, device=dev)).sum() / max(n_blocks, 1.0))
        first, tail = cfg.draft_slots.start, 2 + 2 * B + L
        return {"loss": float(acc[0] / acc[1].clamp(min=1e-12)),
                "acc": float(correct[first:].sum() / count[first:].sum().clamp(min=1)),
                "tau_sim": tau, "tau_rounds": float(acc[-2] / acc[-1].clamp(min=1)),
                "slot_acc": [round(float(c / max(float(k), 1.0)), 4) for c, k in zip(correct[first:], count[first:])],
                "accept_hist": [int(h) for h in hist[1:]], "blocks": int(n_blocks),
                **family_metrics(cfg, dict(zip(names, acc[tail: tail + len(names)].tolist()))),
                **(calibration_report(acc[tail + len(names): tail + len(names) + calib].view(-1, 4)) if calib else {})}

    # ---- full, process-count-independent state (collective under FSDP: every rank must call) ----
    def full_params(self) -> dict[str, Tensor]:
        """fp32 weights by reference name, full tensors on the CPU."""
        if self.host_state:
            self.optimizer.synchronize()
        return {n: _full(m).float() for n, m in zip(self.names, self.master)}

    def state_dict(self) -> dict[str, Any]:
        if self.host_state:
            self.optimizer.synchronize()
        opt = {}
        for name, m in zip(self.names, self.master):
            st = self.optimizer.state.get(m, {})
            opt[name] = {k: _full(v) if torch.is_tensor(v) else v for k, v in st.items()}
        return {"params": self.full_params(), "optimizer": opt, "scheduler": self.scheduler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        def like(src: Tensor, ref: Tensor) -> Tensor:
            if hasattr(ref, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                return distribute_tensor(src.to(ref.device_mesh.device_type), ref.device_mesh, ref.placements)
            return src.to(ref.device)

        missing = [n for n in self.names if n not in state["params"]]
        if missing:
            raise ValueError(f"training state lacks parameters {missing[:4]}: it belongs to another drafter architecture")
        for name, m in zip(self.names, self.master):  # moments have their parameter's shape; a step count none
            moments = [v for v in (state["optimizer"].get(name) or {}).values() if torch.is_tensor(v) and v.dim()]
            shapes = {tuple(t.shape) for t in [state["params"][name], *moments]}
            if shapes != {tuple(m.shape)}:
                raise ValueError(f"training state: parameter {name} or its optimizer state has shape(s) {sorted(shapes)}, "
                                 f"this drafter's is {tuple(m.shape)}: it belongs to another drafter architecture")
        for name, m in zip(self.names, self.master):
            m.copy_(like(state["params"][name].to(m.dtype), m))
        sd = self.optimizer.state_dict()
        sd["state"] = {}
        for i, (name, m) in enumerate(zip(self.names, self.master)):
            st = state["optimizer"].get(name)
            if st:
                sd["state"][i] = {k: (like(v, m) if torch.is_tensor(v) and v.dim() else v) for k, v in st.items()}
        self.optimizer.load_state_dict(sd)
        self._loaded(state["scheduler"])

    def _loaded(self, scheduler: dict[str, Any]) -> None:
        """The schedule restored and the loaded master weights put in the model."""
        self.scheduler.load_state_dict(scheduler)
        for g, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            g["lr"] = lr
        self._master_to_model()

    def sharded(self) -> bool:
        """Checkpoints in shards (`shardstate`): several ranks, AdamW state on the device."""
        return self.d.world > 1 and not self.host_state

    def shard_state(self) -> dict[str, Any]:
        return shardstate.tensors(self.names, self.master, self.optimizer)

    @torch.no_grad()
    def load_shards(self, directory: Path, scheduler: dict[str, Any]) -> None:
        """Weights and AdamW state from a sharded checkpoint's `directory`, written by any number of ranks."""
        shardstate.load(self.shard_state(), directory)
        # A round trip puts each state tensor where this optimiser keeps it (a fused one: on the device).
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self._loaded(scheduler)


def _full(t: Tensor) -> Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().to("cpu", copy=True)


# ---- checkpoints -----------------------------------------------------------------------------


def export_drafter(config: DrafterConfig, params: dict[str, Tensor], dtype: torch.dtype) -> DFlashDrafter:
    """A plain CPU drafter holding `params` (full tensors), for writing in the reference format."""
    with torch.device("meta"):
        d = DFlashDrafter(config)
    d.load_state_dict({k: v.to(dtype) for k, v in params.items()}, assign=True)
    return d


def save_checkpoint(out_dir: Path, step: int, drafter: DFlashDrafter, training_state: dict[str, Any], keep_last: int) -> Path:
    return publish_checkpoint(out_dir, step, lambda p: save_drafter(drafter, p, training_state=training_state),
                              keep_last)


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step:08d}"


def publish_checkpoint(out_dir: Path, step: int, write: Callable[[Path], Any], keep_last: int) -> Path:
    """`write(directory)` fills the checkpoint of step `step` under a temporary name, which is then
    renamed into place; latest.json names it, and the oldest beyond `keep_last` go."""
    final = step_dir(out_dir, step)
    ckpts = final.parent
    ckpts.mkdir(parents=True, exist_ok=True)
    replace_dir(final, write)
    atomic_write_json(out_dir / "latest.json", {"step": step, "checkpoint": str(final.relative_to(out_dir))})
    # By step number, the one just written (what latest.json names) always kept.
    others = sorted((p for p in ckpts.glob("step-*") if p != final and _step_of(p) is not None), key=_step_of)
    for old in others[:max(0, len(others) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _step_of(path: Path) -> int | None:
    digits = path.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


# ---- the run directory -----------------------------------------------------------------------

# What a run writes in its output directory; a fresh run refuses a directory holding any of them.
RUN_FILES = ("config.yaml", "latest.json", "best.json", "metrics.jsonl", "curves.png", "checkpoints", "best", "final", "tb")


class DivergedError(RuntimeError):
    """The loss or the weights became non-finite; nothing of that step was saved."""


class TrainingStopped(Exception):
    """SIGTERM or SIGINT stopped training after a step, whose checkpoint was saved. `exit_code` is
    128 + the signal's number, as a shell reports a process that the signal ended."""

    def __init__(self, step: int, signum: int, out_dir: Path, then: str | None = None) -> None:
        self.step, self.signum, self.out_dir, self.exit_code = step, signum, out_dir, 128 + signum
        # Under torchrun the command to repeat is torchrun's, with every rank's options.
        command = "the same `torchrun ... -m dflashkit.cli train` command" if "TORCHELASTIC_RUN_ID" in os.environ \
            else "`dflashkit train`"
        if step:
            where = f"after step {step}, whose checkpoint is saved in {out_dir}"
            then = then or f"continue with {command} --resume (or --auto-resume) and the same config"
        else:  # no checkpoint to resume from: --resume would fail
            where = "before its first step (nothing to save)"
            then = then or (f"start it again with {command} --auto-resume (it starts afresh while the output "
                            "directory has no checkpoint) or --overwrite, and the same config")
        super().__init__(f"stopped by {signal.Signals(signum).name} {where}; {then}")


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """SIGTERM (a scheduler pre-empting the job, `kill`) or SIGINT (Ctrl-C) asks training to stop at
    the end of the current step, with a checkpoint, rather than lose the steps since the last one.
    The first signal puts the usual handlers back, so that a second one stops the process at once.
    Yields a list that holds the signal's number once one has come."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield got
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        got.append(signum)
        for s, h in before.items():
            signal.signal(s, h)
        log.warning("%s: stopping after this step with a checkpoint (send it again to stop at once)",
                    signal.Signals(signum).name)

    for s in before:
        signal.signal(s, handler)
    try:
        yield got
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _rank_tensor(n: int) -> Tensor:
    """A one-element tensor where this process group's collectives run (NCCL: the GPU)."""
    return torch.tensor([n], device="cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")


def stop_requested(got: list[int], d: Dist) -> int:
    """The signal that asks to stop (0: none), agreed by all ranks: a signal reaches each rank at
    its own moment, and they must stop after the same step to save one checkpoint together."""
    n = got[0] if got else 0
    if d.world > 1:
        t = _rank_tensor(n)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t)
    return n


@contextmanager
def run_directory(out_dir: Path, *, resume: bool, overwrite: str | None, main: bool) -> Iterator[None]:
    """Hold the output directory for the run (`rundir.output_directory`: a second run into it fails
    at once; temp files of killed runs go) and refuse to start afresh over an earlier run's files
    unless asked: `overwrite`, the option that asks (--overwrite, or --auto-resume where no
    checkpoint was saved), removes those that dflashkit wrote, never a file of the user's."""
    if not main:
        yield
        return
    with output_directory(out_dir, "train", temp_dirs=("checkpoints",)) as owned:
        used = owned.present(RUN_FILES)
        if used and not resume:
            if not overwrite:
                raise ValueError(earlier_run(out_dir, used))
            log.warning("%s: removing the earlier run in %s (%s)", overwrite, out_dir, ", ".join(used))
            owned.remove(used, option=overwrite)
        owned.record(RUN_FILES)
        yield


def earlier_run(out_dir: Path, used: list[str]) -> str:
    """Why a fresh run refuses `out_dir`, and the options that work from there."""
    if "latest.json" in used:
        return (f"{out_dir} holds an earlier run ({', '.join(used)}); pass --resume (or --auto-resume) to continue it, "
                "--overwrite to replace it, or choose another train.output_dir")
    return (f"{out_dir} holds an earlier run that saved no checkpoint ({', '.join(used)}); --auto-resume or "
            "--overwrite starts afresh (replacing its files), or choose another train.output_dir")


def check_finite(step: int, values: dict[str, float], params: dict[str, Tensor] | None = None) -> None:
    """Stop the run at the first non-finite loss, gradient norm or weight (before anything is saved)."""
    bad = [k for k in ("loss", "grad_norm") if k in values and not math.isfinite(values[k])]
    if "grad_norm" in values and "loss" in bad and values["grad_norm"] == 0:
        bad.remove("loss")  # a step without supervised tokens has no loss, and changes nothing
    if params is not None:
        bad += [f"weight {n}" for n, v in params.items() if not bool(torch.isfinite(v).all())][:3]
    if bad:
        raise DivergedError(f"training diverged at step {step}: non-finite {', '.join(bad)}; stopping without saving "
                            "this step (checkpoints, best/ and final/ hold the last finite ones). Lower train.lr or "
                            "train.grad_clip, then --resume-from an earlier checkpoint or start afresh")


def find_resume(out_dir: Path, resume: bool | str | None) -> Path | None:
    """`True`: the checkpoint named by `<output_dir>/latest.json`; a path: that checkpoint."""
    if not resume:
        return None
    if resume is True:
        latest = out_dir / "latest.json"
        if not latest.is_file():
            raise FileNotFoundError(f"--resume: {latest} does not exist (no checkpoint was written in {out_dir} yet); "
                                    "--auto-resume starts afresh while there is none, or --overwrite")
        try:
            path = out_dir / json.loads(latest.read_text())["checkpoint"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--resume: {latest} is malformed ({type(e).__name__}: {e}); expected "
                             '{"step": N, "checkpoint": "checkpoints/step-..."}; use --resume-from CKPT') from None
    else:
        path = Path(resume)
    if not (path / "training_state.pt").is_file():
        raise FileNotFoundError(f"--resume: {path} holds no training_state.pt (only step checkpoints can be resumed)")
    return path


def _rng_state() -> dict[str, Any]:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


# What a resumed run must share with the run that wrote its checkpoint, beyond the data position.
RUN_IDENTITY = {"target_sha256": "target (config or weights)", "samples_sha256": "training set (sample ids or their order)"}


def run_identity(target: Any, ids: list[str]) -> dict[str, str]:
    """The target's identity (its config and a fingerprint of its weights) and the samples' ids in
    order, hashed: kept in each training state and compared on resume (`RUN_IDENTITY`)."""
    from dflashkit.data.features import target_identity

    ident = target_identity(target)
    weights = json.dumps([ident["config_sha256"], ident["weights_fingerprint"]])
    return {"target_sha256": hashlib.sha256(weights.encode()).hexdigest(),
            "samples_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


# ---- logging ---------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (the source of the curves), TensorBoard, and W&B when asked. Main rank only."""

    def __init__(self, out_dir: Path, start_step: int, tcfg, config: dict[str, Any], enabled: bool) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        if start_step and self.path.is_file():  # drop what was logged after the checkpoint we resume from
            keep = [line for line, rec in read_metrics(self.path) if rec["step"] <= start_step]
            atomic_write_bytes(self.path, b"".join(keep))
        elif not start_step:
            self.path.unlink(missing_ok=True)
        if tcfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
            except ImportError:
                log.warning("tensorboard is not installed: logging to metrics.jsonl and the console only")
        if tcfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("train.wandb_project is set but `wandb` is not installed (pip install wandb)") from None
            self.wandb = wandb.init(project=tcfg.wandb_project, config=config, dir=str(out_dir), resume="allow",
                                    id=hashlib.blake2b(str(out_dir.resolve()).encode(), digest_size=8).hexdigest())

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with writing(self.path), open(self.path, "a") as f:  # a full disk: one line naming the file
            f.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
        scalars = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: Path) -> list[tuple[bytes, dict[str, Any]]]:
    """(line, record) of every record of metrics.jsonl, a torn last line (a kill during its write)
    cut off the file; a record that is not a JSON object with an integer step is an error naming
    its line."""
    records = []
    with open(path, "r+b") as f:
        for lineno, line in complete_lines(f, path):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if not isinstance(rec, dict) or type(rec.get("step")) is not int:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step' (a metrics record); "
                                 "fix or remove the line, or start afresh with --overwrite")
            records.append((line, rec))
    return records


# The family's own baseline beside its held-out tau_sim: what its new module adds.
TAU_BASELINES = {"tau_unary": "its unary chain (the walk's gain)", "tau_unbiased": "without the Markov bias"}


def plot_curves(metrics: Path, png: Path) -> None:
    """Loss, accuracy and tau_sim against the step, from metrics.jsonl; with a confidence head, the
    reliability diagram of its last held-out evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [rec for _, rec in read_metrics(metrics)]
    evals = [x for x in rows if x["kind"] == "eval"]
    calibrated = [x for x in evals if "reliability" in x]
    panels = 3 + bool(calibrated)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        r = [x for x in rows if x["kind"] == kind]
        if not r:
            continue
        steps = [x["step"] for x in r]
        axes[0].plot(steps, [x["loss"] for x in r], style, label=kind)
        axes[1].plot(steps, [x["acc"] for x in r], style, label=kind)
    if evals:
        axes[2].plot([x["step"] for x in evals], [x["tau_sim"] for x in evals], "o-", label="held-out")
    for key, label in TAU_BASELINES.items():
        if any(key in x for x in evals):
            axes[2].plot([x["step"] for x in evals if key in x], [x[key] for x in evals if key in x], "x--", label=label)
    titles = ["loss", "slot accuracy (slots 1..B-1)", "tau_sim (simulated acceptance length)"]
    if calibrated:
        titles.append(_reliability_diagram(axes[3], calibrated[-1]))
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no held-out evaluation: nothing to label
            ax.legend()
    for ax in axes[:3]:
        ax.set_xlabel("step")
    fig.tight_layout()
    try:
        atomic_save(lambda tmp: fig.savefig(tmp, dpi=100, format="png"), png)
    finally:
        plt.close(fig)


def _reliability_diagram(ax: Any, ev: dict[str, Any]) -> str:
    """A confidence head's held-out evaluation: per bin of predicted acceptance, the mean
    prediction against Σ min(p, q) (what it is trained on) and against greedy acceptance -> title."""
    bins = [b for b in ev["reliability"] if b["count"]]
    predicted = [b["predicted"] for b in bins]
    ax.plot([0, 1], [0, 1], ":", color="grey", label="calibrated")
    ax.plot(predicted, [b["overlap"] for b in bins], "o-", label=f"sum min(p, q): ECE {ev['ece_overlap']:.3f}")
    ax.plot(predicted, [b["hit"] for b in bins], "s-", label=f"greedy acceptance: ECE {ev['ece_hit']:.3f}")
    ax.set_xlabel("predicted acceptance")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    return f"confidence head at step {ev['step']}"


# ---- the job ---------------------------------------------------------------------------------


def resolve_precision(tcfg, device: torch.device) -> tuple[torch.dtype, str, bool]:
    """(dtype, attention backend, compile) from the config and the device."""
    cuda = device.type == "cuda"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(tcfg.dtype, torch.bfloat16 if cuda else torch.float32)
    backend = tcfg.attention if tcfg.attention != "auto" else ("flex" if cuda else "sdpa")
    if backend == "flex" and not cuda:
        raise ValueError("train.attention='flex' needs a GPU (FlexAttention has no CPU backward); use 'sdpa' or 'auto'")
    return dtype, backend, tcfg.compile if tcfg.compile is not None else cuda


BUDGET_PROVISIONAL_STEPS, BUDGET_REFIT_EVERY, BUDGET_WINDOW = 1000, 10, 50


def compile_target(setting: bool | None, target: Any) -> bool:
    """target.compile: None compiles targets whose layers are all attention and not sharded; a
    hybrid's Gated DeltaNet layers call fla's Triton kernels, and compiling around them, or around
    FSDP's gathers, is not measured."""
    if setting is not None:
        return setting
    return "linear_attention" not in target.layer_kinds and not target.sharded


def fit_total_steps(done: int, step_s: float, left_s: float, tc, d: Dist) -> int:
    """Steps that fit in `left_s` at `step_s` per step (evaluations included in the mean), keeping
    a little for the final save; every rank takes rank 0's answer so all run the same schedule."""
    n = done + int(0.95 * max(0.0, left_s) / max(step_s, 1e-6))
    if tc.max_steps:
        n = min(n, tc.max_steps)
    if d.world > 1:
        t = _rank_tensor(n)
        dist.broadcast(t, 0)
        n = int(t)
    return max(done, n)


def train(cfg, *, target: Any = None, samples: Sequence[Any] | None = None,
          feature_layer_ids: list[int] | None = None, resume: bool | str | None = None,
          overwrite: bool = False, probes: dict[str, Sequence[Any]] | None = None, auto_resume: bool = False) -> Path:
    """Train a drafter as `cfg` says; returns the output directory (holding `final/`, `best/`,
    `checkpoints/`, `metrics.jsonl`, `curves.png`). `target` / `samples` skip loading them.
    The directory belongs to this run (`run_directory`): without `resume`, an earlier run's files
    are an error unless `overwrite`. probes: named sets of `TokenizedSample`s from elsewhere (e.g.
    the target's own answers to the evaluation suites), never trained on and never used to pick
    `best/`: whenever `best/` is saved, decoding rounds are replayed on each (best.json:
    tau_rounds_probes), with features computed online. auto_resume: continue from `latest.json`
    when there is one, else start afresh (replacing what a run that saved no checkpoint left)."""
    from dflashkit.commands import resolve_device

    fresh = "--overwrite" if overwrite else None  # the option that lets this run replace an earlier one
    if auto_resume:
        if resume or overwrite:
            raise ValueError("--auto-resume decides between resuming and starting afresh itself: "
                             "give it without --resume, --resume-from or --overwrite")
        resume, fresh = (True, None) if (Path(cfg.train.output_dir) / "latest.json").is_file() else (None, "--auto-resume")
    t_begin = time.perf_counter()
    want = torch.device(resolve_device(cfg.target.device))
    d = init_distributed(want.type == "cuda", cfg.train.dist_timeout)
    with run_directory(Path(cfg.train.output_dir), resume=bool(resume), overwrite=fresh, main=d.main), \
            stop_signals() as stop:
        return _train(cfg, d, want, t_begin, target, samples, feature_layer_ids, resume, probes or {}, stop)


@dataclass
class Run:
    """One training run's parts, built whole by `_setup` (and `_resume`) before the loop."""

    cfg: Any
    d: Dist
    out_dir: Path
    dtype: torch.dtype
    compiled: bool
    dcfg: DrafterConfig
    trainer: Trainer
    batcher: Batcher
    metrics: MetricsLog
    identity: dict[str, str]
    train_idx: list[int]
    eval_idx: list[int]
    eval_groups: dict[str, list[int]]
    probe_idx: dict[str, list[int]]
    total: int  # steps; a time-budgeted run re-fits it as it learns its step time
    start: int
    best: dict[str, Any]  # {"tau_sim", "step", ...} of best/
    saves: shardstate.Saves | None = None  # sharded checkpoints written in the background (train.async_save)


def _train(cfg, d: Dist, want: torch.device, t_begin: float, target: Any, samples: Sequence[Any] | None,
           feature_layer_ids: list[int] | None, resume: bool | str | None, probes: dict[str, Sequence[Any]],
           stop: list[int]) -> Path:
    run = _setup(cfg, d, want, target, samples, feature_layer_ids, resume, probes)
    if run.eval_idx and run.start == 0 and cfg.drafter.init_from:
        # Fine-tuning: the starting drafter is a candidate too, so that best/ is never worse on
        # the held-out split than what training started from (best.json says step 0 then); not an
        # upgrade that adds a confidence head: the head is fresh, and decoding trusts it to choose
        # how much to draft.
        fresh_head = run.dcfg.enable_confidence_head and load_config(cfg.drafter.init_from).kind != run.dcfg.kind
        _evaluate(run, 0, not_candidate="its confidence head is fresh" if fresh_head else None)
    _loop(run, stop, t_begin)
    return _finish(run)


def _new_or_loaded_drafter(cfg, target: Any, resume_dir: Path | None) -> DFlashDrafter:
    if resume_dir is not None and (resume_dir / WEIGHTS).is_file():
        return load_drafter(resume_dir, target)
    if resume_dir is not None:  # a sharded checkpoint: the weights come from its shards (`_resume`)
        drafter = DFlashDrafter(load_config(resume_dir))
        problems = target_problems(drafter.config, target)
        if problems:
            raise ValueError(f"{resume_dir}: does not fit target {target.name}: " + "; ".join(problems))
        return drafter
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank (an upgrade's new modules too)
    if cfg.drafter.init_from:
        drafter = load_drafter(cfg.drafter.init_from, target)
        drafter = grow(drafter, cfg.drafter.grow_layers) if cfg.drafter.grow_layers else drafter
        return upgraded(drafter, cfg.drafter) if cfg.drafter.kind not in (None, drafter.config.kind) else drafter
    from dflashkit.drafter import new_drafter

    drafter = new_drafter(target, cfg.drafter)
    problems = target_problems(drafter.config, target)  # what `generate` and `serve` would refuse
    if problems:
        raise ValueError("drafter settings do not fit target " f"{target.name}: " + "; ".join(problems))
    return drafter


def _with_probes(cfg, target: Any, samples: Sequence[Any], probes: dict[str, Sequence[Any]]
                 ) -> tuple[Sequence[Any], dict[str, list[int]]]:
    """The probe sets appended after the training set (so that its split and schedule stay as they
    are), and their indices."""
    tc = cfg.train
    if (probes or tc.probes) and hasattr(samples, "ids"):
        raise ValueError("train.probes: probes need features computed online; data.features gives cached ones only")
    if not probes and tc.probes:
        from dflashkit.data.regenerate import probe_sets

        probes = probe_sets(tc.probes, target, cfg.data.max_new_tokens)
    probe_idx: dict[str, list[int]] = {}
    if probes:
        samples = list(samples)
        for name, group in probes.items():
            probe_idx[name] = list(range(len(samples), len(samples) + len(group)))
            samples += list(group)
    return samples, probe_idx


def _setup(cfg, d: Dist, want: torch.device, target: Any, samples: Sequence[Any] | None,
           feature_layer_ids: list[int] | None, resume: bool | str | None,
           probes: dict[str, Sequence[Any]]) -> Run:
    """Target, data, drafter, trainer and batcher; the resumed state when there is one."""
    tc = cfg.train
    device = torch.device("cuda", d.local_rank) if want.type == "cuda" and d.world > 1 else want
    out_dir = Path(tc.output_dir)
    torch.manual_seed(tc.seed)
    from dflashkit.parallel import training_target
    from dflashkit.target import fla_missing

    target = training_target(cfg, target, device)
    dtype, backend, compile_ = resolve_precision(tc, device)
    if samples is None:
        samples, feature_layer_ids = load_training_data(cfg.data, target, dtype)
    if len(samples) < 2:
        source = cfg.data.features or cfg.data.tokenized
        raise ValueError(f"train: {source + ': ' if source else ''}{len(samples)} training sequence(s); need at least 2")
    resume_dir = find_resume(out_dir, resume)
    drafter = _new_or_loaded_drafter(cfg, target, resume_dir)
    dcfg = drafter.config
    check_label_sources(dcfg.target_layer_ids, target.num_layers, tc.loss, dcfg.enable_confidence_head)
    ids = sample_ids(samples)
    train_idx, eval_idx = split_eval(len(samples), tc.eval_samples, tc.seed, ids)
    eval_groups = held_out_groups(ids, eval_idx)
    identity = run_identity(target, ids)
    samples, probe_idx = _with_probes(cfg, target, samples, probes)
    total = tc.max_steps or max(1, math.ceil(tc.epochs * len(train_idx) / tc.batch_size))
    if tc.time_budget_s and not tc.max_steps:
        total = BUDGET_PROVISIONAL_STEPS  # re-fitted to the budget from the first timed step on
    head = target.model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"target {target.name}: an LM head with a bias is not supported")
    trainer = Trainer(drafter, target.embed, head.weight, tc, total, device=device, dtype=dtype, d=d,
                      backend=backend, compile=compile_)
    batcher = Batcher(samples, feature_layer_ids, target, dcfg, tc, cfg.data.max_length, device, dtype)
    online_gpu = batcher.online_layers is not None and device.type == "cuda"
    if online_gpu and compile_target(cfg.target.compile, target):
        target.compile_layers(max(batcher.online_layers))
    if online_gpu and fla_missing(target) and d.main:
        log.warning("fla-core is not installed: the target's Gated DeltaNet layers run Transformers' PyTorch "
                    "reference, 1.5x slower a step at the Qwen3.6-27B shape (H100); pip install 'dflashkit[fla]'")
    start, best = 0, {"tau_sim": -1.0, "step": None}
    if resume_dir is not None:
        start, best, total = _resume(cfg, trainer, resume_dir, total, len(train_idx), identity, d)
    metrics = MetricsLog(out_dir, start, tc, cfg.model_dump(), d.main)
    run = Run(cfg, d, out_dir, dtype, compile_, dcfg, trainer, batcher, metrics, identity, train_idx, eval_idx,
              eval_groups, probe_idx, total, start, best,
              shardstate.Saves(tc.dist_timeout, trainer.shard_state(), out_dir / "checkpoints")
              if trainer.sharded() and tc.async_save else None)
    if d.main:
        # The effective config, overrides applied: `dflashkit train --config` on it repeats the run.
        atomic_write_bytes(out_dir / "config.yaml", (f"# {versions()}, {time.strftime('%Y-%m-%d %H:%M')}\n"
                                                     + dump_config(cfg, comments=True)).encode())
        procs = "1 process" if d.world == 1 else f"{d.world} processes ({trainer.parallel.upper()})"
        log.info("training %s: %d steps of %d sequences (%d train, %d held out), %s attention, %s, %s",
                 f"{dcfg.num_hidden_layers}-layer drafter", total, tc.batch_size, len(train_idx), len(eval_idx),
                 backend, str(dtype).removeprefix("torch."), procs)
    return run


def _resume(cfg, trainer: Trainer, resume_dir: Path, total: int, num_train: int, identity: dict[str, str],
            d: Dist) -> tuple[int, dict[str, Any], int]:
    """The checkpoint's optimiser, schedule and RNG restored, once it is known to be this run's;
    -> (step, best, total steps)."""
    tc = cfg.train
    state = load_training_state(resume_dir)
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{resume_dir}/training_state.pt: version {state.get('version')}, expected {STATE_VERSION}")
    if tc.time_budget_s:  # the fitted length of the interrupted run
        total = state["total_steps"]
        trainer.set_total_steps(total)
    for key, now in (("batch_size", tc.batch_size), ("num_train", num_train), ("total_steps", total)):
        if state[key] != now:
            raise ValueError(f"--resume: the checkpoint was trained with {key}={state[key]}, this run has {now}; "
                             "the data position cannot be carried over")
    changed = [RUN_IDENTITY[k] for k, v in identity.items() if k in state and state[k] != v]
    if changed:
        raise ValueError(f"--resume: {resume_dir} was trained with another {' and '.join(changed)} than this run's; "
                         "resume with the same ones, or start afresh with --overwrite")
    if state.get("sharded") == SHARDED_STATE:
        trainer.load_shards(resume_dir / SHARDED_STATE, state["scheduler"])
    else:
        trainer.load_state_dict(state)
    _set_rng_state(state["rng"])
    if d.main:
        log.info("resumed from %s at step %d", resume_dir, state["step"])
    if d.main and type(state.get("world_size")) is int and state["world_size"] != d.world:  # absent before it was recorded
        log.info("world size changed: the checkpoint was written by %d processes, this run has %d; the global batch "
                 "(%d sequences) and the data position are kept", state["world_size"], d.world, tc.batch_size)
    return state["step"], state["best"], total


def _state_fields(run: Run, step: int) -> dict[str, Any]:
    """What a training state holds besides the weights and the optimiser's moments."""
    tc = run.cfg.train
    return {"version": STATE_VERSION, "step": step, "total_steps": run.total, "batch_size": tc.batch_size,
            "num_train": len(run.train_idx), "world_size": run.d.world, "best": run.best, "rng": _rng_state(),
            "config": run.cfg.model_dump(), **run.identity}


def _checkpoint(run: Run, step: int) -> None:
    t0 = time.perf_counter()
    if run.trainer.sharded():
        return _sharded_checkpoint(run, step, t0)
    tc, full = run.cfg.train, run.trainer.state_dict()
    check_finite(step, {}, full["params"])
    if run.d.main:
        state = {**_state_fields(run, step), **full}
        t1 = time.perf_counter()
        path = save_checkpoint(run.out_dir, step, export_drafter(run.dcfg, full["params"], run.dtype), state,
                               tc.keep_last)
        log.info("checkpoint %s saved in %.2f s (%.2f s gathering the state, %.2f s writing)", path,
                 time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1)


def _sharded_checkpoint(run: Run, step: int, t0: float) -> None:
    """Each rank writes its shards of the weights and moments into the checkpoint's temporary
    directory (`shardstate`), in the background under train.async_save; rank 0 then adds the config
    and the rest of the training state, and renames it into place. Nothing is gathered on one rank."""
    _check_shards_finite(run, step)
    where: list[Any] = [str(temp_path(step_dir(run.out_dir, step))) if run.d.main else None]
    dist.broadcast_object_list(where, 0)
    shards = Path(where[0])
    # Taken now: the steps that go on while the shards are written change the schedule and the RNG.
    state = {**_state_fields(run, step), "scheduler": run.trainer.scheduler.state_dict(), "sharded": SHARDED_STATE}

    def complete(released: float | None) -> None:
        """Rank 0, once every shard is written; `released`: when the loop went on (None: it waited for all)."""
        written = time.perf_counter()
        path = publish_checkpoint(run.out_dir, step, lambda p: _complete_shards(run, shards, state, p),
                                  run.cfg.train.keep_last)
        now = time.perf_counter()
        log.info("checkpoint %s saved in %.2f s (the training loop stalled %.2f s; %d ranks writing their shards "
                 "%.2f s, rank 0 the rest %.2f s)", path, now - t0, (released or now) - t0, run.d.world,
                 written - t0, now - written)

    then = complete if run.d.main else None
    if run.saves is None:
        shardstate.save(run.trainer.shard_state(), shards / SHARDED_STATE)
        if then is not None:
            then(None)
    else:
        run.saves.start(run.trainer.shard_state(), shards / SHARDED_STATE, then)


def _complete_shards(run: Run, shards: Path, state: dict[str, Any], p: Path) -> None:
    """The written shards' directory becomes checkpoint `p`, with the config, the training state and the sums."""
    os.replace(shards, p)
    atomic_write_json(p / CONFIG, run.dcfg.to_json_dict())
    atomic_save(lambda tmp: torch_save(state, tmp), p / TRAINING_STATE)
    names = [CONFIG, TRAINING_STATE, f"{SHARDED_STATE}/SHA256SUMS"]  # the shards' sums cover the shards
    atomic_write_bytes(p / "SHA256SUMS", "".join(f"{sha256_file(p / n)}  {n}\n" for n in sorted(names)).encode())


def _saved(run: Run) -> None:
    """The checkpoint being written in the background (train.async_save) is complete: latest.json names it."""
    if run.saves is not None:
        run.saves.wait()


def _check_shards_finite(run: Run, step: int) -> None:
    """`check_finite` of the weights, each rank looking at its own shards."""
    local = [m.to_local() if hasattr(m, "to_local") else m for m in run.trainer.master]
    bad = _rank_tensor(0).repeat(len(local)).float()
    for i, m in enumerate(local):
        bad[i] = float(not bool(torch.isfinite(m).all()))
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    check_finite(step, {}, {n: torch.tensor(float("nan") if b else 0.0) for n, b in zip(run.trainer.names, bad.tolist())})


def _save_drafter_dir(run: Run, name: str, params: dict[str, Tensor]) -> None:
    """`best/` or `final/` in the reference format (main rank), its writing time logged."""
    t0 = time.perf_counter()
    replace_dir(run.out_dir / name, lambda p: save_drafter(export_drafter(run.dcfg, params, run.dtype), p))
    log.info("%s saved in %.2f s", run.out_dir / name, time.perf_counter() - t0)


def _held_out(run: Run, idx: list[int]) -> dict[str, Any]:
    return run.trainer.evaluate((run.batcher.build(items, held_out=True), counted)
                                for items, counted in eval_items(idx, run.cfg.train.micro_batch_size, run.d))


def _evaluate(run: Run, done: int, not_candidate: str | None = None) -> None:
    """Held-out metrics at step `done`; `best/` follows the highest tau_sim, except where
    `not_candidate` says why this drafter may not be best/."""
    ev = _held_out(run, run.eval_idx)
    run.metrics.log(done, "eval", ev)
    check_finite(done, {"loss": ev["loss"]})
    if run.d.main:
        log.info("eval step %d: tau_sim %.3f (rounds replayed %.3f) acc %.3f loss %.4f (per slot %s)%s", done,
                 ev["tau_sim"], ev["tau_rounds"], ev["acc"], ev["loss"], ev["slot_acc"],
                 f"; not a candidate for best/ ({not_candidate})" if not_candidate else "")
    if not_candidate or ev["tau_sim"] <= run.best["tau_sim"]:
        return
    best = {"tau_sim": ev["tau_sim"], "step": done}
    if "ece_hit" in ev:  # a confidence head's held-out calibration
        best["calibration"] = {k: ev[k] for k in ("ece_hit", "ece_overlap", "reliability")}
    if run.eval_groups:  # per suite, for comparison with online τ suite by suite
        best["tau_sim_by_suite"] = {g: _held_out(run, idx)["tau_sim"] for g, idx in run.eval_groups.items()}
    if run.probe_idx:  # decoding rounds replayed on each probe set: what online decoding of it averages
        best["tau_rounds_probes"] = {name: _held_out(run, idx)["tau_rounds"] for name, idx in run.probe_idx.items()}
    run.best = best
    params = run.trainer.full_params()
    check_finite(done, {}, params)
    if run.d.main:
        _save_drafter_dir(run, "best", params)
        atomic_write_json(run.out_dir / "best.json", best)


def _stop(run: Run, step: int, signum: int, bar: Any) -> TrainingStopped:
    if step > run.start and step % run.cfg.train.save_every:  # the step just done has no checkpoint yet
        _checkpoint(run, step)
    _saved(run)
    bar.close()
    run.metrics.close()
    if run.d.world > 1:
        dist.barrier()  # every rank leaves once rank 0 has written the checkpoint
    return TrainingStopped(step, signum, run.out_dir)


def _refit_budget(run: Run, done: int, step_s: list[float], eval_s: list[float], t_begin: float, bar: Any) -> None:
    """A time-budgeted run's length, re-fitted every step at first, then every few: the median step
    time ignores the steps that compile for new shapes (fitted to one of them, a budget ends a run
    after a few steps), and the evaluations measured so far are spread over the steps between them."""
    tc = run.cfg.train
    fit_from = run.start + 2
    if run.start != 0 or done < fit_from or not (done < run.start + BUDGET_REFIT_EVERY or done % BUDGET_REFIT_EVERY == 0):
        return
    per_step = statistics.median(step_s[-BUDGET_WINDOW:])
    if eval_s and run.eval_idx:
        per_step += statistics.fmean(eval_s) / tc.eval_every
    run.total = fit_total_steps(done, per_step, tc.time_budget_s - (time.perf_counter() - t_begin), tc, run.d)
    run.trainer.set_total_steps(run.total)
    bar.total = run.total
    bar.refresh()
    if run.d.main and done in (fit_from, run.start + BUDGET_REFIT_EVERY):
        log.info("time budget %.0fs: about %d steps fit (%.3f s per step)", tc.time_budget_s, run.total, per_step)


def _loop(run: Run, stop: list[int], t_begin: float) -> None:
    """`_steps` under a heartbeat when there are several ranks: the progress line keeps coming
    while a step waits, and a rank that does not arrive is named."""
    bar = progress(total=run.total, initial=run.start, desc="train", unit="step", disable=not run.d.main)
    if run.d.world == 1 or not joined():  # a group made by the caller: no store of ours to beat in
        return _steps(run, stop, t_begin, bar, None)
    from dflashkit.progress import interval_seconds

    with Heartbeat(interval_seconds(), run.cfg.train.dist_timeout, bar.refresh) as beat:
        _steps(run, stop, t_begin, bar, beat)


def _steps(run: Run, stop: list[int], t_begin: float, bar: Any, beat: Heartbeat | None) -> None:
    """Steps from `run.start` to `run.total`: train, log, evaluate, save; a stop signal saves and raises."""
    tc, d = run.cfg.train, run.d
    t_last, tokens = time.perf_counter(), 0.0
    step_s: list[float] = []  # seconds per training step, evaluations and saves apart
    eval_s: list[float] = []
    step = run.start
    while step < run.total:
        # Asked before each step, so that a signal that came while the data loaded stops before the first.
        if signum := stop_requested(stop, d):
            raise _stop(run, step, signum, bar)
        t_step = time.perf_counter()
        if beat is not None:
            beat.at(step + 1)
        groups = step_items(step, tc.batch_size, tc.micro_batch_size, d, run.train_idx, tc.seed)
        first = UPDATE_AHEAD if run.trainer.host_state else 1
        stats = run.trainer.step(built_ahead(run.batcher.build, groups, first), len(groups))
        step = done = step + 1
        step_s.append(time.perf_counter() - t_step)
        if d.main and done == run.start + 1 and run.compiled:
            log.info("step %d took %.1f s, most of it compiling the drafter's layers (later steps reuse them)",
                     done, step_s[-1])
        if tc.time_budget_s:
            _refit_budget(run, done, step_s, eval_s, t_begin, bar)
        check_finite(done, stats)
        tokens += stats.pop("block_tokens")
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", tau=f"{max(run.best['tau_sim'], 0):.2f}")
        if done % tc.log_every == 0 or done == run.total:
            now = time.perf_counter()
            stats["block_tokens_per_s"] = tokens / (now - t_last)
            t_last, tokens = now, 0.0
            run.metrics.log(done, "train", stats)
            if d.main:
                log.info("step %d/%d loss %.4f acc %.3f lr %.2e grad-norm %.3f %.0f block-tokens/s", done, run.total,
                         stats["loss"], stats["acc"], stats["lr"], stats["grad_norm"], stats["block_tokens_per_s"])
        if run.eval_idx and (done % tc.eval_every == 0 or done == run.total):
            t_eval = time.perf_counter()
            _evaluate(run, done)
            eval_s.append(time.perf_counter() - t_eval)
        if done % tc.save_every == 0 or done == run.total:
            _checkpoint(run, done)
    bar.close()


def _finish(run: Run) -> Path:
    """The last checkpoint complete, final/ (unless a resumed run had nothing left to do and it
    exists), the curves, a barrier."""
    _saved(run)
    if run.start < run.total or not (run.out_dir / "final").exists():
        params = run.trainer.full_params()
        check_finite(max(run.start, run.total), {}, params)
        if run.d.main:
            _save_drafter_dir(run, "final", params)
    run.metrics.close()
    if run.d.main and run.metrics.path.is_file():
        plot_curves(run.metrics.path, run.out_dir / "curves.png")
        log.info("done: %s (best tau_sim %.3f at step %s)", run.out_dir / "final", run.best["tau_sim"], run.best["step"])
    if run.d.world > 1:
        dist.barrier()
    return run.out_dir


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflashkit.commands import add_config_options

    p.add_argument("--resume", action="store_true", help="continue from <train.output_dir>/latest.json")
    p.add_argument("--resume-from", metavar="CKPT", help="continue from this step checkpoint directory")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an output directory that holds an earlier run: the files dflashkit wrote "
                        "there are removed (never another file, never through a link)")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue from latest.json when the output directory has one, else start afresh: one "
                        "command for a job that a scheduler may pre-empt and run again")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from dflashkit.commands import config_from_args

    cfg = config_from_args(args)
    out = train(cfg, resume=args.resume_from or args.resume, overwrite=args.overwrite, auto_resume=args.auto_resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"drafter: {out / 'final'} (best by tau_sim: {out / 'best'}); curves: {out / 'curves.png'}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
