"""What timeline.idle answers with: the idle's causes (Cause), the record of one profile's idle
(Idle, with the rules that move launch gaps to the syncs behind them), and what the host ran
compiled on the profile's timeline (HostCompiled)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum


class Cause(str, Enum):
    """Why the device sat idle: one cause per stretch (the module's docstring says the rules). A
    str, so it compares and serializes as its words."""

    SYNC = "synchronizing calls"
    LAUNCH = "host launch overhead"
    FIRST = "before the first kernel"
    PAGEABLE = "pageable host-to-device copy"
    ALLOCATOR = "the caching allocator"
    DATA = "data loading"
    OPTIMIZER = "the optimizer's host loop"
    OUTSIDE = "host work outside torch"
    COMPILE = "compilation (Dynamo, Inductor)"
    GRAPH_BREAK = "eager code between compiled graphs"
    CUDNN_PLAN = "cuDNN building an attention plan"

    def __str__(self) -> str:
        return self.value


CAUSES = tuple(Cause)
DATA_DEPENDENT = (
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::repeat_interleave",
)
# the idle a host that runs ahead of the device (no sync holding it back) hides under queued work


@dataclass(frozen=True)
class HostCompiled:
    """What the host ran compiled, on the profile's timeline (us): the intervals Dynamo and
    Inductor compiled in; the host's stretches between two compiled regions of a call, as (start,
    end, the next region's compile id[, the previous region's]); each graph break's line -> the
    frames of the code resumed after it; and the host's calls of compiled graphs (None where none
    were recorded: then the launch gaps are not split by them)."""

    compiling: tuple = ()
    between: tuple = ()
    breaks: dict = field(default_factory=dict)
    graph_calls: tuple | None = None


@dataclass
class Idle:
    wall_ms: float  # the profiled region, all calls
    busy_ms: float
    by_cause: dict  # cause -> idle ms, all calls
    syncs: list = field(default_factory=list)  # (op, calls, idle ms after them, sites)
    places: list = field(default_factory=list)  # (cause, place, idle ms), largest first
    sampled: bool = False  # the places come from samples of the launching thread's stack
    device: str = "GPU"  # what waited: "GPU", or "CPU" where the host is the device

    scaled: bool = False  # causes scaled to the time without the profiler
    waited_ms: float = 0.0  # the host's time inside synchronizing calls
    sync_saving_ms: float = 0.0  # how much sooner the work would end without the waits (timeline.without)
    scale: float = 1.0  # the unprofiled idle over the profiled (scaled_to's factor; 1: not scaled)
    sync_host_ms: float = 0.0  # the host's time in the torch ops that synchronized, their waits included
    outer: dict = field(default_factory=dict)  # synchronizing op -> the user's ops around it (aten::index)
    sync_places: dict = field(default_factory=dict)  # synchronizing op -> the line most samples in it held
    break_saving_ms: dict = field(default_factory=dict)  # a break's line -> the sooner end without it
    # launch gaps while the host ran a compiled graph (None: no graph calls given)
    launch_in_graphs_ms: float | None = None

    raw: Idle | None = field(default=None, repr=False, compare=False)  # before the syncs took any launch gap

    def charged(self, host_pace: float = 1.0) -> Idle:
        """A copy with the launch gaps the syncs caused charged to them (both rules below)."""
        out = replace(
            self, by_cause=dict(self.by_cause), syncs=list(self.syncs), places=list(self.places), raw=self
        )
        return out.syncs_take_launch_gaps().syncs_take_their_ops(host_pace)

    def syncs_take_their_ops(self, host_pace: float = 1.0) -> Idle:
        """Removing the synchronizing ops gives back their host time outside their waits
        (`host_pace`: this wall's host speed against the profiled one's), at most the idle that
        is not the wait for the first kernel: the launch gaps behind the emptied queue up to
        that are the syncs'."""
        own = max(0.0, self.sync_host_ms - self.waited_ms) * host_pace  # the ops' host time, not waiting
        target = min(self.idle_ms - self.by_cause[Cause.FIRST], self.by_cause[Cause.SYNC] + own)
        total = sum(ms for _, _, ms, _ in self.syncs)
        moved = min(max(0.0, target - self.by_cause[Cause.SYNC]), self.by_cause[Cause.LAUNCH])
        if moved <= 0 or not total:
            return self
        launch = self.by_cause[Cause.LAUNCH]
        self.by_cause[Cause.SYNC] += moved
        self.by_cause[Cause.LAUNCH] -= moved
        self.syncs = [(op, n, ms + moved * ms / total, s) for op, n, ms, s in self.syncs]
        places: Counter = Counter()
        for c, p, ms in self.places:
            if c == Cause.LAUNCH:
                places[(c, p)] += ms * (1 - moved / launch)
            else:
                places[(c, p)] += ms
        for op, _, ms, _ in self.syncs:
            places[(Cause.SYNC, self.sync_places.get(op, ""))] += moved * ms / self.by_cause[Cause.SYNC]
        self.places = [(c, p, ms) for (c, p), ms in places.most_common() if ms > 0]
        return self

    def syncs_take_launch_gaps(self) -> Idle:
        """Where the host's own time (all but its waits) is less than the device's, without the
        syncs it would run ahead and no launch gap would show: every one is the emptied queue's,
        charged to the syncs (in proportion to the idle right after each)."""
        launch, total = self.by_cause[Cause.LAUNCH], sum(ms for _, _, ms, _ in self.syncs)
        if not (launch and total and self.wall_ms - self.waited_ms < self.busy_ms):
            return self
        self.by_cause[Cause.SYNC] += launch
        self.by_cause[Cause.LAUNCH] = 0.0
        self.syncs = [(op, n, ms + launch * ms / total, s) for op, n, ms, s in self.syncs]
        merged: Counter = Counter()
        for c, p, ms in self.places:
            merged[(Cause.SYNC if c == Cause.LAUNCH else c, p)] += ms
        self.places = [(c, p, ms) for (c, p), ms in merged.most_common()]
        return self

    def _idle_times(self, k: float, **fields) -> Idle:
        """A copy with every idle stretch (causes, syncs, places, the syncs' saving) times k."""
        return replace(
            self,
            by_cause={c: v * k for c, v in self.by_cause.items()},
            syncs=[(op, n, ms * k, s) for op, n, ms, s in self.syncs],
            places=[(c, p, ms * k) for c, p, ms in self.places],
            sync_saving_ms=self.sync_saving_ms * k,
            **fields,
            launch_in_graphs_ms=_times(self.launch_in_graphs_ms, k),
            break_saving_ms={w: v * k for w, v in self.break_saving_ms.items()},
        )

    def data_dependent(self) -> list[tuple[str, str]]:
        """(op, a user's op around it) of the synchronizing calls whose output size is data."""
        return [
            (op, outer)
            for op, *_ in self.syncs
            if op.startswith(DATA_DEPENDENT)
            for outer in sorted(self.outer.get(op) or {op})
        ]

    def scaled_to(self, wall_ms: float) -> Idle:
        """The same breakdown for the calls' wall time without the profiler (whose per-op cost
        slows the host and so lengthens the gaps): the idle is that wall minus the busy time,
        shared among the causes as the profiled gaps were."""
        base = self.raw or self
        idle_ms = max(0.0, wall_ms - base.busy_ms)
        k = idle_ms / base.idle_ms if base.idle_ms else 0.0
        out = base._idle_times(k, wall_ms=max(wall_ms, base.busy_ms), scaled=True, scale=k)
        return out.charged(wall_ms / base.wall_ms if base.wall_ms else 1.0)

    def times(self, k: int) -> Idle:
        """One call's breakdown as k calls' (the counts of synchronizing calls and the time
        spent in them are the profile's already)."""
        base = self.raw or self
        return base._idle_times(
            k,
            wall_ms=base.wall_ms * k,
            busy_ms=base.busy_ms * k,
            sync_host_ms=base.sync_host_ms * k,
            waited_ms=base.waited_ms * k,
        ).charged()

    @property
    def idle_ms(self) -> float:
        return sum(self.by_cause.values())

    @property
    def idle_share(self) -> float:
        return self.idle_ms / self.wall_ms if self.wall_ms else 0.0


def _times(ms: float | None, k: float) -> float | None:
    return None if ms is None else ms * k
