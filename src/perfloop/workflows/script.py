"""Profile a window of a user's script, run unchanged: `perfloop profile --script train.py`.

The window is the occurrences `skip + 1 .. skip + steps` of an `annotate(name)` range (the
script's own `pl.annotate("step")`), then one more occurrence is counted for FLOPs and bytes;
or, for a script without ranges, a time window that opens and closes at the first module call
or range after its start and end. The script's own errors end the run: the profiler is stopped,
the traceback is the script's, and nothing is kept.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from perfloop import device as _device
from perfloop.analysis import profiling
from perfloop.analysis.modules import module_ranges
from perfloop.analysis.work import WorkCounter


class ScriptError(Exception):
    """The script raised: `.original` is its exception."""

    def __init__(self, original: BaseException):
        super().__init__(f"the script raised {type(original).__name__}: {original}")
        self.original = original


@dataclass
class _Window:
    range_name: str | None
    skip: int
    steps: int
    window: tuple[float, float] | None
    count_work: bool
    on_cuda: bool
    seen: Counter = field(default_factory=Counter)
    state: str = "before"  # before, timed, counting, done
    prof: object = None
    counted_prof: object = None
    counter: object = None
    t0: float = 0.0
    timed_at: float = 0.0
    wall_ms: float = 0.0
    enters: list = field(default_factory=list)  # when the skipped occurrences began
    calls: int = 0
    warnings: list = field(default_factory=list)

    # ---- ranges
    def enter(self, name: str) -> None:
        self.seen[name] += 1
        if self.range_name is None:
            self.tick()
            return
        if name != self.range_name:
            return
        n = self.seen[name]
        if self.state == "before":
            self.enters.append(time.perf_counter())
        if self.state == "before" and n == self.skip + 1:
            self._start_timed()
        elif self.state == "timed_done" and self.count_work:
            self._sync()
            self.counted_prof = profiling.start_profiler(self.on_cuda, [])
            self.counter = WorkCounter()
            self.counter.__enter__()
            self.state = "counting"

    def exit(self, name: str) -> None:
        if name != self.range_name:
            return
        if self.state == "timed":
            self.calls += 1
            if self.calls == self.steps:
                self._stop_timed()
        elif self.state == "counting":
            self._stop_counting()

    # ---- a time window, checked at each module call
    def tick(self, *_args) -> None:
        if self.range_name is not None or self.window is None:
            return
        now = time.perf_counter() - self.t0
        start, duration = self.window
        if self.state == "before" and now >= start:
            self._start_timed()
        elif self.state == "timed" and now >= start + duration:
            self.calls = 1
            self._stop_timed()

    # ---- the profilers
    def _sync(self):
        if self.on_cuda:
            torch.cuda.synchronize()

    def _start_timed(self):
        self._sync()
        self.prof = profiling.start_profiler(self.on_cuda, self.warnings)
        self.timed_at = time.perf_counter()
        self.state = "timed"

    def _stop_timed(self):
        self._sync()
        self.wall_ms = (time.perf_counter() - self.timed_at) * 1e3
        profiling.stop_profiler(self.prof)
        self.state = "timed_done" if self.count_work and self.range_name else "done"

    def _stop_counting(self):
        self.counter.__exit__(None, None, None)
        self._sync()
        profiling.stop_profiler(self.counted_prof)
        self.state = "done"

    def abandon(self):
        """Stop whatever is running (the script ended or raised inside the window)."""
        if self.state == "counting":
            self.counter.__exit__(None, None, None)
            profiling.stop_profiler(self.counted_prof)
            self.counted_prof = None
        elif self.state == "timed":
            if self.range_name is None:
                self.calls = 1
                self._stop_timed()
            else:
                profiling.stop_profiler(self.prof)
                self.state = "abandoned"


def profile_script(
    path: str | os.PathLike,
    argv: list[str] = (),
    range_name: str | None = "step",
    skip: int = 0,
    steps: int = 1,
    window: tuple[float, float] | None = None,
    count_work: bool = True,
) -> profiling.Profile:
    """Run the script at `path` with `argv` as its arguments and profile a window of it.

    `range_name`: the annotate range whose occurrences `skip + 1 .. skip + steps` are profiled
    (calls = steps); None with `window=(start s, duration s)`: the time window instead.
    Raises ValueError for a window that never opened (naming the ranges seen), ScriptError
    when the script raised.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"script: {path} is not a file")
    for name, v, low in (("skip", skip, 0), ("steps", steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"--{name}: must be an integer >= {low}, got {v!r}")
    if range_name is None and window is None:
        raise ValueError("--range or --window: say which part of the script to profile")
    if window is not None and (len(window) != 2 or window[0] < 0 or not window[1] > 0):
        raise ValueError(f"--window: must be START:DURATION in seconds, DURATION > 0, got {window!r}")
    w = _Window(range_name, skip, steps, window, count_work, _device.has_cuda())
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    profiling.RANGE_WATCHERS.append(w)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(w.tick)
    try:
        with module_ranges():
            w.t0 = time.perf_counter()
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise ScriptError(exc) from exc
            except Exception as exc:
                raise ScriptError(exc) from exc
            finally:
                w.abandon()
    finally:
        hook.remove()
        profiling.RANGE_WATCHERS.remove(w)
        sys.argv, sys.path[:] = saved_argv, saved_path
    return _result(w)


def _result(w: _Window) -> profiling.Profile:
    if w.range_name is not None and w.seen[w.range_name] == 0:
        seen = ", ".join(f"{n} (x{c})" for n, c in w.seen.most_common()) or "none"
        raise ValueError(f"--range: no range named {w.range_name!r} occurred; ranges seen: {seen}. "
                         "Wrap each step in `with perfloop.annotate('step'):`, or use --window")  # fmt: skip
    if w.prof is None or w.state == "abandoned":
        have = w.seen[w.range_name] if w.range_name else 0
        raise ValueError(f"--skip/--steps: the script ran {have} occurrence(s) of {w.range_name!r}; "
                         f"--skip {w.skip} --steps {w.steps} needs {w.skip + w.steps}" if w.range_name
                         else "--window: the script ended before the window opened")  # fmt: skip
    if w.count_work and w.range_name and w.counted_prof is None:
        w.warnings.append(f"FLOPs and bytes not counted: no occurrence of {w.range_name!r} after the "
                          "profiled ones (keep --skip plus --steps below the script's count)")  # fmt: skip
    counted = profiling.counted(w.counted_prof, w.counter.records, w.on_cuda) if w.counted_prof else None
    periods = sorted(b - a for a, b in zip(w.enters, w.enters[1:], strict=False))
    plain = periods[len(periods) // 2] * 1e3 * max(w.calls, 1) if periods else None
    if w.range_name and plain is None:
        w.warnings.append("idle time measured under the profiler, which slows the host: --skip 2 or more "
                          "times the unprofiled steps and scales the idle to them")  # fmt: skip
    return profiling.build_profile(w.prof, max(w.calls, 1), w.wall_ms, w.wall_ms, w.on_cuda, w.warnings,
                                   counted, range_name=w.range_name, plain_wall_ms=plain)  # fmt: skip
