"""What every analyzer in this package builds on: `Findings`, the list one analyzer fills from
one capture, keeping what saves at least MIN_SHARE of the step."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.findings import Evidence, Finding, Kind, Site

MIN_SHARE = 0.01  # findings saving less of the step are not listed


def by_module(items, calls: int, name=lambda i: i.module) -> list[tuple[str, float]]:
    """(module, ms per call) of the items, largest first (`name`: what an item is charged to)."""
    ms: dict = {}
    for i in items:
        ms[name(i)] = ms.get(name(i), 0.0) + i.ms / calls
    return sorted(ms.items(), key=lambda kv: -kv[1])


class Findings:
    """One analyzer's findings of capture `c`, against the measured `ceilings`."""

    def __init__(self, c: Capture, ceilings: dict) -> None:
        self.c, self.ceilings, self.found = c, ceilings, []

    @property
    def copy(self) -> float:
        """The measured copy rate, GB/s (0 where it was not measured)."""
        return self.ceilings.get("copy_gbps") or 0.0

    def at_copy_ms(self, nbytes: float) -> float:
        """How long `nbytes` take at the copy ceiling, ms."""
        return nbytes / (self.copy * 1e9) * 1e3 if self.copy else 0.0

    def add(
        self,
        kind: Kind,
        title: str,
        saves: float,
        bound: Bound,
        evidence: str,
        advice: str,
        where: str = "",
        site: Site | None = None,
        **values,
    ) -> None:
        """A finding of `kind`, kept where it saves MIN_SHARE of the step or more; `values`: the
        numbers its evidence says."""
        if not isinstance(kind, Kind):
            raise TypeError(f"kind: a findings.Kind, got {kind!r}")
        share = saves / self.c.step_ms
        if share >= MIN_SHARE:
            ev = Evidence(evidence, values)
            self.found.append(Finding(title, saves, share, bound, ev, advice, where, kind, site or Site()))
