"""A Chrome trace that torch.profiler wrote elsewhere, read back into a Profile (`from_trace`):
kernels, ops, modules, phases and idle time, as far as the trace carries them.

The trace's events become objects shaped like the profiler's own (name, time range, parent,
children, the kernels each launch made, sequence numbers), so the attribution, idle and
ranking code runs on them unchanged. Modules come from perfloop's module ranges or, in a trace
recorded with `with_modules=True`, from its "nn.Module: X_0" events (class and instance
number, no qualified names). With `record_shapes=True` each op's input shapes and dtypes give
its FLOPs (matmuls) and the bytes of its inputs; outputs are not in the trace.

The file (plain or gzipped JSON) is streamed, one event at a time: a malformed event stops the
read with its index; of a trace with more events than `MAX_EVENTS` worth keeping, the leading
whole ProfilerStep ranges (or the leading span) that fit are kept, with a warning, so memory
stays bounded whatever the file's size.
"""

from __future__ import annotations

import bisect
import gzip
import heapq
import io
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch.autograd import DeviceType

from perfloop.analysis import profiling
from perfloop.analysis.modules import PREFIX as MODULE
from perfloop.analysis.spans import Spans
from perfloop.analysis.work import shape_work

_CPU_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
_KEPT_ARGS = ("Sequence number", "Fwd thread id", "correlation", "Input Dims", "Input type")
MAX_EVENTS = 400_000  # events kept for the analysis (a few hundred bytes each); the rest are cut
_MAX_TS_US = 1e17  # microseconds (some 3000 years): beyond, a timestamp is corrupt
_MAX_VALUE_CHARS = 64 << 20  # one JSON value (an event) larger than this: the file is malformed


@dataclass(slots=True)
class _Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass(eq=False, slots=True)
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
    cpu_children: list | tuple = ()  # a list once it has one (most events have none: no list each)
    kernels: list | tuple = ()


class TraceEvents:
    """What build_profile needs of a profiler: events()."""

    def __init__(self, events: list):
        self._events = events

    def events(self) -> list:
        return self._events

    def export_chrome_trace(self, path: str) -> None:
        raise RuntimeError("this Profile was read from a trace file: that file is its trace")


def _open(path) -> tuple:
    """(text stream, the raw file under it) of the file, gzipped (by its magic bytes, as torch
    writes .json.gz) or not; the raw file's position is how far the read has come."""
    raw = open(path, "rb")  # noqa: SIM115 (the caller closes it, after the stream over it)
    gz = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    return io.TextIOWrapper(gzip.GzipFile(fileobj=raw) if gz else raw, encoding="utf-8"), raw


