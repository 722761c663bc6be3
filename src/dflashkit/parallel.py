"""The frozen target over several processes (`target.parallel: shard`).

With `replicate` (the default) every process of a torchrun job holds the whole target. With
`shard` each decoder layer is an FSDP2 unit (`fully_shard`) over the job's ranks: a rank keeps
1/world of every layer's weights, and a forward all-gathers one layer's weights at a time (the next
layer's gather is issued while the current one computes) and frees them after the layer. Every rank
still runs the target on its own micro-batch, so the drafter stays data-parallel as before. The
target is frozen: no gradients, no backward, no optimiser state: sharding costs one all-gather of the
target's layer weights per forward and nothing else.

FSDP2 rather than tensor parallelism: it needs nothing of a layer's structure (dense, Gated DeltaNet,
mixture-of-experts layers alike), the features are computed by the model's own forward exactly as in
one process, and a layer's gathered weights serve a whole micro-batch.

The embedding, the final norm and the LM head stay whole on every rank: the drafter's training path
calls the embedding and the head outside the target's forward, every step.

Over several nodes (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE) the layers are sharded within a
node and replicated across nodes (a 2-D mesh, HSDP): the gathers stay on the node's own links.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dflashkit.config import TrainConfig
from dflashkit.jobgroup import join_job
from dflashkit.target import Target, load_target

log = logging.getLogger(__name__)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(device: torch.device, timeout_s: float = TrainConfig.model_fields["dist_timeout"].default) -> None:
    """The job's process group (torchrun's environment, `jobgroup.join_job`), NCCL on CUDA, gloo on the CPU."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join_job("nccl" if device.type == "cuda" else "gloo", timeout_s)


