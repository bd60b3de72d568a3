"""When the device sat idle during a profile, and why: each stretch with no device activity is
charged to one cause and, where samples of the launching thread's stack say it, one place in the
user's code (file:line).

The causes, first match wins: a synchronizing call (.item(), a copy to the host, an explicit
synchronize); a pageable host-to-device copy; the caching allocator asking the driver for memory
(cudaMalloc, cudaFree); data loading (a DataLoader's iterator); the optimizer's host loop (inside
optimizer.step()); SDPA's cuDNN backend building a plan for a shape it has not seen (a stretch of
a millisecond or more inside its op); host work outside torch (no op running for 100 us or more:
Python, NumPy, logging; not a compiled graph's call, whose Python launches its kernels); before
the first kernel; the stretches after a synchronizing call while the host, behind the emptied
queue, launches each kernel only after the last one ended (charged to that call; and every launch
gap, where the host's own time is less than the device's: without the syncs it would run ahead);
and host launch overhead (the host issuing ops slower than the device runs them). A stretch that a
synchronizing call ends is the call's only from when the call began: before it the host was doing
other work (the NumPy whose result the copy moves), judged by the rules above. A synchronizing
op's own host time (a boolean-mask index's nonzero, its allocation and copy) is the sync's as
well, up to the idle time: the launch gaps behind the emptied queue that removing the op would
close. On a CPU the same question is asked of the time between the step's ops.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from torch.autograd import DeviceType

from perfloop.analysis.idle_record import CAUSES, Cause, HostCompiled, Idle
from perfloop.analysis.spans import Intervals, Points

SYNC_APIS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)


ALLOC_APIS = (
    "cudaMalloc",
    "cudaFree",
    "cuMemAlloc",
    "cuMemFree",
    "cudaHostAlloc",
    "cuMemCreate",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemRelease",
    "cuMemAddressReserve",
)
PLAN_US = 1000.0  # a stretch this long inside cuDNN's attention is its plan being built, not launches
OUTSIDE_US = 100.0  # a stretch this long with no torch op running is host work, not launch overhead
# ops whose output's size is data: the host waits for the device to know it
OVERLAPPED = (Cause.SYNC, Cause.LAUNCH, Cause.FIRST, Cause.GRAPH_BREAK)
RANGES = {
    "enumerate(DataLoader)": Cause.DATA,
    "Optimizer.step#": Cause.OPTIMIZER,
    "Optimizer.zero_grad#": Cause.OPTIMIZER,
    # SDPA's cuDNN backend builds a plan (a cuDNN graph) for each shape it has not seen
    "aten::_scaled_dot_product_cudnn_attention": Cause.CUDNN_PLAN,
    "aten::_cudnn_attention": Cause.CUDNN_PLAN,
}


def _sync_calls(events) -> list[tuple[float, float, str, object]]:
    """(start, end, op, the outermost torch op around it or None) of each runtime call that
    blocks the host until the device drains."""
    out = []
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith(SYNC_APIS):
            continue
        if e.name.startswith("cudaMemcpy") and "Async" in e.name:
            continue
        op = e
        while op is not None and "::" not in op.name:
            op = op.cpu_parent
        top = op
        while top is not None and top.cpu_parent is not None and "::" in top.cpu_parent.name:
            top = top.cpu_parent
        out.append((e.time_range.start, e.time_range.end, op.name if op else e.name, top))
    return out


def _own_drains_dropped(syncs, launched_at):
    """The synchronizing calls less the window's own drains: a bare runtime call (no torch op
    around it) before the first launch or after the last, where perfloop (and a profiler
    starting) waits for the device."""
    if not launched_at:
        return syncs
    first, last = min(launched_at), max(launched_at)
    return [x for x in syncs if x[3] is not None or first < x[0] < last]


def _split_at_syncs(holes, sync_index) -> list[tuple[float, float]]:
    """Each hole cut where a synchronizing call inside it began: before that, the host was not
    waiting."""
    out = []
    for s, e in holes:
        for cs, *_ in sync_index.meeting(s, e):
            if s < cs < e:
                out.append((s, cs))
                s = cs
        out.append((s, e))
    return out


def _sync_ops(syncs, samples, spans) -> tuple[float, dict, dict]:
    """(host ms in the outermost torch ops that synchronized, op -> that op's name, op -> the
    line most samples inside those ops held)."""
    inside = Intervals(spans) if spans else None
    tops: dict = {}
    outer: dict = {}
    votes: dict = {}
    for *_, op, top in syncs:
        if top is None:
            continue
        a, b = top.time_range.start, top.time_range.end
        if inside is not None:
            b = a + sum(min(b, y) - max(a, x) for x, y, *_ in inside.meeting(a, b))
        tops[id(top)] = max(0.0, b - a)
        outer.setdefault(op, set()).add(top.name)
        if id(top) not in votes:
            votes[id(top)] = (op, Counter(x.place for x in samples.within(a, b) if x.place))
    places: dict = {}
    for op, c in votes.values():
        places.setdefault(op, Counter()).update(c)
    best = {op: c.most_common(1)[0][0] for op, c in places.items() if c}
    return sum(tops.values()) / 1e3, outer, best


def gaps(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] no interval covers."""
    out, t = [], start
    for s, e in sorted(intervals):
        if s > t:
            out.append((t, min(s, end)))
        t = max(t, e)
    if t < end:
        out.append((t, end))
    return [(s, e) for s, e in out if e > s]


