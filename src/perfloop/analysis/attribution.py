"""Where a profile's device time went: by kernel, by the aten op that launched each kernel, by
the nn.Module that ran it, or by category of work.

Each kernel's op comes from the kernel list the profiler keeps for each launch (linked through
the launch's correlation id), not from matching names; its module from the module range
around the op (`modules.module_ranges`); a backward kernel is charged to the module whose
forward op created its autograd node (the node's sequence number is the forward op's), and
optimizer kernels to "optimizer". On a CPU the outermost ops are the work.

    >>> p = pl.profile(step)                       # doctest: +SKIP
    >>> p.breakdown(by="module")[0]                # doctest: +SKIP
    Row(name='transformer.h.0.mlp.c_fc', calls=4, device_ms=0.71, share=0.12, ...)
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from dataclasses import dataclass, replace

from torch.autograd import DeviceType

from perfloop.analysis import roofline
from perfloop.analysis.bound import Bound
from perfloop.analysis.inductor import COMPILED_OP, Replayed, fused_ops, kernel_name, launch_work
from perfloop.analysis.modules import PREFIX as MODULE
from perfloop.analysis.spans import Spans
from perfloop.analysis.work import MARKER

BY = ("module", "op", "kernel", "category")
BACKWARD = "autograd::engine::evaluate_function: "
OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
NO_MODULE = "(no module)"
REPLAY_OP = "(CUDA graph)"  # a replayed kernel's op where no compiled graph says which call it is
GRAPH_LAUNCH = "cudaGraphLaunch"
# a launch under these ran compiled code (a Dynamo region alone does not: pl.patch runs its rewrites eager)
COMPILED = ("CompiledFunction", "## Call CompiledFxGraph")
WORK_FROM = "flops: torch's formulas; bytes: the op's tensors"

# (category, pattern over the op's or kernel's lower-cased name); the first match wins
CATEGORIES = [
    ("memcpy/memset", r"memcpy|memset"),
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|gloo"),
    ("optimizer", r"adam|sgd|lamb|foreach|multi_tensor|fused_adam|optimizer"),
    ("attention", r"scaled_dot_product|flash|fmha|attention|\bsdpa"),
    ("matmul", r"\bmm\b|addmm|bmm|matmul|linear|gemm|cutlass|xmma|sm\d+_|cublas|wgmma|conv"),
    ("normalization", r"layer_norm|rms_norm|batch_norm|group_norm|norm_|perfloop::norm"),
    ("dtype cast/copy", r"copy_|_to_copy|\bto\b|cast|contiguous|clone"),
    ("reduction", r"sum|mean|max|min|softmax|reduce|argmax|norm\b|logsumexp|nll_loss|cross_entropy"),
    (
        "elementwise",
        r"add|mul|sub|div|gelu|relu|silu|tanh|exp|pow|sigmoid|where|elementwise|vectorized|fill|sqrt|lerp"
        r"|gated|swiglu|geglu",
    ),
]


@dataclass(frozen=True)
class Item:
    """One kernel on a GPU (one outermost op on a CPU) and where it came from."""

    kernel: str
    op: str  # the aten op that launched it, "" if none
    module: str
    phase: str  # "forward", "backward", "optimizer"
    ms: float
    start_us: float
    end_us: float
    markers: tuple = ()  # indices of the WorkCounter records behind it
    launch_us: float = 0.0  # when the host launched it (a CPU op: its start)
    outer_op: str = ""  # the outermost op around `op` (aten::contiguous around aten::copy_)
    line: str = ""  # a compiled kernel's source line ("model.py:42")
    work: tuple | None = None  # (flops, bytes, dtype) from its launch's recorded arguments
    replayed: bool = False  # run by a CUDA graph's replay (no launch of its own)


@dataclass(frozen=True)
class Row:
    name: str
    calls: int
    device_ms: float  # over all the profiled calls
    share: float  # of the profile's attributed time
    backward_ms: float = 0.0
    flops: float | None = None  # estimated, over all the profiled calls
    bytes: float | None = None
    dtype: str = ""
    work_from: str = ""  # how flops and bytes were obtained
    # from the measured ceilings (roofline.apply)
    gbps: float | None = None
    tflops: float | None = None
    intensity: float | None = None
    of_copy: float | None = None
    of_matmul: float | None = None
    bound: Bound | None = None  # against its roofline; None without bytes
    headroom_ms: float | None = None  # its time minus its time at the ceiling
    note: str = ""


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def _ancestors(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def _is_op(e) -> bool:
    if kernel_name(e.name):  # an Inductor kernel's launch
        return True
    return "::" in e.name and not e.name.startswith(BACKWARD) and not getattr(e, "is_user_annotation", False)


def call_context(e, seq_module: dict) -> tuple[str, str, str, tuple]:
    """(op, module, phase, markers) for a runtime call or op event, from the events around it."""
    op = module = ""
    phase = "forward"
    markers = []
    for a in _ancestors(e):
        name = a.name
        if not op and kernel_name(name):
            op = f"{COMPILED_OP} {kernel_name(name)}"
        elif not op and "::" in name and not name.startswith(BACKWARD):
            op = name
        elif not op and name.startswith(COMPILED):
            op = COMPILED_OP
        if name.startswith(MARKER):
            markers.append(int(name[len(MARKER) :]))
        elif not module and name.startswith(MODULE):
            module = name[len(MODULE) :]
        elif name.startswith(BACKWARD):
            phase = "backward"
            module = module or seq_module.get(a.sequence_nr, NO_MODULE)
            break
        elif name.startswith(OPTIMIZER):
            phase, module = "optimizer", "optimizer"
            break
    return op, module or NO_MODULE, phase, tuple(markers[:1])


def seq_modules(events) -> dict:
    """Sequence number of each forward op -> the module it ran in. (Sequence numbers count per
    forward thread; a training step has one.)"""
    out = {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.sequence_nr is None or e.sequence_nr < 0:
            continue
        chain = list(_ancestors(e))
        if any(a.name.startswith(BACKWARD) for a in chain):
            continue
        module = next((a.name[len(MODULE) :] for a in chain if a.name.startswith(MODULE)), NO_MODULE)
        if out.get(e.sequence_nr, NO_MODULE) == NO_MODULE:
            out[e.sequence_nr] = module
    return out


def annotations(events) -> set[str]:
    """Names of record_function ranges (annotate, modules, markers); their GPU-side mirrors
    share the name and are not work."""
    return {e.name for e in events if getattr(e, "is_user_annotation", False)}


def device_events(events, ranges: set[str]) -> list:
    return [
        e
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name not in ranges
    ]


def cpu_ops(events) -> list:
    """The outermost op events: ops with no op around them (ranges and autograd's own
    events do not count as ops)."""
    out = []
    for e in events:
        if (
            e.device_type == DeviceType.CPU
            and _is_op(e)
            and not any(_is_op(a) for a in _ancestors(e.cpu_parent))
        ):
            out.append(e)
    return out


def windows(events, name: str) -> list[tuple[float, float]]:
    """The host-side intervals of every occurrence of the range `name` (a name ending in "*":
    every range whose name starts so)."""
    hit = (lambda n: n.startswith(name[:-1])) if name.endswith("*") else (lambda n: n == name)
    return sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and hit(e.name)
    )


def within(its: list[Item], spans: list[tuple[float, float]]) -> list[Item]:
    """The items launched inside one of `spans`."""
    inside = Spans(spans)
    return [i for i in its if i.launch_us in inside]


def fastest_of_calls(its: list[Item], spans: list[tuple[float, float]]) -> list[Item]:
    """On a CPU, where another process's time slices land inside whichever op was running: each
    op timed as its fastest over the calls in `spans` (the n-th op of every call, where all the
    calls ran the same ops in the same order; else `its` unchanged)."""
    per_call = [[i for i in its if s <= i.launch_us <= e] for s, e in spans]
    shape = [(i.op, i.module, i.phase) for i in per_call[0]] if per_call else []
    if len(per_call) < 2 or any([(i.op, i.module, i.phase) for i in c] != shape for c in per_call[1:]):
        return its
    fastest = [min(c[n].ms for c in per_call) for n in range(len(shape))]
    return [replace(i, ms=fastest[n]) for c in per_call for n, i in enumerate(c)]


def items(events, kind: str, placed: dict | None = None, replays=None) -> list[Item]:
    """Every kernel recorded on the device (every outermost op on a CPU), in time order, with
    its op, module and phase. A kernel no op's list holds (a graph replay, NCCL, the runtime's
    own memcpy) keeps op ''. `placed`: id of a compiled graph's launching event -> its
    findings.Site (inductor.placements), the module and line its kernels are charged to;
    `replays` (inductor.replays): what a CUDA graph's replayed kernels are, read against the
    compiled graphs (without it they keep the op "(CUDA graph)")."""
    seq_module = seq_modules(events)
    placed = placed or {}
    if kind != "cuda":
        out = []
        for e in cpu_ops(events):
            op, module, phase, _ = call_context(e, seq_module)
            marks = tuple(int(c.name[len(MARKER) :]) for c in descendants(e) if c.name.startswith(MARKER))
            r, at, kernel = e.time_range, placed.get(id(e)), kernel_name(e.name)
            out.append(
                Item(
                    kernel or e.name,
                    op,
                    at.module if at else module,
                    phase,
                    r.elapsed_us() / 1e3,
                    r.start,
                    r.end,
                    marks,
                    r.start,
                    e.name,
                    at.line if at else "",
                    launch_work(e) if kernel else None,
                )
            )
        return sorted(out, key=lambda i: i.start_us)
    launches: dict[str, deque] = defaultdict(deque)
    for e in sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start):
        for k in getattr(e, "kernels", ()) or ():
            launches[k.name].append(e)
    dev = sorted(device_events(events, annotations(events)), key=lambda e: e.time_range.start)
    launch_of = [launches[d.name].popleft() if launches[d.name] else None for d in dev]
    read = _replays(dev, launch_of, replays)
    out, worked = [], set()
    for n, (d, launch) in enumerate(zip(dev, launch_of, strict=True)):
        if launch is not None:
            op, module, phase, marks = call_context(launch, seq_module)
        else:
            op, module, phase, marks = "", NO_MODULE, "forward", ()
        at = next((placed[id(a)] for a in _ancestors(launch) if id(a) in placed), None)
        unit = next((a for a in _ancestors(launch) if kernel_name(a.name)), None)  # ops: the WorkCounter's
        work = None
        if unit is not None and id(unit) not in worked:  # a launch's work counted once, with its first kernel
            worked.add(id(unit))
            work = launch_work(unit)
        start = _launched(launch, d.time_range.start) if launch else d.time_range.start
        r, outer = d.time_range, _outer_op(launch) if launch else ""
        module, line = (at.module, at.line) if at else (module, "")
        item = Item(
            d.name, op, module, phase, r.elapsed_us() / 1e3, r.start, r.end, marks, start, outer, line, work
        )
        out.append(_as_replayed(item, read[n]) if n in read else item)
    return out


def _is_replay(launch) -> bool:
    """Whether a kernel's launching event is a CUDA graph's replay (cudaGraphLaunch, or the
    event just around it)."""
    return launch.name.startswith(GRAPH_LAUNCH) or any(
        c.name.startswith(GRAPH_LAUNCH) for c in launch.cpu_children
    )


def _replays(dev: list, launch_of: list, replays) -> dict[int, Replayed | None]:
    """Index of each replayed kernel -> what the compiled graph says of it (None where nothing
    does): each replay's kernels, in the order the device ran them, read together."""
    groups: dict[int, list[int]] = defaultdict(list)
    replay: dict[int, bool] = {}  # each launching event looked at once: a replay's holds every kernel
    for n, launch in enumerate(launch_of):
        if launch is not None and replay.setdefault(id(launch), _is_replay(launch)):
            groups[id(launch)].append(n)
    out: dict[int, Replayed | None] = {}
    for idx in groups.values():
        got = replays([dev[n].name for n in idx]) if replays is not None else [None] * len(idx)
        out.update(zip(idx, got, strict=True))
    return out


