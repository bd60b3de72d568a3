"""A Chrome trace that torch.profiler wrote elsewhere, read back into a Profile (`from_trace`):
kernels, ops, modules, phases and idle time, as far as the trace carries them.

The trace's events become objects shaped like the profiler's own (name, time range, parent,
children, the kernels each launch made, sequence numbers), so the attribution, idle and
ranking code runs on them unchanged. Modules come from perfloop's module ranges or, in a trace
recorded with `with_modules=True`, from its "nn.Module: X_0" events (class and instance
number, no qualified names). With `record_shapes=True` each op's input shapes and dtypes give
its FLOPs (matmuls) and the bytes of its inputs; outputs are not in the trace.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from torch.autograd import DeviceType

from perfloop.analysis import profiling
from perfloop.analysis.modules import PREFIX as MODULE

_CPU_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
_SIZES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1,
          "unsigned char": 1, "signed char": 1, "short int": 2, "c10::Float8_e4m3fn": 1,
          "c10::Float8_e5m2": 1}  # fmt: skip
_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}


@dataclass
class _Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass(eq=False)
class _Event:
    name: str
    device_type: DeviceType
    time_range: _Range
    thread: int = 0
    sequence_nr: int = -1
    fwd_thread: int = 0
    is_user_annotation: bool = False
    args: dict = field(default_factory=dict)
    cpu_parent: _Event | None = None
    cpu_children: list = field(default_factory=list)
    kernels: list = field(default_factory=list)


class TraceEvents:
    """What build_profile needs of a profiler: events()."""

    def __init__(self, events: list):
        self._events = events

    def events(self) -> list:
        return self._events

    def export_chrome_trace(self, path: str) -> None:
        raise RuntimeError("this Profile was read from a trace file: that file is its trace")


def read(path: str | os.PathLike) -> tuple[list, dict]:
    """(events, the trace's top-level fields) of a torch.profiler Chrome trace."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"trace: cannot read {path} as JSON ({exc})") from None
    raw = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        raise ValueError(f"trace: {path} is not a torch.profiler Chrome trace (no traceEvents list)")
    events, by_corr, launches = [], {}, []
    for r in raw:
        if not isinstance(r, dict) or r.get("ph") != "X" or "dur" not in r:
            continue
        cat, name, args = r.get("cat", ""), r.get("name", ""), r.get("args") or {}
        if cat == "python_function" and not name.startswith("nn.Module: "):
            continue
        if cat not in _CPU_CATS | _GPU_CATS:
            continue
        if name.startswith("nn.Module: "):
            name = MODULE + name[len("nn.Module: ") :]
        start = float(r["ts"])
        e = _Event(name=name, device_type=DeviceType.CUDA if cat in _GPU_CATS else DeviceType.CPU,
                   time_range=_Range(start, start + float(r["dur"])), thread=r.get("tid", 0),
                   sequence_nr=args.get("Sequence number", -1), fwd_thread=args.get("Fwd thread id", 0),
                   is_user_annotation=cat in ("user_annotation", "gpu_user_annotation", "python_function"),
                   args=args)  # fmt: skip
        events.append(e)
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in args:
            by_corr[args["correlation"]] = e
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches.append(e)
    for e in launches:
        k = by_corr.get(e.args["correlation"])
        if k is not None:
            e.kernels.append(k)
    _nest([e for e in events if e.device_type == DeviceType.CPU])
    return events, {k: v for k, v in doc.items() if k != "traceEvents"}


def _nest(cpu: list) -> None:
    """Each CPU event's parent: the innermost event of its thread that encloses it."""
    by_thread: dict = {}
    for e in cpu:
        by_thread.setdefault(e.thread, []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list = []
        for e in evs:
            while stack and stack[-1].time_range.end < e.time_range.end:
                stack.pop()
            if stack:
                e.cpu_parent = stack[-1]
                stack[-1].cpu_children.append(e)
            stack.append(e)


def _numel(dims) -> int:
    return math.prod(dims) if isinstance(dims, list) and all(isinstance(d, int) for d in dims) else 0


def op_work(e) -> tuple[float, float, str] | None:
    """(FLOPs, bytes of its inputs, dtype) of an op from the shapes in the trace; None without."""
    dims, types = e.args.get("Input Dims"), e.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    tensors = [(d, t) for d, t in zip(dims, types, strict=False) if t in _SIZES and isinstance(d, list) and d]
    nbytes = float(sum(_numel(d) * _SIZES[t] for d, t in tensors))
    name = e.name.split("::")[-1]
    shapes = [d for d, _ in tensors]
    flops = 0.0
    if name in ("mm", "addmm") and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]
        if len(a) == 2 and len(b) == 2:
            flops = 2.0 * a[0] * a[1] * b[1]
    elif name in ("bmm", "baddbmm") and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]
        if len(a) == 3 and len(b) == 3:
            flops = 2.0 * a[0] * a[1] * a[2] * b[2]
    dtype = _DTYPES.get(tensors[0][1], "") if tensors else ""
    return flops, nbytes, dtype