def target_mesh(device: torch.device) -> Any:
    """Ranks to shard over: all of them on one node; within each node (replicated across nodes) on several."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if 1 < local < world and world % local == 0:
        return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def shard_layers(target: Target, mesh: Any) -> None:
    """Each decoder layer an FSDP2 unit over `mesh` (moved to the mesh's device and cut there, one
    layer at a time), the next layer's gather issued when a layer starts."""
    from torch.distributed.fsdp import fully_shard

    for layer in target.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # The decoder is the root unit (it orders the layers' gathers) but shards nothing itself: the
    # embedding and the final norm are called outside its forward too.
    decoder = target.model.get_decoder()
    in_layers = {id(p) for p in target.layers.parameters()}
    fully_shard(decoder, mesh=mesh, ignored_params={p for p in decoder.parameters() if id(p) not in in_layers})
    for layer, following in zip(target.layers, target.layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
    target.sharded = True


def shard_target(target: Target, device: torch.device) -> Target:
    """Shard a loaded target's decoder layers over the job's ranks, in place: each rank keeps its
    share of every layer's weights on `device` and frees the rest (every rank must call this with
    the same target). Embedding, final norm and LM head stay whole."""
    if world_size() == 1 or target.sharded:
        return target
    init_process_group(device)
    shard_layers(target, target_mesh(device))
    target.model.to(device)  # the embedding, final norm, LM head and buffers: whole
    return target


def load_sharded_target(path: str | None, *, gguf_file: str | None, dtype: str, device: torch.device) -> Target:
    """Load a target with each rank holding only its share of the decoder layers on `device`.

    Rank 0 reads the checkpoint into host memory; every rank builds the model on the meta device,
    shards its layers there and allocates only its shards (plus the whole embedding, norm and
    head) on `device`; then tensor by tensor rank 0 scatters each layer weight's shards (and
    broadcasts the whole ones). A rank's device peak is its shards plus one whole tensor."""
    init_process_group(device)
    if dtype == "auto":  # what `load_target` picks for `device`
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    full = None
    if dist.get_rank() == 0:  # first: a testbed target is converted and cached once, by this rank
        full = load_target(path, gguf_file=gguf_file, dtype=dtype, device="cpu")
    dist.barrier()
    target = load_target(path, gguf_file=gguf_file, dtype=dtype, device="cpu", weights=False)
    shard_layers(target, target_mesh(device))
    target.model.to_empty(device=device)
    if getattr(target.config, "tie_word_embeddings", False):
        target.model.tie_weights()
    _scatter_from_rank0(target.model, full.model if full is not None else None)
    return target


@torch.no_grad()
def _scatter_from_rank0(model: nn.Module, source: nn.Module | None) -> None:
    """Fill `model` (sharded, allocated, uninitialised) with rank 0's `source` tensors, by name:
    a sharded tensor's shards scattered, a whole one broadcast into place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    values = dict(source.named_parameters(remove_duplicate=False)) | dict(source.named_buffers()) if source else {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        value = values.get(name)
        if source is not None and (value is None or value.shape != t.shape):
            got = "missing" if value is None else f"of shape {tuple(value.shape)}"
            raise RuntimeError(f"target tensor {name}: {got} in the loaded model, {tuple(t.shape)} in the one "
                               "built from its config")
        if isinstance(t, DTensor):  # the other ranks pass an empty whole: only rank 0's data is scattered
            where = dict(dtype=t.dtype, device=t.device_mesh.device_type)
            whole = value.to(**where) if value is not None else torch.empty(t.shape, **where)
            t.copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=0))
        else:
            if value is not None:
                t.copy_(value)
            dist.broadcast(t, 0)


def _sharding(tcfg: Any) -> bool:
    """`tcfg` (config.TargetConfig) asks for sharding and there are ranks to shard over."""
    if tcfg.parallel != "shard":
        return False
    if world_size() == 1:
        log.info("target.parallel=shard in a single process: the whole target is loaded (shards need torchrun)")
        return False
    return True


def load_configured_target(tcfg: Any, device: torch.device) -> Target:
    """The target as `tcfg` (config.TargetConfig) says: whole in this process, or sharded over the job's ranks."""
    if _sharding(tcfg):
        return load_sharded_target(tcfg.path, gguf_file=tcfg.gguf_file, dtype=tcfg.dtype, device=device)
    return load_target(tcfg.path, gguf_file=tcfg.gguf_file, dtype=tcfg.dtype, device=device)


def training_target(cfg: Any, target: Target | None, device: torch.device) -> Target:
    """The target of a training run (`cfg`: config.Config): loaded as `cfg.target` says, or the one
    handed in, sharded in place when `target.parallel` is 'shard'."""
    shard = _sharding(cfg.target)
    if shard and cfg.train.probes:
        raise ValueError("train.probes: the target writes the probes' answers by decoding, which needs the whole "
                         "target in a process, and target.parallel=shard splits it; leave train.probes unset (or "
                         "hand answered probes to train(cfg, probes=...))")
    if target is None:
        return load_configured_target(cfg.target, device)
    return shard_target(target, device) if shard else target


# ---- ranks with unequal work ---------------------------------------------------------------


@contextmanager
def lockstep(target: Target) -> Iterator[None]:
    """Ranks that run the sharded target's forward an unequal number of times (`extract`: each
    rank its own shards) stay paired: inside, every forward first counts the ranks still working
    (one small all-reduce); a rank done runs forwards of one token while any other works, since
    every forward all-gathers with every rank. Without sharding this does nothing."""
    if not target.sharded:
        yield
        return
    device = target.device

    def announce(*_: Any) -> None:
        _count_working(1, device)

    hook = target.model.get_decoder().register_forward_pre_hook(announce)
    try:
        yield
    finally:
        hook.remove()
    # Only after success: a failing rank ends the job (torchrun stops the others).
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    while _count_working(0, device):
        target.forward(one, [0], logits=False)


def _count_working(me: int, device: torch.device) -> int:
    n = torch.tensor([me], dtype=torch.long, device=device)
    dist.all_reduce(n)
    return int(n)