def _as_replayed(item: Item, rep: Replayed | None) -> Item:
    """A replayed kernel's row: its op the graph's call it is (aten::mm, a Triton kernel), its
    module and line where the graph's sources say, its work where known."""
    op = item.op if item.op and item.op != COMPILED_OP else REPLAY_OP
    if rep is None:
        return replace(item, op=op, replayed=True)
    if rep.key.startswith("extern:"):
        op = f"aten::{rep.key.removeprefix('extern:')}"
    elif rep.key:
        op = f"{COMPILED_OP} {rep.key}"
    site = rep.site
    return replace(
        item,
        op=op,
        module=site.module if site else item.module,
        line=site.line if site else item.line,
        work=rep.work,
        replayed=True,
    )


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
LAUNCH_APIS = (*KERNEL_LAUNCHES, "cudaMemcpyAsync", "cudaMemsetAsync")  # what puts work on a stream


def _outer_op(e) -> str:
    """The outermost op around event e, inside its module and phase."""
    outer = ""
    for a in _ancestors(e):
        if a.name.startswith((BACKWARD, *OPTIMIZER, MODULE)):
            break
        if "::" in a.name:
            outer = a.name
    return outer


def _launched(op, kernel_start: float) -> float:
    """When the host launched a kernel of `op`: the last launch call under the op that began
    before the kernel did (the op's start where none is recorded)."""
    starts = [
        c.time_range.start
        for c in descendants(op)
        if c.name.startswith(LAUNCH_APIS) and c.time_range.start <= kernel_start
    ]
    return max(starts) if starts else op.time_range.start