def work_by_key(events, kind: str, spans=None) -> dict:
    """(module, phase, op) -> [flops, input bytes, dtype], each launching op counted once (with
    `spans`, those launched inside them). On a CPU the outermost ops are the work: each carries
    its own input bytes and the FLOPs of the matmuls inside it."""
    from perfloop.analysis.attribution import _context, _seq_modules, cpu_ops

    seq_module = _seq_modules(events)
    out: dict = {}
    if kind == "cuda":
        pairs, seen = [], set()
        for e in events:
            if e.device_type != DeviceType.CPU or not e.kernels:
                continue
            op_event = e
            while op_event is not None and "::" not in op_event.name:
                op_event = op_event.cpu_parent
            if op_event is not None and id(op_event) not in seen:
                seen.add(id(op_event))
                pairs.append((e, op_event, op_work(op_event)))
    else:
        pairs = []
        for e in cpu_ops(events):
            w = op_work(e)
            if w is not None:
                flops = w[0] + sum((op_work(c) or (0.0,))[0] for c in _subtree(e))
                pairs.append((e, e, (flops, w[1], w[2])))
    for e, op_event, w in pairs:
        if w is None or (spans and not any(s <= op_event.time_range.start <= t for s, t in spans)):
            continue
        op, module, phase, _ = _context(e, seq_module)
        acc = out.setdefault((module, phase, op), [0.0, 0.0, ""])
        acc[0] += w[0]
        acc[1] += w[1]
        acc[2] = acc[2] or w[2]
    return out


def _subtree(e):
    for c in e.cpu_children:
        yield c
        yield from _subtree(c)


def from_trace(path: str | os.PathLike) -> profiling.Profile:
    """A Profile of a Chrome trace torch.profiler wrote (export_chrome_trace, tensorboard's
    handler): kernels, ops, modules, phases, idle; FLOPs and bytes where it has shapes. With
    torch.profiler's step() ranges (ProfilerStep#N) each is one call."""
    events, meta = read(path)
    warnings: list[str] = []
    on_cuda = any(e.device_type == DeviceType.CUDA for e in events)
    if not any("::" in e.name for e in events):
        raise ValueError(f"trace: {path} holds no operator events: it is not a torch.profiler trace")
    steps = [e for e in events if e.name.startswith("ProfilerStep#") and e.device_type == DeviceType.CPU]
    cpu = [e.time_range for e in events if e.device_type == DeviceType.CPU]
    span_ms = (max(r.end for r in cpu) - min(r.start for r in cpu)) / 1e3
    p = profiling.build_profile(TraceEvents(events), max(len(steps), 1), span_ms, span_ms, on_cuda, warnings,
                      range_name="ProfilerStep#*" if steps else None)  # fmt: skip
    if not meta.get("record_shapes") and not any("Input Dims" in e.args for e in events):
        warnings.append("the trace has no shapes (record it with record_shapes=True): time by kernel, op, "
                        "module and category, and idle time, but no FLOPs, bytes or roofline")  # fmt: skip
    else:
        p._given_work = work_by_key(p._prof.events(), p.kind, p._windows)
        warnings.append("FLOPs and bytes from the trace's input shapes: matmul FLOPs, and the bytes of each "
                        "op's inputs (its outputs are not in the trace)")  # fmt: skip
    return p
