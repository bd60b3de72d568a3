"""Where the time goes: torch.profiler around warmed-up calls, turned into an answer.

`profile(fn)` -> Profile: the kernels (name, short name, calls, device time,
share), launches per call, how busy the GPU was against the wall clock, host
time per call, peak memory; `table()`, `export_trace()` for Perfetto,
`diagnose()` for what kind of bound it is and what to do next.
On a CPU the same record holds CPU ops instead of kernels.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from perfloop import device as _device
from perfloop.analysis.attribution import KERNEL_LAUNCHES, annotations, cpu_ops, device_events
from perfloop.analysis.compilation import live_break_reasons, live_cudagraph_skips, live_metrics, skips_of
from perfloop.analysis.counting import counted_call
from perfloop.analysis.inductor import module_trees, placed, replays, tracking_sources, unplaced_note
from perfloop.analysis.kernels import KernelStat, kernel_table, union_ms
from perfloop.analysis.modules import module_ranges, reached_models
from perfloop.analysis.recording import peak_memory, plain_wall_ms, timed_calls
from perfloop.analysis.spans import Spans
from perfloop.analysis.stacks import unsampled_launcher
from perfloop.harness.ceilings import ceilings as measured_ceilings
from perfloop.harness.measurement import Work, fmt_ms

if TYPE_CHECKING:
    from perfloop.analysis.capture import Capture
    from perfloop.analysis.compilation import CompiledCode
    from perfloop.analysis.findings import Diagnosis
    from perfloop.analysis.idle_record import Idle
    from perfloop.analysis.tokens import Tokens

# --------------------------------------------------------------------- names

COVERED = 0.9  # a range's occurrences fill its window when they cover this share of it


# --------------------------------------------------------------------- records


@dataclass(frozen=True)
class Profile:
    """One profiled run of `calls` calls, read-only: what the source recorded (torch's profiler,
    a script's window, a trace file) is handed in whole by build_profile. Times are per call
    unless named total."""

    kernels: list[KernelStat]
    calls: int
    device_ms_per_call: float  # sum of kernel (or op) times
    busy_ms_per_call: float  # union of device activity intervals
    wall_ms_per_call: float  # without the profiler where that was timed (it slows the host)
    host_ms_per_call: float  # time the host spent issuing one call
    launches_per_call: float
    kind: str  # "cuda" or "cpu"
    peak_memory_bytes: int | None = None
    profiled_wall_ms_per_call: float | None = None  # under the profiler
    work: Work | None = None
    warnings: list[str] = field(default_factory=list)
    _prof: Any = field(default=None, repr=False)
    _counted: Any = field(default=None, repr=False)  # (records, items, calls) of the counted call
    _windows: Any = field(default=None, repr=False)  # host intervals the profile is limited to
    step: str | None = None  # what one call is, in a script's profile: a range's name or optimizer.step
    _given_work: Any = field(default=None, repr=False)  # (module, phase, op) -> work, from a trace
    sites: dict | None = None  # module name -> {kind: call site and pl.patch's reach} (nn.plan.plan)
    _samples: Any = field(default=None, repr=False)  # the launching thread's stack (stacks.Sample)
    _call_spans: Any = field(default=None, repr=False)  # pl.profile's calls on the profiler's timeline
    window_cut_s: float | None = None  # a script's time window: the seconds recorded, where it ended early
    compile_metrics: list | None = field(default=None, repr=False)  # Dynamo's, in the process that ran it
    break_reasons: list | None = field(default=None, repr=False)  # the graph-break reasons Dynamo counted
    cudagraph_skips: list | None = field(default=None, repr=False)  # Inductor's CUDA-graph skip reasons
    _trees: Any = field(default=None, repr=False)  # inductor.ModuleTree of the models run
    tokens_seen: int | None = None  # a script's step: its first embedding lookup's size (tokens.read)
    model_bytes: dict | None = None  # ... its models' weights and KV caches (tokens.model_bytes)

    def _spans(self) -> list | None:
        return self._windows or self._call_spans

    def compiles(self) -> list:
        """The compilations (compilation.Compile) inside the profiled calls or steps."""
        from perfloop.analysis.compilation import compiles

        out = compiles(self.events(), self.compile_metrics)
        spans = self._spans()
        if spans:
            inside = Spans(spans)
            out = [c for c in out if c.start_us in inside or c.end_us in inside]
        return out

    def compiled_regions(self) -> list[tuple[float, float, str]]:
        """(start, end, compile id) of the compiled regions run inside the profiled calls."""
        from perfloop.analysis.compilation import regions

        ran = regions(self.events())
        spans = self._spans()
        if spans:
            inside = Spans(spans)
            ran = [r for r in ran if r[0] in inside]
        return ran

    def graph_breaks(self) -> list:
        """The graph breaks (compilation.GraphBreak) of the compiled functions that ran."""
        from perfloop.analysis.compilation import graph_breaks

        ran = self.compiled_regions()
        found = graph_breaks(self.compile_metrics or [], self.break_reasons or [], ran)
        return [b for b in found if b.regions]

    def _between_regions(self) -> list[tuple[float, float, str, str]]:
        """The host's stretches between two compiled graphs run in one call or step
        (compilation.between_graphs: forward, and backward as the forward's mirrored)."""
        from perfloop.analysis.compilation import between_graphs

        ran = sorted(self.compiled_regions(), key=lambda r: (r[0], -r[1]))
        spans = self._spans() or [(float("-inf"), float("inf"))]
        return between_graphs(self._graph_calls, ran, spans)

    @functools.cached_property
    def _graph_calls(self) -> list[tuple[float, float]]:
        """(start, end) of each compiled graph's call (compilation.graph_calls), read once."""
        from perfloop.analysis.compilation import graph_calls

        return graph_calls(self.events())

    def events(self) -> list:
        """The profiler's events (torch's, or a trace file's read as such)."""
        return self._prof.events() if self._prof is not None else []

    @property
    def windows(self) -> list[tuple[float, float]] | None:
        """The host intervals (us) the profile is limited to: a range's occurrences, or None."""
        return self._windows

    @property
    def step_ms(self) -> list[float]:
        """Each profiled occurrence's host duration (a script's steps), in ms; [] where the
        profile is not limited to occurrences."""
        return [(e - s) / 1e3 for s, e in (self._windows or []) if e > s]

    @property
    def gpu_busy_fraction(self) -> float:
        return min(1.0, self.busy_ms_per_call / self.wall_ms_per_call) if self.wall_ms_per_call else 0.0

    @property
    def distinct_kernels(self) -> int:
        return len(self.kernels)

    def items(self) -> list:
        """Every kernel (on a CPU, every outermost op) with its op, module and phase."""
        return self._item_rows

    @functools.cached_property
    def _item_rows(self) -> list:
        from perfloop.analysis.attribution import fastest_of_calls, items, within

        events = self._prof.events() if self._prof is not None else []
        rows = items(
            events,
            self.kind,
            placed(events, self.compile_metrics, self._trees),
            replays(self.compile_metrics, self._trees),
        )
        if self._windows:
            rows = within(rows, self._windows)
        spans = self._windows or self._call_spans
        if self.kind != "cuda" and spans and len(spans) == self.calls:
            rows = fastest_of_calls(rows, spans)
        note = unplaced_note(rows)
        if note and note not in self.warnings:
            self.warnings.append(note)
        return rows

    def _work(self) -> dict | None:
        from perfloop.analysis.attribution import work_by_key

        replayed = [i for i in self.items() if i.replayed and i.work is not None]
        if self._counted is None:
            out = self._given_work
        else:
            records, counted_items, counted_calls = self._counted
            out = work_by_key(counted_items, records, self.calls / counted_calls)
        if replayed:  # what a CUDA graph's replay ran, which no counted op or recorded launch says
            out = work_by_key(replayed, [], 1.0) | (out or {})
        return out

    def breakdown(self, by: str = "op", depth: int | None = None, ceilings: dict | None = None) -> list:
        """Device time by "module" (qualified name; backward charged to the forward module,
        optimizer kernels to "optimizer"), by the aten "op" that launched each kernel, by
        "kernel", or by "category" (matmul, attention, normalization, elementwise, ...): rows of
        (name, calls, device_ms over all calls, share, backward_ms), largest first. Kernels no op
        launched keep their own rows. Where the work was counted (the default), rows also carry
        the estimated FLOPs and bytes and, against the measured ceilings, GB/s, TFLOP/s, share
        of each ceiling, bound and headroom. `depth` rolls modules up to that many name parts."""
        from perfloop.analysis.attribution import group

        work = self._work()
        if work is not None and ceilings is None:
            ceilings = measured_ceilings()
        return group(
            self.items(), by, depth, work, ceilings, _device.l2_bytes() if self.kind == "cuda" else 0
        )

    def idle(self) -> Idle | None:
        """When and why the device sat idle (timeline.Idle): on a CPU, the time between the
        step's ops."""
        from perfloop.analysis.timeline import HostCompiled, idle

        if self._prof is None:
            return None
        sites: dict = {}
        for r in self._counted[0] if self._counted else []:
            if r is not None and r.site:
                sites.setdefault(r.op, set()).add(r.site)
        its = self.items()
        pageable = [(i.start_us, i.end_us) for i in its if "Pageable" in i.kernel]
        events, intervals = self._prof.events(), [(i.start_us, i.end_us) for i in its]
        spans = self._windows or self._call_spans
        if self.kind != "cuda" and spans and len(spans) > 1:
            # a CPU: the call (step) that idled least, as every call's (another process's time
            # slices land between ops too)
            each = [
                idle(events, intervals, sites, [s], pageable=pageable, samples=self._samples) for s in spans
            ]
            each = [r for r in each if r is not None]
            r = min(each, key=lambda x: x.idle_ms).times(len(spans)) if each else None
        else:
            graphs = self._graph_calls  # none recorded: the launch gaps are not split by them
            compiled = HostCompiled(
                compiling=tuple((c.start_us, c.end_us) for c in self.compiles()),
                between=tuple(self._between_regions()),
                breaks={b.where: set(b.frames) for b in self.graph_breaks()},
                graph_calls=tuple(graphs) if graphs else None,
            )
            r = idle(
                events,
                intervals,
                sites,
                spans,
                launched_at=[i.launch_us for i in its] if self.kind == "cuda" else None,
                pageable=pageable,
                samples=self._samples,
                compiled=compiled,
            )
        if r is not None:
            r.device = "GPU" if self.kind == "cuda" else "CPU"
            why = unsampled_launcher(self._prof.events()) if self._samples else None
            if why and why not in self.warnings:
                self.warnings.append(why)
        if r is not None and self.profiled_wall_ms_per_call and self.kind == "cuda":
            # a GPU's busy time is the profiler's too; on a CPU the ops are the host's, as slow as it
            # is under the profiler, and a separate unprofiled run under other load says little
            r = r.scaled_to(self.wall_ms_per_call * self.calls)
        return r

    def table(self, top: int = 10) -> str:
        unit = "kernel" if self.kind == "cuda" else "op"
        rows = [f"{unit:<48} {'calls':>6} {'total':>10} {'mean':>10} {'share':>6}"]
        for k in self.kernels[:top]:
            rows.append(
                f"{k.short[:48]:<48} {k.calls:>6} {fmt_ms(k.total_ms):>10} "
                f"{fmt_ms(k.mean_us / 1e3):>10} {k.share:>6.1%}"
            )
        if self.kind == "cuda" or not self.profiled_wall_ms_per_call:
            rows.append(
                f"{self.distinct_kernels} distinct {unit}s, {self.launches_per_call:g} launches/call, "
                f"device {fmt_ms(self.device_ms_per_call)}/call, "
                f"wall {fmt_ms(self.wall_ms_per_call)}/call, "
                f"busy {self.gpu_busy_fraction:.0%}"
            )
        else:  # the ops are the host's own time, slowed by the profiler: set against its wall
            prof_wall = self.profiled_wall_ms_per_call
            rows.append(
                f"{self.distinct_kernels} distinct {unit}s, {self.launches_per_call:g} launches/call, "
                f"ops {fmt_ms(self.device_ms_per_call)}/call of {fmt_ms(prof_wall)} wall under the "
                f"profiler ({min(1.0, self.busy_ms_per_call / prof_wall):.0%}); "
                f"wall {fmt_ms(self.wall_ms_per_call)}/call without it"
            )
        return "\n".join(rows)

    def export_trace(self, path: str | os.PathLike) -> Path:
        """Write a Chrome trace (open in Perfetto or chrome://tracing)."""
        p = Path(path)
        if p.parent and not p.parent.exists():
            raise FileNotFoundError(f"path: folder {p.parent} does not exist; create it first")
        if not os.access(p.parent or Path("."), os.W_OK):
            raise PermissionError(f"path: cannot write to {p.parent}; choose a writable location")
        if self._prof is None:
            raise RuntimeError("this Profile holds no trace (it was loaded, not recorded)")
        self._prof.export_chrome_trace(str(p))
        return p

    def diagnose(self, ceilings: dict | None = None) -> Diagnosis:
        """The findings, largest time saved first (ranking.rank over this profile's capture). With
        `work` given: what kind of bound this one op is, as a one-finding diagnosis."""
        from perfloop.analysis.diagnose import diagnose
        from perfloop.analysis.ranking import rank

        if not self.items():
            from perfloop.analysis.findings import Diagnosis

            return Diagnosis(
                [],
                self.wall_ms_per_call,
                0.0,
                0.0,
                note=(
                    f"the calls ran no torch op the profiler recorded ({fmt_ms(self.wall_ms_per_call)} of "
                    "wall time a call): their work ran on another thread (the profiler records the threads "
                    "it runs on: profile inside that thread), or they did no torch work"
                ),
            )
        if self.work is not None:
            return diagnose(self, ceilings)
        return rank(self.capture(), ceilings if ceilings is not None else measured_ceilings())

    def tokens(self, given: int | None = None, ceilings: dict | None = None) -> Tokens | None:
        """The step read per token (analysis.tokens.Tokens), or None where it makes no tokens
        that can be told: `given` (--tokens), else the embedding's input, else the KV cache."""
        from perfloop.analysis.tokens import read

        ceilings = ceilings if ceilings is not None else measured_ceilings()
        return read(self.capture(), ceilings, given)

    def capture(self) -> Capture:
        """This profile as the analyzers read it (capture.Capture): parsed once, frozen."""
        return self._capture

    @functools.cached_property
    def _capture(self) -> Capture:
        from perfloop.analysis.capture import Capture, CompileFacts
        from perfloop.analysis.idle_record import Cause

        records, counted_items, _ = self._counted or (None, None, 1)
        idle = self.idle()
        if idle is not None and self.step is None:  # pl.profile's calls: the wait for the first is ours
            idle.by_cause[Cause.FIRST] = 0.0
        wall = self.wall_ms_per_call
        if self.kind != "cuda" and self.profiled_wall_ms_per_call:
            # a CPU: the unprofiled run and the profiled one at the faster one's pace (another
            # process's load can slow either: a loaded run read 175 ms unprofiled over 24 of ops)
            wall = min(wall, self.profiled_wall_ms_per_call)
        code = self.compiled_code()
        facts = None
        if code is not None:
            facts = CompileFacts(code, tuple(self.compiled_regions()), tuple(self._graph_calls))
        return Capture(
            device=self.kind,
            calls=self.calls,
            wall_ms=wall,
            items=tuple(self.items()),
            records=tuple(records) if records is not None else None,
            counted_items=tuple(counted_items) if counted_items is not None else None,
            work=self._work(),
            idle=idle,
            l2_bytes=_device.l2_bytes() if self.kind == "cuda" else 0,
            sites=self.sites,
            compiled=facts,
            step=self.step,
            model={**(self.model_bytes or {}), "tokens": self.tokens_seen}
            if self.model_bytes or self.tokens_seen
            else None,
        )

    def compiled_code(self) -> CompiledCode | None:
        """compilation.CompiledCode of the profiled calls, None where nothing ran compiled: a
        region that ran no compiled graph (pl.patch's rewritten forwards, captured by Dynamo and
        run eager; a backend that runs the graph as captured) is eager code."""
        from perfloop.analysis.compilation import CompiledCode, host_launched

        ran, made = self.compiled_regions(), self.compiles()
        starts = [g[0] for g in self._graph_calls]  # a compiled graph's call, or AOTAutograd's function
        starts += [e.time_range.start for e in self.events() if e.name.startswith("CompiledFunction")]
        if not made and not any(a <= g <= b for a, b, _ in ran for g in starts):
            return None
        pace = 1.0
        if self.profiled_wall_ms_per_call:
            pace = min(1.0, self.wall_ms_per_call / self.profiled_wall_ms_per_call)
        launched = self.kind == "cuda" and host_launched(ran, self.items())  # CUDA graphs: CUDA only
        skips = skips_of(self.cudagraph_skips or [], ran, launched)
        return CompiledCode(made, self.graph_breaks(), len(ran) / self.calls, pace, skips)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "calls": self.calls,
            "device_ms_per_call": self.device_ms_per_call,
            "busy_ms_per_call": self.busy_ms_per_call,
            "wall_ms_per_call": self.wall_ms_per_call,
            "profiled_wall_ms_per_call": self.profiled_wall_ms_per_call,
            "host_ms_per_call": self.host_ms_per_call,
            "launches_per_call": self.launches_per_call,
            "gpu_busy_fraction": self.gpu_busy_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "kernels": [k.__dict__ | {"mean_us": k.mean_us} for k in self.kernels],
            "warnings": self.warnings,
        }


def _activity(events, on_cuda: bool, warnings: list[str], spans=None) -> tuple[str, list[tuple], int]:
    """(kind, [(name, start us, end us)], launches) of the recorded work: on a GPU its device
    activity (kernels, memcpy, memset -- not the GPU-side mirrors of record_function ranges,
    ours included, which span whole regions and are not work), else the outermost CPU ops;
    with `spans`, what was launched inside them."""
    if spans:
        from perfloop.analysis.attribution import items, within

        its = within(items(events, "cuda" if on_cuda else "cpu"), spans)
        inside = Spans(spans)
        launches = sum(1 for e in events if e.name in KERNEL_LAUNCHES and e.time_range.start in inside)
        kind = "cuda" if on_cuda and its else "cpu"
        return kind, [(i.kernel, i.start_us, i.end_us) for i in its], launches or len(its)
    dev = device_events(events, annotations(events))
    if on_cuda and not dev:
        warnings.append(
            "no kernel ran on the GPU: the call ran on the CPU (are its model and tensors on "
            "'cuda'?), or CUPTI recorded nothing; its CPU ops are shown instead"
        )
    if dev:
        items = [(e.name, e.time_range.start, e.time_range.end) for e in dev]
        launches = sum(1 for e in events if e.name in KERNEL_LAUNCHES) or len(
            [e for e in dev if "memset" not in e.name.lower() and "memcpy" not in e.name.lower()]
        )
        return "cuda", items, launches
    top = cpu_ops(events)
    items = [(e.name, e.time_range.start, e.time_range.end) for e in top]
    return "cpu", items, len(items)


def profile(
    fn: Callable,
    *args: Any,
    calls: int = 1,
    warmup: int = 2,
    work: Work | None = None,
    memory_snapshot: str | os.PathLike | None = None,
    cuda_profiler_range: bool = False,
    count_work: bool = True,
    **kwargs: Any,
) -> Profile:
    """Profile `calls` calls of fn(*args) after `warmup` calls.

    Every nn.Module called meanwhile is a range named by its qualified name, so each kernel is
    charged to its op and module (`Profile.breakdown`). With `count_work` (the default) one more
    call runs under a dispatch mode that counts each op's FLOPs and bytes (the timed calls do
    not), for the roofline columns and the ranked `diagnose()`. So fn runs `warmup` + 2 x `calls`
    (timed without, then with the profiler) + 1 (counted) times, and once more on a GPU for its
    peak memory: a training step takes that many optimizer steps.

    `cuda_profiler_range=True` brackets the profiled calls with cudaProfilerStart/Stop, so
    Nsight Systems run with `--capture-range=cudaProfilerApi` captures exactly them.

    >>> import torch, perfloop as pl
    >>> p = pl.profile(torch.nn.functional.gelu, torch.randn(1000))
    >>> p.launches_per_call >= 1
    True
    """
    if not callable(fn):
        raise TypeError(f"fn: must be callable, got {fn!r}")
    for name, v in (("calls", calls), ("warmup", warmup)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "calls" else 0):
            raise ValueError(f"{name}: must be an integer >= {1 if name == 'calls' else 0}, got {v!r}")
    call = functools.partial(fn, *args, **kwargs)
    on_cuda = _device.has_cuda()
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    with tracking_sources():  # a model first compiled here: its kernels placed in its modules
        return _profiled(
            call, calls, warmup, on_cuda, sync, memory_snapshot, cuda_profiler_range, count_work, work
        )


def _profiled(call, calls, warmup, on_cuda, sync, memory_snapshot, cuda_profiler_range, count_work, work):
    for _ in range(max(warmup, 1)):
        call()
    sync()

    peak = peak_memory(call, memory_snapshot) if on_cuda else None
    if memory_snapshot and not on_cuda:
        raise ValueError("memory_snapshot: CUDA memory snapshots need a CUDA GPU")
    warnings: list[str] = []
    plain_ms = plain_wall_ms(call, calls, sync, fastest=not on_cuda)
    with module_ranges() as tracker:
        prof, wall_ms, host, samples, spans = timed_calls(call, calls, on_cuda, cuda_profiler_range, warnings)
        trees = module_trees(reached_models(call) | tracker.roots)  # a compiled function's model too
        work_counted = counted_call(call, on_cuda, warnings, prof, trees) if count_work else None

    return build_profile(
        Recording(
            prof,
            calls,
            wall_ms,
            host * 1e3,
            on_cuda,
            warnings,
            work_counted,
            peak,
            work,
            plain_wall_ms=plain_ms,
            samples=samples,
            call_spans=spans,
            compile_metrics=live_metrics(),
            break_reasons=live_break_reasons(),
            cudagraph_skips=live_cudagraph_skips(),
            trees=trees,
        )
    )


@dataclass
class Recording:
    """What a source recorded (pl.profile's calls, a script's window, a trace file), handed to
    build_profile whole: a stopped profiler (`prof`: anything with events()) over `calls` calls,
    times over all of them. `range_name`: the profile is of the work launched inside that range's
    occurrences only, the wall time theirs; `plain_wall_ms`: the same calls' wall time without the
    profiler; `samples`: the launching thread's stack samples; `call_spans`: each call's host
    interval; `given_work`: (events, kind, windows) -> {(module, phase, op): work}, for a trace that
    carries shapes; `step`: what one call is (a script's range); `sites`: pl.patch's call sites by
    module; `trees`: the models run (inductor.module_trees), where compiled kernels are placed."""

    prof: Any
    calls: int
    wall_ms: float
    host_ms: float
    on_cuda: bool
    warnings: list[str] = field(default_factory=list)
    counted: Any = None  # (records, items, calls) of the counted call
    peak: int | None = None
    work: Work | None = None
    range_name: str | None = None
    plain_wall_ms: float | None = None
    samples: Any = None
    call_spans: Any = None
    given_work: Any = None
    window_cut_s: float | None = None
    compile_metrics: list | None = None
    break_reasons: list | None = None
    cudagraph_skips: list | None = None
    step: str | None = None
    sites: dict | None = None
    trees: list | None = None


def build_profile(r: Recording) -> Profile:
    """A Profile of what a source recorded (Recording)."""
    from perfloop.analysis.attribution import windows

    events = r.prof.events()
    warnings, wall_ms, host_ms, plain_wall_ms = r.warnings, r.wall_ms, r.host_ms, r.plain_wall_ms
    spans = windows(events, r.range_name) if r.range_name else None
    kind, items, launches = _activity(events, r.on_cuda, warnings, spans)
    if spans:
        wall_ms = host_ms = sum(e - s for s, e in spans) / 1e3
        if plain_wall_ms and len(spans) > 1 and wall_ms * 1e3 < COVERED * (spans[-1][1] - spans[0][0]):
            warnings.append(
                f"idle time measured under the profiler: other work runs between the "
                f"occurrences of {r.range_name!r}, so their pace is not its time"
            )
            plain_wall_ms = None
        if kind != "cuda" and len(spans) > 1:  # a CPU: each occurrence at the fastest one's pace
            wall_ms = host_ms = min(e - s for s, e in spans) * len(spans) / 1e3
    kernels = kernel_table(items)
    total = sum(k.total_ms for k in kernels) or 1e-12
    return Profile(
        kernels=kernels,
        calls=r.calls,
        device_ms_per_call=total / r.calls,
        busy_ms_per_call=union_ms([(s, e) for _, s, e in items]) / r.calls,
        wall_ms_per_call=(plain_wall_ms if plain_wall_ms else wall_ms) / r.calls,
        profiled_wall_ms_per_call=wall_ms / r.calls if plain_wall_ms else None,
        host_ms_per_call=host_ms / r.calls,
        launches_per_call=launches / r.calls,
        kind=kind,
        peak_memory_bytes=r.peak,
        work=r.work,
        warnings=warnings,
        _prof=r.prof,
        _counted=r.counted,
        _windows=spans,
        _samples=r.samples,
        _call_spans=r.call_spans,
        _given_work=r.given_work(events, kind, spans) if r.given_work is not None else None,
        window_cut_s=r.window_cut_s,
        compile_metrics=r.compile_metrics,
        break_reasons=r.break_reasons,
        cudagraph_skips=r.cudagraph_skips,
        step=r.step,
        sites=r.sites,
        _trees=r.trees,
    )