def descendants(e):
    """Every CPU event under e, depth first; a stack, not recursion: traces nest deeper than
    Python's recursion limit."""
    stack = list(reversed(e.cpu_children))
    while stack:
        c = stack.pop()
        yield c
        stack.extend(reversed(c.cpu_children))


def key_of(item: Item, by: str, depth: int | None = None) -> str:
    if by == "kernel":
        return item.kernel
    if by == "op":
        if item.op.startswith(COMPILED_OP + " "):
            return item.op
        if item.op in (COMPILED_OP, REPLAY_OP):
            return f"{item.op} {item.kernel}"
        return item.op or f"(no op) {item.kernel}"
    if by == "op/phase":
        return f"{item.op or '(no op) ' + item.kernel} ({item.phase})"
    if by == "module":
        if depth and item.module not in (NO_MODULE, "optimizer"):
            return ".".join(item.module.split(".")[:depth])
        return item.module
    return category(item.op or item.kernel)


def group(
    its: list[Item],
    by: str,
    depth: int | None = None,
    work: dict | None = None,
    ceilings: dict | None = None,
    l2_bytes: int = 0,
) -> list[Row]:
    """Rows of time by `by`, largest first; with `work` ((module, phase, op) -> [flops, bytes,
    dtype]), the estimated work of each row's ops, and with `ceilings` their roofline columns
    (each op against the ceiling of its own dtype)."""
    if by not in BY + ("op/phase",):
        raise ValueError(f"by: {by!r} is not one of {', '.join(BY)}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth: must be an integer >= 1, got {depth!r}")
    agg: dict[str, dict] = {}
    seen_keys: dict[str, set] = defaultdict(set)
    for it in its:
        name = key_of(it, by, depth)
        a = agg.setdefault(name, {"calls": 0, "ms": 0.0, "bwd": 0.0, "note": _compiled_note(it, by)})
        a["calls"] += 1
        a["ms"] += it.ms
        a["bwd"] += it.ms if it.phase == "backward" else 0.0
        seen_keys[name].add((it.module, it.phase, it.op))
    total = sum(a["ms"] for a in agg.values()) or 1e-12
    rows = []
    for name, a in agg.items():
        row = Row(
            name=name,
            calls=a["calls"],
            device_ms=a["ms"],
            share=a["ms"] / total,
            backward_ms=a["bwd"],
            note=a["note"],
        )
        if work is not None and by != "kernel":
            ws = [work[k] for k in seen_keys[name] if k in work]
            if ws:
                dtypes = {w[2] for w in ws if w[2]}
                flops = sum(w[0] for w in ws)
                row = replace(
                    row,
                    flops=flops,
                    bytes=sum(w[1] for w in ws),
                    dtype="/".join(sorted(dtypes)),
                    work_from=WORK_FROM if flops else WORK_FROM.split("; ")[1],
                )
                if ceilings:
                    at = [roofline.ceiling_ms(*w[:3], ceilings) for w in ws]
                    row = roofline.apply(
                        row, ceilings, sum(a[0] for a in at), sum(a[1] for a in at), l2_bytes
                    )
        rows.append(row)
    return sorted(rows, key=lambda r: -r.device_ms)


