"""Measure again: what changed between two profiles of the same work -- the kernels gone and
new, device time and launches per call."""

from __future__ import annotations

from dataclasses import dataclass

from perfloop.analysis.profiling import Profile
from perfloop.harness.measurement import fmt_ms

MIN_RECORDED_MS = 1e-6  # a nanosecond: less device time per call than this is none recorded


@dataclass(frozen=True)
class ProfileDiff:
    removed: list[str]
    added: list[str]
    device_ms: tuple[float, float]
    launches: tuple[float, float]

    def __str__(self) -> str:
        b, a = self.device_ms
        recorded = [fmt_ms(t) if t >= MIN_RECORDED_MS else "none recorded" for t in (b, a)]
        ratio = (
            f" ({b / a:.2f}x)"
            if min(a, b) >= MIN_RECORDED_MS
            else " (no ratio: a profile caught no device work)"
        )
        lines = [
            f"device time/call: {recorded[0]} -> {recorded[1]}{ratio}",
            f"launches/call: {self.launches[0]:g} -> {self.launches[1]:g}",
        ]
        if self.removed:
            lines.append("gone:  " + ", ".join(self.removed))
        if self.added:
            lines.append("new:   " + ", ".join(self.added))
        return "\n".join(x for x in lines if x)


def diff(before: Profile, after: Profile) -> ProfileDiff:
    """Measure again: which kernels disappeared or appeared, and the change in time and launches."""
    b = {k.short for k in before.kernels}
    a = {k.short for k in after.kernels}
    return ProfileDiff(
        removed=sorted(b - a),
        added=sorted(a - b),
        device_ms=(before.device_ms_per_call, after.device_ms_per_call),
        launches=(before.launches_per_call, after.launches_per_call),
    )
