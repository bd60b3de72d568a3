"""Interval and point lookups for a profile's timeline: which intervals meet [s, e], which
samples fall in it, whether a time lies inside a set of spans -- in about log n each, where a
scan of every interval per question made the analysis quadratic in the trace's length."""

from __future__ import annotations

import bisect


class Intervals:
    """(start, end, item) intervals, indexed for "which meet [s, e]" in about log n plus what
    they return: sorted by start, with the few long ones (past LONG times the median length, as
    a step's range among its ops) kept apart, so the short ones are found by bisection between
    s minus the longest short one and e. A profile's holes times its ops was quadratic."""

    LONG = 64

    def __init__(self, items):
        items = sorted(items, key=lambda x: x[0])
        lengths = sorted(b - a for a, b, *_ in items)
        cut = lengths[len(lengths) // 2] * self.LONG if lengths else 0.0
        self.long = [x for x in items if x[1] - x[0] > cut]
        self.short = [x for x in items if x[1] - x[0] <= cut]
        self.starts = [x[0] for x in self.short]
        self.reach = max((b - a for a, b, *_ in self.short), default=0.0)

    def meeting(self, s: float, e: float) -> list:
        """The intervals with start < e and end > s, in order of start."""
        lo = bisect.bisect_left(self.starts, s - self.reach)
        hi = bisect.bisect_left(self.starts, e)
        found = [x for x in self.short[lo:hi] if x[1] > s] + [x for x in self.long if x[0] < e and x[1] > s]
        return sorted(found, key=lambda x: x[0]) if self.long else found

    def overlap(self, s: float, e: float) -> float:
        return sum(min(e, x[1]) - max(s, x[0]) for x in self.meeting(s, e))


class Points:
    """Stack samples sorted by time, for "which fall in [s, e]" by bisection."""

    def __init__(self, samples):
        self.samples = sorted(samples, key=lambda x: x.t)
        self.ts = [x.t for x in self.samples]

    def within(self, s: float, e: float) -> list:
        return self.samples[bisect.bisect_left(self.ts, s) : bisect.bisect_right(self.ts, e)]


class Spans:
    """Sorted, merged (start, end) spans, for "is t inside one of them" by bisection."""

    def __init__(self, spans):
        merged: list[list[float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.ends[i]