def _compiled_note(it: Item, by: str) -> str:
    """What a compiled kernel's op or kernel row fused, and where it came from."""
    if by not in ("op", "kernel") or not it.op.startswith(COMPILED_OP + " "):
        return ""
    ops = fused_ops(it.op[len(COMPILED_OP) + 1 :])
    where = " at ".join(x for x in (it.module if it.module != NO_MODULE else "", it.line) if x)
    return "; ".join(x for x in (f"fuses {', '.join(ops)}" if ops else "", where) if x)


def work_by_key(its: list[Item], records: list, scale: float) -> dict:
    """(module, phase, op) -> [flops, bytes, dtype] from the WorkCounter records behind the
    items, each record counted once (with the first kernel it launched), and from the work the
    items carry (a profile with shapes), times `scale`."""
    out: dict = {}
    used = set()
    for it in its:
        if it.work is not None:
            w = out.setdefault((it.module, it.phase, it.op), [0.0, 0.0, ""])
            w[0] += it.work[0] * scale
            w[1] += it.work[1] * scale
            w[2] = w[2] or it.work[2]
        for m in it.markers:
            if m in used or m >= len(records) or records[m] is None:
                continue
            used.add(m)
            r = records[m]
            w = out.setdefault((it.module, it.phase, it.op), [0.0, 0.0, ""])
            w[0] += r.flops * scale
            w[1] += r.bytes * scale
            w[2] = w[2] or r.dtype
    return out


