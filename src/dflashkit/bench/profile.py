"""Where a profiled step's time goes, by kind of work: each kernel (or, without a GPU, each
operator) is put in one kind by its name, and the kinds' times, counts and heaviest kernels are
summed per step (`benchmarks/bench_online.py --profile`). A kind is what a change would target:
the matmuls, the attention, the Gated DeltaNet kernels, the memory traffic of the optimiser
state on the host.

The rules are ordered and the first that matches wins, so the specific ones come first: a
convolution's implicit GEMM is a convolution, not a matmul; an NCCL all-gather is communication,
not indexing; a fused Inductor kernel goes to what it computes before any cast in it makes it a
copy. Inductor's templates (`triton_tem_`) are counted as attention: here they are flex
attention's kernels (no max-autotune matmul templates). A Gated DeltaNet layer run through
Transformers' PyTorch fallback (no fla) has no kernels of its own: only its triangular solves
(the one solve in these steps) are counted as Gated DeltaNet, its matmuls and elementwise work
land in those kinds; on a CPU the table is about operators, not kernels."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable, NamedTuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

_ATEN_ELEMENTWISE = ("add|sub|rsub|mul|div|neg|exp|log|pow|rsqrt|sqrt|reciprocal|sigmoid|silu|gelu|tanh|relu|softplus|"
                     "erf|sin|cos|abs|sign|clamp|where|masked_fill|addcmul|addcdiv|lerp|maximum|minimum|"
                     "eq|ne|lt|le|gt|ge|logical_\\w+|bitwise_\\w+")
_ATEN_REDUCTION = "sum|mean|amax|amin|max|min|norm|linalg_vector_norm|std|var|prod|all|any|_softmax|_log_softmax"
_ATEN_COPY = "cat|stack|clone|contiguous|to|_to_copy|copy_|zero_|zeros|zeros_like|ones|fill_|full|constant_pad_nd"

KIND_RULES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|^c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"),
    ("optimizer", r"multi_tensor_apply|adam|_foreach_|^optimizer\."),
    ("gated_deltanet", r"gated_delta|delta_rule|chunk_(fwd|bwd)_kernel|chunk_local_cumsum|chunk_scaled_dot_kkt|"
                       r"recompute_w_u|prepare_wy|wy_fast|solve_tril|merge_16x16|l2norm_(fwd|bwd)|fused_recurrent|"
                       r"solve_triangular|trsm"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|flex|triton_tem_"),
    ("conv1d", r"causal_conv1d|conv_depthwise|conv[123]d|convolution|slow_conv|fprop|dgrad|wgrad|implicit_gemm|"
               r"convolve"),
    ("matmul", r"gemm|gemv|xmma|nvjet|s16816|s1688|wgmma|cutlass|cublas|splitk|"
               r"^aten::(mm|bmm|addmm|baddbmm|matmul|linear|dot|mv|addmv)$"),
    ("elementwise", r"rms_?norm|layer_?norm|group_?norm|triton_(per|red)_fused\w*rsqrt"),
    ("indexing", r"index|gather|scatter|embedding|masked_select|nonzero"),
    ("elementwise", r"^triton_poi_"),
    ("reduction", r"^triton_(per|red)_"),
    ("copy", rf"memcpy|memset|copy|catarray|(?<!masked_)fill|^aten::({_ATEN_COPY})$"),
    ("reduction", rf"reduce_kernel|softmax|logsumexp|cross_entropy|nll_loss|argmax|argmin|cub::|radix|sort|topk|"
                  rf"cumsum|^aten::({_ATEN_REDUCTION})$"),
    ("elementwise", rf"elementwise|vectorized|unrolled|silu|gelu|act_and_mul|"
                    rf"^aten::({_ATEN_ELEMENTWISE})(_backward)?_?$"),
)
_COMPILED = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KIND_RULES)


class Entry(NamedTuple):
    """One kernel's (or operator's) time and calls over the profiled steps."""
    name: str
    us: float
    count: int


def kernel_kind(name: str) -> str:
    """The kind of the first rule whose pattern `name` matches; 'other' when none does."""
    return next((kind for kind, pattern in _COMPILED if pattern.search(name)), "other")


def short_name(name: str, width: int = 200) -> str:
    """A kernel's name without the leading 'void ' and cut to `width` characters: a CUTLASS
    kernel's full template name runs to thousands."""
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 3] + "..."


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of `intervals` (start, end): time the device ran anything, with
    kernels overlapping on several streams (a copy beside a matmul) counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kind_table(entries: Iterable[Entry], steps: int, top: int = 5) -> list[dict[str, Any]]:
    """Per kind, heaviest first: ms and calls per step, share of all entries' time, and the `top`
    heaviest entries (names merged by `short_name`)."""
    by_kind: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in entries:
        acc = by_kind[kernel_kind(e.name)][short_name(e.name)]
        acc[0] += e.us
        acc[1] += e.count
    grand = sum(us for names in by_kind.values() for us, _ in names.values()) or 1.0
    rows = []
    for kind, names in by_kind.items():
        us, count = sum(v[0] for v in names.values()), sum(v[1] for v in names.values())
        heaviest = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
        rows.append({"kind": kind, "ms_per_step": round(us / 1e3 / steps, 3), "share": round(us / grand, 4),
                     "count_per_step": round(count / steps, 1),
                     "top": [{"name": n, "ms_per_step": round(v[0] / 1e3 / steps, 3),
                              "count_per_step": round(v[1] / steps, 1)} for n, v in heaviest]})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def profiler(cuda: bool) -> torch.profiler.profile:
    """A profiler of the host's operators and, on a GPU, its kernels and copies; no shapes or
    stacks, which would multiply the cost of a step that launches tens of thousands of kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)


def device_entries(prof: torch.profiler.profile) -> tuple[list[Entry], float]:
    """The device's kernels, copies and fills, summed by name, and the device's busy µs. The
    ranges of `record_function` (an optimiser's step) also show on the device's timeline, over
    kernels counted already: they are left out."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            spans.append((e.time_range.start, e.time_range.end))
            totals[e.name][0] += e.time_range.elapsed_us()
            totals[e.name][1] += 1
    return [Entry(n, us, int(c)) for n, (us, c) in totals.items()], busy_us(spans)


def cpu_entries(prof: torch.profiler.profile) -> list[Entry]:
    """The host's operators by their self time (a parent's time without its children's, so
    nested operators are not counted twice)."""
    return [Entry(a.key, a.self_cpu_time_total, a.count) for a in prof.key_averages() if a.self_cpu_time_total > 0]


def summarize(prof: torch.profiler.profile, cuda: bool, steps: int) -> dict[str, Any]:
    """The profile's kind table per step, what it measures ('activity'), the summed time of its
    entries and, on a GPU, the device's busy time per step."""
    if cuda:
        entries, busy = device_entries(prof)
        activity = "cuda kernels, copies and fills (time on the GPU)"
    else:
        entries, busy = cpu_entries(prof), None
        activity = "cpu operators (self CPU time): no GPU, so the kinds are about operators, not kernels"
    return {"activity": activity, "steps": steps,
            "summed_ms_per_step": round(sum(e.us for e in entries) / 1e3 / steps, 2),
            "device_busy_ms_per_step": None if busy is None else round(busy / 1e3 / steps, 2),
            "kinds": kind_table(entries, steps)}


def format_table(summary: dict[str, Any], name_width: int = 70) -> str:
    """The kind table as text: one line per kind with its heaviest entry."""
    lines = [f"{'kind':<16}{'ms/step':>10}{'share':>8}{'count/step':>12}  heaviest"]
    for k in summary["kinds"]:
        top = k["top"][0]["name"][:name_width] if k["top"] else ""
        lines.append(f"{k['kind']:<16}{k['ms_per_step']:>10.2f}{k['share']:>8.1%}{k['count_per_step']:>12.1f}  {top}")
    lines.append(f"({summary['activity']}; summed {summary['summed_ms_per_step']} ms/step, device busy "
                 f"{summary['device_busy_ms_per_step']} ms/step over {summary['steps']} profiled step(s))")
    return "\n".join(lines)
