"""When the GPU sat idle during a profile, and why, as far as the trace tells it.

Every gap between device activity is charged to one cause: before the first kernel (the host
had not launched anything yet), after a synchronizing call (the host waited for the device to
drain -- .item(), a copy to the host, an explicit synchronize -- then had to issue the next work
while the device waited), or host launch overhead (the device ran out of queued work while the
host was still issuing it: Python, the dispatcher, many small launches).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch.autograd import DeviceType

SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
             "cuStreamSynchronize", "cuCtxSynchronize")  # fmt: skip
CAUSES = ("synchronizing calls", "host launch overhead", "before the first kernel")


@dataclass
class Idle:
    wall_ms: float  # the profiled region, all calls
    busy_ms: float
    by_cause: dict  # cause -> idle ms, all calls
    syncs: list = field(default_factory=list)  # (op, calls, idle ms after them, sites)

    scaled: bool = False  # causes scaled to the time without the profiler

    def scaled_to(self, wall_ms: float) -> Idle:
        """The same breakdown for the calls' wall time without the profiler (whose per-op cost
        slows the host and so lengthens the gaps): the idle is that wall minus the busy time,
        shared among the causes as the profiled gaps were."""
        idle_ms = max(0.0, wall_ms - self.busy_ms)
        k = idle_ms / self.idle_ms if self.idle_ms else 0.0
        return Idle(wall_ms=max(wall_ms, self.busy_ms), busy_ms=self.busy_ms,
                    by_cause={c: v * k for c, v in self.by_cause.items()},
                    syncs=[(op, n, ms * k, s) for op, n, ms, s in self.syncs], scaled=True)  # fmt: skip

    @property
    def idle_ms(self) -> float:
        return sum(self.by_cause.values())

    @property
    def idle_share(self) -> float:
        return self.idle_ms / self.wall_ms if self.wall_ms else 0.0


def _sync_calls(events) -> list[tuple[float, float, str]]:
    """(start, end, op) of each runtime call that blocks the host until the device drains."""
    out = []
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith(SYNC_APIS):
            continue
        if e.name.startswith("cudaMemcpy") and "Async" in e.name:
            continue
        op = e
        while op is not None and "::" not in op.name:
            op = op.cpu_parent
        out.append((e.time_range.start, e.time_range.end, op.name if op else e.name))
    return out


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
    out = []
    for s, e in holes:
        for a, b in spans:
            if min(e, b) > max(s, a):
                out.append((max(s, a), min(e, b)))
    return out


def idle(events, device_intervals: list[tuple[float, float]], sites: dict | None = None,
         spans: list[tuple[float, float]] | None = None) -> Idle | None:  # fmt: skip
    """The idle breakdown of a GPU profile (None when nothing ran on the device). `sites`: op ->
    source lines that made that synchronizing call (from the WorkCounter); `spans`: the host
    intervals the profile is limited to (the occurrences of a range), idle counted inside them."""
    if not device_intervals:
        return None
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    start = min([e.time_range.start for e in cpu] + [s for s, _ in device_intervals])
    end = max(e for _, e in device_intervals)  # the host's wait for the last kernel is ours
    holes = gaps(device_intervals, start, end)
    if spans:
        start, end = spans[0][0], max(end, spans[-1][1])
        holes = _clip(gaps(device_intervals, start, end), spans)
    first = min(s for s, _ in device_intervals)
    syncs = _sync_calls(events)
    by_cause = dict.fromkeys(CAUSES, 0.0)
    after: Counter = Counter()
    calls: Counter = Counter()
    for *_, op in syncs:
        calls[op] += 1
    for s, e in holes:
        ms = (e - s) / 1e3
        if e <= first:
            by_cause["before the first kernel"] += ms
            continue
        blocking = [op for cs, ce, op in syncs if cs < e and ce > s]
        if blocking:
            by_cause["synchronizing calls"] += ms
            after[blocking[-1]] += ms
        else:
            by_cause["host launch overhead"] += ms
    wall = sum(e - s for s, e in spans) / 1e3 if spans else (end - start) / 1e3
    busy = wall - sum((e - s) / 1e3 for s, e in holes)
    sync_rows = [(op, calls[op], ms, sorted((sites or {}).get(op, ()))) for op, ms in after.most_common()]
    return Idle(wall_ms=wall, busy_ms=busy, by_cause=by_cause, syncs=sync_rows)