def _rate(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 10 else f"{v:.2g}"


def table(rows: list[Row], calls: int, title: str, top: int = 12) -> str:
    """Rows as text: time per call, share, backward share, achieved rates, bound, headroom."""
    from perfloop.harness.measurement import fmt_ms

    head = (
        f"{title:<44} {'calls':>6} {'ms/call':>9} {'share':>6} {'bwd':>5} {'GB/s':>9} "
        f"{'TFLOP/s':>9} {'bound':>8} {'headroom':>9}"
    )
    lines = [head]
    for r in rows[:top]:
        lines.append(
            f"{r.name[:44]:<44} {r.calls // calls:>6} {fmt_ms(r.device_ms / calls):>9} {r.share:>6.1%} "
            f"{r.backward_ms / r.device_ms if r.device_ms else 0:>5.0%} {_rate(r.gbps):>9} "
            f"{_rate(r.tflops):>9} {r.bound or '-':>8} "
            f"{fmt_ms(r.headroom_ms / calls) if r.headroom_ms is not None else '-':>9}"
        )
        if r.note:
            lines.append(f"    note: {r.note}")
    if len(rows) > top:
        rest = sum(r.device_ms for r in rows[top:]) / calls
        lines.append(f"... {len(rows) - top} more rows, {fmt_ms(rest)} per call")
    return "\n".join(lines)


def row_dict(r: Row) -> dict:
    return {k: v for k, v in r.__dict__.items() if v is not None and v != ""}


def compare_rows(a: list[dict], b: list[dict], a_calls: int, b_calls: int) -> list[dict]:
    """Two breakdowns (row dicts, as stored) side by side, per call: name, a_ms, b_ms, b/a, and
    the change in ms; largest change first. A row only one side has is 0 on the other."""
    ta = {r["name"]: r["device_ms"] / a_calls for r in a}
    tb = {r["name"]: r["device_ms"] / b_calls for r in b}
    out = [
        {
            "name": n,
            "a_ms": ta.get(n, 0.0),
            "b_ms": tb.get(n, 0.0),
            "ratio": tb.get(n, 0.0) / ta[n] if ta.get(n) else None,
            "change_ms": tb.get(n, 0.0) - ta.get(n, 0.0),
        }
        for n in {*ta, *tb}
    ]
    return sorted(out, key=lambda r: -abs(r["change_ms"]))