def _clip(holes, spans):
    """The parts of `holes` inside `spans` (both sorted, holes disjoint), in one sweep."""
    index = Intervals(spans)
    out = []
    for s, e in holes:
        for a, b, *_ in index.meeting(s, e):
            out.append((max(s, a), min(e, b)))
    return sorted(out)


def _runtime(events, names) -> list[tuple[float, float]]:
    return [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(names)
    ]


def _ranges(events) -> list[tuple[float, float, str]]:
    """(start, end, cause) of the host ranges that name a cause (the DataLoader's iterator,
    optimizer.step())."""
    out = []
    for e in events:
        for prefix, cause in RANGES.items():
            if e.name.startswith(prefix):
                out.append((e.time_range.start, e.time_range.end, cause))
    return out


def _place(s: float, e: float, samples) -> str:
    """The user's line most samples in [s, e] were at (with NumPy said), '' with none."""
    votes: Counter = Counter()
    for x in samples.within(s, e):
        if x.place:
            votes[x.place + (" (in NumPy)" if "numpy" in x.tags else "")] += 1
    return votes.most_common(1)[0][0] if votes else ""


def _in_torch(s: float, e: float, samples) -> bool:
    """Most samples in [s, e] caught the thread inside torch's own code (the autograd engine
    between backward ops, a module's Python): torch's time between its ops, not host work
    outside it. False with no samples there."""
    inside = [("torch" in x.tags) for x in samples.within(s, e)]
    return sum(inside) * 2 > len(inside) if inside else False


def _drained(device_intervals, launched_at) -> list[tuple[float, float, bool]]:
    """The device's busy blocks (start, end, whether the host was behind: every kernel in it
    launched only after the one before had ended)."""
    order = sorted(range(len(device_intervals)), key=lambda i: device_intervals[i][0])
    blocks: list = []
    prev_end = None
    for i in order:
        s, e = device_intervals[i]
        behind = launched_at is not None and (prev_end is None or launched_at[i] >= prev_end)
        if blocks and s <= blocks[-1][1]:
            blocks[-1] = (blocks[-1][0], max(blocks[-1][1], e), blocks[-1][2] and behind)
        else:
            blocks.append((s, e, behind))
        prev_end = e if prev_end is None else max(prev_end, e)
    return blocks


def without(
    device_intervals, launched_at: list[float], removed: list[tuple[float, float]], host_end: float
) -> float:
    """How much sooner the work would end (us) had the host not spent the `removed` stretches:
    the launches after each come that much earlier, every kernel starts at its (earlier) launch
    plus the delay it had from launch (or a free device) to start, or when the one before it ends,
    whichever is later, and runs as long as it did."""
    cuts = sorted(removed)

    def shifted(t: float) -> float:
        return t - sum(max(0.0, min(t, b) - a) for a, b in cuts if a < t)

    order = sorted(range(len(device_intervals)), key=lambda i: device_intervals[i][0])
    end = prev = float("-inf")
    for i in order:
        s, e = device_intervals[i]
        latency = max(0.0, s - max(launched_at[i], prev))  # launch to start, on a free device
        end = max(shifted(launched_at[i]) + latency, end) + (e - s)
        prev = max(prev, e)
    old = max(host_end, max(e for _, e in device_intervals))
    new = max(shifted(host_end), end)
    return max(0.0, old - new)


def _before_first(device_intervals, spans):
    """Whether a hole [s, e] is the wait for the first kernel: of the profile, or of each span
    (each call, each step) -- the user's data and Python before the work, not a launch gap."""
    first = min(s for s, _ in device_intervals)
    starts = sorted(x for x, _ in device_intervals)

    def first_in(a: float, b: float) -> float:
        i = bisect.bisect_left(starts, a)
        return starts[i] if i < len(starts) and starts[i] <= b else b

    waits = Intervals([(a, first_in(a, b)) for a, b in spans or []])
    return lambda s, e: e <= first or any(a <= s and e <= f for a, f in waits.meeting(s, e))