class _Stream:
    """JSON values read one at a time from a text stream, in chunks: the memory held is the
    chunk and the value being read, not the file."""

    _ws = " \t\n\r"

    def __init__(self, f, chunk: int = 1 << 20, on_read: Callable[[], None] | None = None):
        self.f, self.chunk, self.buf, self.pos, self.eof = f, chunk, "", 0, False
        self.decoder = json.JSONDecoder()
        self.on_read = on_read

    def _fill(self) -> bool:
        data = self.f.read(self.chunk)
        if self.on_read is not None:
            self.on_read()
        if not data:
            self.eof = True
            return False
        self.buf, self.pos = self.buf[self.pos :] + data, 0
        return True

    def peek(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in self._ws:
                self.pos += 1
            if self.pos < len(self.buf) or not self._fill():
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def expect(self, chars: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise json.JSONDecodeError(f"expected one of {chars!r}", self.buf, self.pos)
        self.pos += 1
        return c

    def value(self):
        self.peek()
        while True:
            try:
                v, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof or not self._fill():  # a number may go on
                    self.pos = end
                    return v
            except RecursionError:  # arrays or objects nested past Python's recursion limit
                raise json.JSONDecodeError("a value nested too deeply to read", self.buf, self.pos) from None
            except json.JSONDecodeError:
                if len(self.buf) - self.pos > _MAX_VALUE_CHARS or self.eof or not self._fill():
                    raise


def _records(path, meta: dict, progress: Callable[[int, int], None] | None) -> Iterator[tuple[int, dict]]:
    """(index, event) of the trace's traceEvents, streamed; its other top-level fields go to `meta`."""
    size = os.path.getsize(path)
    try:
        f, raw = _open(path)
        with f, raw:
            s = _Stream(f, on_read=(lambda: progress(raw.tell(), size)) if progress else None)
            if s.expect("{[") == "[":  # the JSON Array Format: the events alone; the "]" may be missing
                yield from _array(s)
                return
            found = False
            while s.peek() != "}":
                key = s.value()
                s.expect(":")
                if key != "traceEvents":
                    meta[key] = s.value()
                else:
                    found = True
                    s.expect("[")
                    if s.peek() == "]":
                        s.expect("]")
                    else:
                        for i in itertools.count():  # values, each followed by "," or the closing "]"
                            yield i, s.value()
                            if s.expect(",]") == "]":
                                break
                if s.expect(",}") == "}":
                    break
    except (UnicodeDecodeError, json.JSONDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise ValueError(f"trace: cannot read {path} as JSON (plain or gzipped) ({exc})") from None
    else:
        if not found:
            raise ValueError(f"trace: {path} is not a torch.profiler Chrome trace (no traceEvents list)")


def _array(s: _Stream) -> Iterator[tuple[int, dict]]:
    """(index, event) of a trace in the JSON Array Format, whose closing "]" the Trace Event
    Format lets a writer leave out (a trace cut short by a crash)."""
    if s.peek() in ("]", ""):
        return
    for i in itertools.count():
        yield i, s.value()
        if s.peek() == "" or s.expect(",]") == "]":
            return
        if s.peek() in ("]", ""):  # a trailing comma before the end
            return


def _number(r: dict, key: str, i: int, low: float, high: float) -> float:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low <= v <= high):
        what = "missing" if key not in r else f"{v!r}"
        raise ValueError(
            f"trace: event {i} ({r.get('name', '?')!r}): {key!r} is {what}; it must be a "
            f"finite number of microseconds in [{low:g}, {high:g}]"
        )
    return float(v)


def _wanted(i: int, r) -> tuple | None:
    """(cat, name, args, ts, dur) of an event the analysis uses, checked; None for the others.
    A malformed event raises ValueError with its index."""
    if not isinstance(r, dict):
        raise ValueError(f"trace: event {i} is a {type(r).__name__}, not an object")
    if r.get("ph") != "X":
        return None
    cat, name, args = r.get("cat", ""), r.get("name", ""), r.get("args", {})
    if cat not in _CPU_CATS | _GPU_CATS:
        return None
    if not isinstance(name, str) or not isinstance(cat, str):
        raise ValueError(f"trace: event {i}: 'name' and 'cat' must be strings, got {name!r}, {cat!r}")
    if not isinstance(args, dict):
        raise ValueError(
            f"trace: event {i} ({name!r}): 'args' is a {type(args).__name__}; it must be an object"
        )
    ts = _number(r, "ts", i, -_MAX_TS_US, _MAX_TS_US)
    dur = _number(r, "dur", i, 0.0, _MAX_TS_US)
    if cat == "python_function" and not name.startswith("nn.Module: "):
        return None
    return cat, name, args, ts, dur


def _frozen(v):
    """Lists as tuples (smaller; shapes repeat)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def read(
    path: str | os.PathLike, progress: Callable[[int, int], None] | None = None
) -> tuple[list, dict, list[str]]:
    """(events, the trace's top-level fields, warnings) of a torch.profiler Chrome trace, plain or
    gzipped, streamed. `progress(bytes read, file size)` is called as it reads."""
    meta: dict = {}
    try:
        big = os.path.getsize(path) > 64 << 20
    except OSError as exc:
        raise ValueError(f"trace: cannot read {path} ({exc})") from None
    warnings: list[str] = []
    cutoff = math.inf
    if big:  # a first pass: how many events, where the steps start, the MAX_EVENTS earliest starts
        earliest, steps, n = [], [], 0  # earliest: a max-heap (negated) of at most MAX_EVENTS + 1
        for i, r in _records(path, meta, progress):
            w = _wanted(i, r)
            if w is None:
                continue
            n += 1
            if len(earliest) <= MAX_EVENTS:
                heapq.heappush(earliest, -w[3])
            elif -w[3] > earliest[0]:
                heapq.heapreplace(earliest, -w[3])
            if w[1].startswith("ProfilerStep#") and w[0] == "user_annotation":
                steps.append(w[3])
        if n > MAX_EVENTS:
            cutoff = -earliest[0]  # the (MAX_EVENTS + 1)-th earliest start: events before it fit
            steps.sort()
            k = bisect.bisect_right(steps, cutoff) - 1
            cutoff = steps[k] if k >= 1 else cutoff  # whole steps only, where one fits
            kept = bisect.bisect_left(steps, cutoff)
            warnings.append(
                f"the trace holds {n:,} events: kept the first {MAX_EVENTS:,} or fewer "
                + (
                    f"(its first {kept} of {len(steps)} ProfilerStep ranges)"
                    if kept
                    else "(its leading span)"
                )
                + " to keep memory bounded; write a shorter trace for the rest"
            )
        del earliest
        meta.clear()
    events, by_corr, launches, corr_kept = [], {}, [], set()
    for i, r in _records(path, meta, None if big else progress):
        w = _wanted(i, r)
        if w is None:
            continue
        cat, name, args, start, dur = w
        corr = args.get("correlation")
        if start >= cutoff and not (cat in _GPU_CATS and corr in corr_kept):
            continue
        if name.startswith("nn.Module: "):
            name = MODULE + name[len("nn.Module: ") :]
        args = {k: _frozen(args[k]) for k in _KEPT_ARGS if k in args}
        e = _Event(
            name=sys.intern(name),
            device_type=DeviceType.CUDA if cat in _GPU_CATS else DeviceType.CPU,
            time_range=_Range(start, start + dur),
            thread=r.get("tid", 0),
            sequence_nr=args.get("Sequence number", -1),
            fwd_thread=args.get("Fwd thread id", 0),
            is_user_annotation=cat in ("user_annotation", "gpu_user_annotation", "python_function"),
            args=args,
        )
        events.append(e)
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and corr is not None:
            by_corr[corr] = e
        elif cat in ("cuda_runtime", "cuda_driver") and corr is not None:
            launches.append(e)
            if cutoff < math.inf:
                corr_kept.add(corr)
    for e in launches:
        k = by_corr.get(e.args["correlation"])
        if k is not None:
            e.kernels = [*e.kernels, k]
    _nest([e for e in events if e.device_type == DeviceType.CPU])
    return events, meta, warnings


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
                if not stack[-1].cpu_children:
                    stack[-1].cpu_children = []
                stack[-1].cpu_children.append(e)
            stack.append(e)


def op_work(e) -> tuple[float, float, str] | None:
    """(FLOPs, bytes of its inputs, dtype) of an op from the shapes in the trace; None without."""
    dims, types = e.args.get("Input Dims"), e.args.get("Input type")
    if not isinstance(dims, (list, tuple)) or not isinstance(types, (list, tuple)):
        return None
    return shape_work(e.name, dims, types)


def work_by_key(events, kind: str, spans=None) -> dict:
    """(module, phase, op) -> [flops, input bytes, dtype], each launching op counted once (with
    `spans`, those launched inside them). On a CPU the outermost ops are the work: each carries
    its own input bytes and the FLOPs of the matmuls inside it."""
    from perfloop.analysis.attribution import call_context, cpu_ops, descendants, seq_modules

    seq_module = seq_modules(events)
    inside = Spans(spans) if spans else None
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
                flops = w[0] + sum((op_work(c) or (0.0,))[0] for c in descendants(e))
                pairs.append((e, e, (flops, w[1], w[2])))
    for e, op_event, w in pairs:
        if w is None or (inside is not None and op_event.time_range.start not in inside):
            continue
        op, module, phase, _ = call_context(e, seq_module)
        acc = out.setdefault((module, phase, op), [0.0, 0.0, ""])
        acc[0] += w[0]
        acc[1] += w[1]
        acc[2] = acc[2] or w[2]
    return out


def from_trace(
    path: str | os.PathLike, progress: Callable[[int, int], None] | None = None
) -> profiling.Profile:
    """A Profile of a Chrome trace torch.profiler wrote (export_chrome_trace, tensorboard's
    handler): kernels, ops, modules, phases, idle; FLOPs and bytes where it has shapes. With
    torch.profiler's step() ranges (ProfilerStep#N) each is one call."""
    events, meta, warnings = read(path, progress)
    on_cuda = any(e.device_type == DeviceType.CUDA for e in events)
    if not any("::" in e.name for e in events):
        raise ValueError(f"trace: {path} holds no operator events: it is not a torch.profiler trace")
    steps = [e for e in events if e.name.startswith("ProfilerStep#") and e.device_type == DeviceType.CPU]
    cpu = [e.time_range for e in events if e.device_type == DeviceType.CPU]
    span_ms = (max(r.end for r in cpu) - min(r.start for r in cpu)) / 1e3
    shapes = meta.get("record_shapes") or any("Input Dims" in e.args for e in events)
    p = profiling.build_profile(
        profiling.Recording(
            TraceEvents(events),
            max(len(steps), 1),
            span_ms,
            span_ms,
            on_cuda,
            warnings,
            range_name="ProfilerStep#*" if steps else None,
            given_work=work_by_key if shapes else None,
            # each step's wait for its first kernel is the user's (data, Python)
            step="ProfilerStep" if steps else None,
        )
    )
    if not shapes:
        warnings.append(
            "the trace has no shapes (record it with record_shapes=True): time by kernel, op, "
            "module and category, and idle time, but no FLOPs, bytes or roofline"
        )
    else:
        warnings.append(
            "FLOPs and bytes from the trace's input shapes: matmul FLOPs, and the bytes of each "
            "op's inputs (its outputs are not in the trace)"
        )
    warnings.append(
        "idle and host time as the trace recorded them, under torch.profiler, whose cost per op "
        "slows the host and lengthens its gaps: the host causes' savings are upper bounds; "
        "`perfloop profile --script` times the steps unprofiled too"
    )
    return p
