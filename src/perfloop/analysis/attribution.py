"""Where a profile's device time went, by kernel, by the aten op that launched each kernel, or
by category of work -- from the kernel list the profiler keeps for each op (linked through the
launch's correlation id), not from matching names.

    >>> p = pl.profile(step)                       # doctest: +SKIP
    >>> p.breakdown(by="category")[0]              # doctest: +SKIP
    Row(name='elementwise', calls=8, device_ms=0.71, share=0.62)
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from dataclasses import dataclass

from torch.autograd import DeviceType

BY = ("kernel", "op", "category")

# (category, pattern over the op's or kernel's lower-cased name); the first match wins
CATEGORIES = [
    ("memcpy/memset", r"memcpy|memset"),
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|gloo"),
    ("optimizer", r"adam|sgd|lamb|foreach|multi_tensor|fused_adam|optimizer"),
    ("attention", r"scaled_dot_product|flash|fmha|attention|\bsdpa"),
    ("matmul", r"\bmm\b|addmm|bmm|matmul|linear|gemm|cutlass|xmma|sm\d+_|cublas|wgmma|conv"),
    ("normalization", r"layer_norm|rms_norm|batch_norm|group_norm|norm_"),
    ("dtype cast/copy", r"copy_|_to_copy|\bto\b|cast|contiguous|clone"),
    ("reduction", r"sum|mean|max|min|softmax|reduce|argmax|norm\b|logsumexp"),
    ("elementwise", r"add|mul|sub|div|gelu|relu|silu|tanh|exp|pow|sigmoid|where|elementwise|vectorized|fill"),
]


@dataclass(frozen=True)
class Row:
    name: str
    calls: int
    device_ms: float  # over all the profiled calls
    share: float  # of the profile's attributed time


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def _launcher(e) -> str:
    """The op a kernel list belongs to: the event itself, or for a runtime call that made the
    launch (cudaStreamIsCapturing, ...), the nearest enclosing op (a name with "::")."""
    while "::" not in e.name and e.cpu_parent is not None:
        e = e.cpu_parent
    return e.name


def _device_items(events, ranges: set[str]) -> list[tuple[str, str, float]]:
    """(kernel, op, ms) for each kernel recorded on the device, its op from the kernel lists
    the profiler keeps per op (each kernel linked to one op by its launch's correlation id),
    matched to the device's own records name by name in launch order; the times are the
    device's. Activity no op's list holds (a graph replay, NCCL, the runtime's own memcpy)
    comes with op ''."""
    ops: dict[str, deque] = defaultdict(deque)
    for e in sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start):
        for k in getattr(e, "kernels", ()) or ():
            ops[k.name].append(_launcher(e))
    device = [e for e in events if e.device_type == DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and e.name not in ranges]  # fmt: skip
    out = []
    for e in sorted(device, key=lambda e: e.time_range.start):
        op = ops[e.name].popleft() if ops[e.name] else ""
        out.append((e.name, op, e.time_range.elapsed_us() / 1e3))
    return out


def _cpu_items(events) -> list[tuple[str, str, float]]:
    """On a CPU the ops are the work: (op, op, ms) for each top-level op."""
    top = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return [(e.name, e.name, e.time_range.elapsed_us() / 1e3) for e in top]


def breakdown(events, by: str, kind: str, ranges: set[str] = frozenset()) -> list[Row]:
    """Rows of device time by `by` ("kernel", "op" or "category"), largest first; every kernel
    is counted once, those no op launched under "(no op) <kernel>"."""
    if by not in BY:
        raise ValueError(f"by: {by!r} is not one of {', '.join(BY)}")
    items = _device_items(events, ranges) if kind == "cuda" else _cpu_items(events)
    agg: dict[str, list] = {}
    for kernel, op, ms in items:
        if by == "kernel":
            key = kernel
        elif by == "op":
            key = op or f"(no op) {kernel}"
        else:
            key = category(op or kernel)
        a = agg.setdefault(key, [0, 0.0])
        a[0] += 1
        a[1] += ms
    total = sum(v[1] for v in agg.values()) or 1e-12
    rows = [Row(name=k, calls=c, device_ms=t, share=t / total) for k, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r.device_ms)