def _break_savings(compiled: HostCompiled, spans, device_intervals, launched_at, end, syncs, hidden) -> dict:
    """A graph break's line -> how much sooner the work would end (ms) without the host's
    stretches between graphs that its code makes: those before a region of the code resumed
    after it, and those after one (up to the next graph). A break whose stretches hold all the
    step's synchronizing calls saves, at least, the idle a host running ahead across steps
    hides (`hidden` ms: the device's idle waits on a host a sync held back; `compiled`:
    idle's)."""
    breaks, between = compiled.breaks, compiled.between
    if launched_at is None or not breaks:
        return {}
    waits = [(cs, ce) for cs, ce, *_ in syncs]
    if spans:
        waits = _clip(waits, spans)
    out = {}
    for where, frames in breaks.items():
        mine = [
            (a, b)
            for a, b, nxt, *prev in between
            if _frame(nxt) in frames or (prev and _frame(prev[0]) in frames)
        ]
        if spans:
            mine = _clip(mine, spans)
        out[where] = without(device_intervals, launched_at, mine, end) / 1e3 if mine else 0.0
        inside = Intervals(mine)
        if mine and waits and all(inside.overlap(s, e) >= 0.99 * (e - s) for s, e in waits):
            out[where] = max(out[where], hidden)
    return out


def _frame(compile_id: str) -> str:
    """The frame of a compile id `F/A`."""
    return compile_id.split("/")[0]


def _sync_saving(syncs, spans, device_intervals, launched_at, end) -> float:
    """How much sooner the work would end (ms) without the synchronizing calls' waits."""
    waits = [(cs, ce) for cs, ce, *_ in syncs]
    if spans:
        waits = _clip(waits, spans)
    if not waits or launched_at is None:
        return 0.0
    return without(device_intervals, launched_at, waits, end) / 1e3


@dataclass
class _Host:
    """What the host was doing, indexed for the holes' questions: each of them a rule above."""

    syncs: Intervals
    copies: Intervals
    allocs: Intervals
    ranges: Intervals
    ops: Intervals
    compiling: Intervals
    between: Intervals
    graph_calls: Intervals  # the host's calls of compiled graphs: their Python is their launching
    samples: Points
    before_first: object
    pageable: bool

    def cause(self, s: float, e: float, last_sync) -> tuple[str, list, list, list]:
        """(cause, the synchronizing ops meeting [s, e], the named ranges and the stretches
        between compiled graphs covering most of it)."""
        blocking = [op for _, _, op, _ in self.syncs.meeting(s, e)]
        half = (e - s) / 2
        inside = [
            (c, a, b)
            for a, b, c in self.ranges.meeting(s, e)
            if min(e, b) - max(s, a) > half and (c != Cause.CUDNN_PLAN or e - s >= PLAN_US)
        ]
        broken = [(a, b, r) for a, b, r, *_ in self.between.meeting(s, e) if min(e, b) - max(s, a) > half]
        if self.compiling.overlap(s, e) > half:
            cause = Cause.COMPILE
        elif broken:
            cause = Cause.GRAPH_BREAK
        elif blocking:
            cause = Cause.SYNC
        elif self.pageable and self.copies.overlap(s, e) > half:
            cause = Cause.PAGEABLE
        elif self.allocs.overlap(s, e) > half:
            cause = Cause.ALLOCATOR
        elif inside:
            cause = inside[-1][0]
        elif (
            e - s >= OUTSIDE_US
            and self.ops.overlap(s, e) + self.graph_calls.overlap(s, e) < half
            and not _in_torch(s, e, self.samples)
        ):
            cause = Cause.OUTSIDE
        elif self.before_first(s, e):
            cause = Cause.FIRST
        else:
            cause = Cause.SYNC if last_sync is not None else Cause.LAUNCH
        return cause, blocking, inside, broken


