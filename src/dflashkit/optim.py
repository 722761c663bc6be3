"""The drafter's optimiser state in host memory (`train.optimizer_state: host`).

A drafter for a large target is itself large (about 1.8B parameters for Qwen3.6-27B), and its fp32
master weights and AdamW moments (12 bytes per parameter) do not fit beside a frozen target that
fills most of the card. `HostAdamW` keeps them in pinned host memory and streams them through the
GPU in chunks at each optimiser step: upload a chunk, apply the same AdamW kernel that the
on-device optimiser runs, write the bf16 weights, copy the chunk back. The arithmetic is the
on-device optimiser's, element for element, so the two give the same weights; what it costs is
the transfer (24 bytes per parameter per step over PCIe), paid once per optimiser step and not
per micro-batch. On a GPU the whole update runs on a stream of its own, so that the next step's
target forwards (which do not read the drafter) run while it streams; `wait()` puts the drafter's
next reader behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adamw import adamw
from torch import Tensor

CHUNK_BYTES = 256 << 20  # fp32 bytes of master weights per streamed chunk


@dataclass
class _Staged:
    """One chunk's master weights and moments on the device, and when their upload lands."""

    index: list[int]
    master: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    ready: Any  # a CUDA event, or None on the CPU


def chunks(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices whose sizes add up to at most `budget` (a larger one alone)."""
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if out[-1] and used + n > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return [c for c in out if c]


class HostAdamW(torch.optim.Optimizer):
    """AdamW over `params` (the model's low-precision weights, on the device) whose fp32 master
    copy and moments live on the host. `step(grads)` takes the fp32-scaled gradient of each
    parameter as a callable (index -> Tensor on the device), so that no full fp32 gradient set is
    ever materialised: only one chunk at a time."""

    def __init__(self, params: list[Tensor], *, lr: float, weight_decay: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = params[0].device
        self.cuda = self.device.type == "cuda"
        pin = self.cuda
        self.model_params = params
        master = [_host(p.detach().float(), pin) for p in params]
        super().__init__(master, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.groups = chunks([m.numel() * 4 for m in master], chunk_bytes)
        self._landed = None  # the last step's copies back to the host
        self._updated = None  # the last step's writes of the model's weights
        if self.cuda:
            self.up, self.down = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self.update = torch.cuda.Stream(self.device)

    @property
    def master(self) -> list[Tensor]:
        return self.param_groups[0]["params"]

    def _state(self, m: Tensor) -> dict[str, Tensor]:
        st = self.state[m]
        if not st:
            st["step"] = torch.tensor(0.0, device=self.device)  # as torch's fused AdamW keeps it
            st["exp_avg"] = _host(torch.zeros_like(m), self.cuda)
            st["exp_avg_sq"] = _host(torch.zeros_like(m), self.cuda)
        return st

    def _upload(self, index: list[int]) -> _Staged:
        states = [self._state(self.master[i]) for i in index]
        if not self.cuda:
            return _Staged(index, [self.master[i] for i in index], [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], None)
        with torch.cuda.stream(self.up):
            if self._landed is not None:
                self.up.wait_event(self._landed)  # the previous step's copies back have reached the host
            moved = [[t.to(self.device, non_blocking=True) for t in ts] for ts in
                     ([self.master[i] for i in index], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states])]
            for t in (x for ts in moved for x in ts):
                t.record_stream(torch.cuda.current_stream(self.device))
            ready = self.up.record_event()
        return _Staged(index, *moved, ready)

    def _download(self, staged: _Staged) -> None:
        if not self.cuda:
            return
        done = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.down):
            self.down.wait_event(done)
            for i, m, a, s in zip(staged.index, staged.master, staged.exp_avg, staged.exp_avg_sq):
                st = self.state[self.master[i]]
                for host, dev in ((self.master[i], m), (st["exp_avg"], a), (st["exp_avg_sq"], s)):
                    host.copy_(dev, non_blocking=True)
                    dev.record_stream(self.down)
            self._landed = self.down.record_event()

    @torch.no_grad()
    def step(self, grads=None, reads: list[Tensor] = ()) -> None:  # type: ignore[override]
        """grads: index -> the fp32 gradient of parameter `index` on the device (scaled, clipped);
        reads: the caller's tensors that `grads` reads (kept from reuse until the update has read them)."""
        if grads is None:
            raise TypeError("HostAdamW.step needs the gradients: step(grads=lambda i: ...)")
        if not self.cuda:
            return self._step(grads)
        self.update.wait_stream(torch.cuda.current_stream(self.device))
        for t in reads:
            t.record_stream(self.update)
        with torch.cuda.stream(self.update):
            self._step(grads)
            self._updated = self.update.record_event()

    def _step(self, grads) -> None:
        g = self.param_groups[0]
        beta1, beta2 = g["betas"]
        staged = self._upload(self.groups[0])
        for k in range(len(self.groups)):
            nxt = self._upload(self.groups[k + 1]) if k + 1 < len(self.groups) else None
            if staged.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(staged.ready)
            steps = [self.state[self.master[i]]["step"] for i in staged.index]  # the kernel counts them
            adamw(staged.master, [grads(i) for i in staged.index], staged.exp_avg, staged.exp_avg_sq, [], steps,
                  foreach=False, fused=self.cuda, amsgrad=False, beta1=beta1, beta2=beta2, lr=g["lr"],
                  weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)
            torch._foreach_copy_([self.model_params[i] for i in staged.index], staged.master)
            self._download(staged)
            staged = nxt

    def wait(self) -> None:
        """Put the current stream's next work behind the last step's writes of the model's weights."""
        if self._updated is not None:
            torch.cuda.current_stream(self.device).wait_event(self._updated)

    def synchronize(self) -> None:
        """Wait until the host holds the last step's weights and moments (before reading them), and
        the model's weights are the update's."""
        self.wait()
        if self._landed is not None:
            self._landed.synchronize()

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)
        for m in self.master:  # loading copies the moments into new, unpinned tensors
            st = self.state.get(m)
            if st:
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = _host(st[k].float(), self.cuda)
                st["step"] = st["step"].float().to(self.device)

    def master_to_model(self) -> None:
        """Copy the host's master weights into the model's (after a resume)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master):
                p.copy_(m.to(p.device, non_blocking=False))


def _host(t: Tensor, pin: bool) -> Tensor:
    t = t.to("cpu", copy=True)
    return t.pin_memory() if pin else t