def idle(
    events,
    device_intervals: list[tuple[float, float]],
    sites: dict | None = None,
    spans: list[tuple[float, float]] | None = None,
    *,
    launched_at: list[float] | None = None,
    pageable: list[tuple[float, float]] | None = None,
    samples=None,
    compiled: HostCompiled | None = None,
) -> Idle | None:
    """The idle breakdown of a profile (None when nothing ran on the device). `sites`: op ->
    source lines that made that synchronizing call (from the WorkCounter); `spans`: the host
    intervals the profile is limited to (the occurrences of a range), idle counted inside them;
    `launched_at`: when the host launched each interval's work; `pageable`: the device's
    pageable host-to-device copies; `samples`: the launching thread's stack samples
    (stacks.Sample on this timeline); `compiled`: what the host ran compiled (HostCompiled) -- a
    stretch there is charged to the compile, or to the graph break (its place: the next region's id);
    each break's saving is the sooner end without its stretches (timeline.without); the launch
    gaps inside graph calls (what CUDA graphs would replay) are counted apart."""
    if not device_intervals:
        return None
    compiled = compiled or HostCompiled()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    start = min([e.time_range.start for e in cpu] + [s for s, _ in device_intervals])
    end = max(e for _, e in device_intervals)  # the host's wait for the last kernel is ours
    holes = gaps(device_intervals, start, end)
    if spans:
        start, end = spans[0][0], max(end, spans[-1][1])
        holes = _clip(gaps(device_intervals, start, end), spans)
    syncs = _own_drains_dropped(_sync_calls(events), launched_at)
    samples = Points(samples or [])
    host = _Host(
        Intervals(syncs),
        Intervals(_runtime(cpu, ("cudaMemcpy",)) if pageable else []),
        Intervals(_runtime(cpu, ALLOC_APIS)),
        Intervals(_ranges(cpu)),
        Intervals([(e.time_range.start, e.time_range.end) for e in cpu if "::" in e.name]),
        Intervals([(a, b) for a, b in compiled.compiling]),
        Intervals(list(compiled.between)),
        Intervals(list(compiled.graph_calls or [])),
        samples,
        _before_first(device_intervals, spans),
        bool(pageable),
    )
    holes = _split_at_syncs(holes, host.syncs)
    ended = {round(be, 3): behind for _, be, behind in _drained(device_intervals, launched_at)}
    sync_host, outer, sync_places = _sync_ops(syncs, samples, spans)
    by_cause, after, places, in_graphs = _charge(holes, host, ended, samples, sync_places)
    wall = sum(e - s for s, e in spans) / 1e3 if spans else (end - start) / 1e3
    busy = wall - sum((e - s) / 1e3 for s, e in holes)
    waited = sum(ce - cs for cs, ce, *_ in syncs) / 1e3
    sync_saving = _sync_saving(syncs, spans, device_intervals, launched_at, end)
    hidden = sum(by_cause[c] for c in OVERLAPPED)
    break_saving = _break_savings(compiled, spans, device_intervals, launched_at, end, syncs, hidden)
    calls = Counter(op for _, _, op, _ in syncs)
    sync_rows = [(op, calls[op], ms, sorted((sites or {}).get(op, ()))) for op, ms in after.most_common()]
    ranked = [(c, p, ms) for (c, p), ms in places.most_common()]
    out = Idle(
        wall_ms=wall,
        busy_ms=busy,
        by_cause=by_cause,
        syncs=sync_rows,
        places=ranked,
        sampled=bool(samples.samples),
        waited_ms=waited,
        sync_saving_ms=sync_saving,
        sync_host_ms=sync_host,
        outer=outer,
        sync_places=sync_places,
        break_saving_ms=break_saving,
        launch_in_graphs_ms=in_graphs if compiled.graph_calls is not None else None,
    )
    return out.charged()


def _charge(holes, host: _Host, ended: dict, samples: Points, sync_places: dict):
    """Each idle hole charged to its cause and place: (ms by cause, ms after each synchronizing
    op, ms by (cause, place), the launch gaps inside graph calls)."""
    by_cause = dict.fromkeys(CAUSES, 0.0)
    after: Counter = Counter()
    places: Counter = Counter()
    in_graphs = 0.0
    last_sync = None  # the synchronizing op whose emptied queue the host is still behind
    last_break = None  # ... or the graph break (its place) whose eager code emptied it
    for s, e in holes:
        ms = (e - s) / 1e3
        if not ended.get(round(s, 3), True):
            last_sync = last_break = None  # the block before this hole had queued work: the host caught up
        cause, blocking, inside, broken = host.cause(s, e, last_sync)
        if cause == Cause.GRAPH_BREAK:
            last_break = broken[-1][2]
        elif cause in (Cause.SYNC, Cause.LAUNCH) and not blocking and last_break is not None:
            cause, broken = Cause.GRAPH_BREAK, [(s, e, last_break)]  # behind the queue the break emptied
        if cause == Cause.SYNC:
            last_sync = blocking[-1] if blocking else last_sync
            after[last_sync] += ms
        by_cause[cause] += ms
        if cause == Cause.LAUNCH:
            in_graphs += min(ms, host.graph_calls.overlap(s, e) / 1e3)
        # a named range's stretches: where its samples were, all along the range
        at = (inside[-1][1], inside[-1][2]) if inside and cause == inside[-1][0] else (s, e)
        place = _place(*at, samples)
        if cause == Cause.SYNC:  # the line that synchronized, not the one the host went on to
            place = sync_places.get(last_sync, place)
        elif cause == Cause.GRAPH_BREAK:  # the break: named by the compiled region resumed after it
            place = broken[-1][2]
        places[(cause, place)] += ms
    return by_cause, after, places, in_graphs
