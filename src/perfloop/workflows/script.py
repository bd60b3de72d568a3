"""Profile a window of a user's script, run unchanged: `perfloop profile --script train.py`.

The window is the occurrences `skip + 1 .. skip + steps` of an `annotate(name)` range (the
script's own `pl.annotate("step")`), then one more occurrence is counted for FLOPs and bytes;
or, for a script without ranges, a time window that opens and closes at the first module call
or range after its start and end. The script's own errors end the run: the profiler is stopped,
the traceback is the script's, and nothing is kept.

The script runs as under plain `python`: its threads call modules freely (module ranges are kept
per thread), a torch.profiler of its own records what it would alone (perfloop's gives way: one
profiler records at a time), `os.chdir` and `os._exit` in its main thread end where they would,
with the analysis still made.
"""

from __future__ import annotations

import contextlib
import math
import os
import runpy
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from perfloop import device as _device
from perfloop.analysis import profiling
from perfloop.analysis.modules import module_ranges
from perfloop.analysis.work import WorkCounter


class _Exit(BaseException):  # noqa: N818 -- os._exit(code) called in the script's main thread
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class ScriptError(Exception):
    """The script raised or exited with a non-zero code: `.original` is its exception, `.code`
    the exit code (None when it raised)."""

    def __init__(self, original: BaseException):
        self.original = original
        self.code = original.code if isinstance(original, (SystemExit, _Exit)) else None
        if self.code is not None:
            how = "os._exit" if isinstance(original, _Exit) else "sys.exit"
            super().__init__(f"the script exited with {how}({self.code!r})")
        else:
            super().__init__(f"the script raised {type(original).__name__}: {original}")


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
    lock: object = field(default_factory=threading.RLock)
    starting: bool = False  # perfloop's own profiler is being started
    theirs: set = field(default_factory=set)  # the script's own profilers, recording or about to
    blocked: str | None = None  # the script's own profiler kept perfloop's from starting
    ended_at: float | None = None  # seconds into a time window when the script ended

    # ---- ranges
    def enter(self, name: str) -> None:
        with self.lock:
            self._enter(name)

    def _enter(self, name: str) -> None:
        self.seen[name] += 1
        if self.range_name is None:
            self.tick()
            return
        if name != self.range_name:
            return
        n = self.seen[name]
        if self.state == "before":
            self.enters.append(time.perf_counter())
        if self.state == "before" and n >= self.skip + 1:
            self._start_timed()
        elif self.state == "timed_done" and self.count_work and not self.theirs:
            self._sync()
            self.counted_prof = self._start([])
            self.counter = WorkCounter()
            self.counter.__enter__()
            self.state = "counting"

    def exit(self, name: str) -> None:
        if name != self.range_name:
            return
        with self.lock:
            self._exit()

    def _exit(self) -> None:
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
        with self.lock:
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

    def _start(self, warnings: list):
        self.starting = True
        try:
            return profiling.start_profiler(self.on_cuda, warnings)
        finally:
            self.starting = False

    def _start_timed(self):
        if self.theirs:  # the script's profiler records now: try again at the next step or call
            self.blocked = "was recording when the window was to open"
            return
        if self.blocked:
            late = time.perf_counter() - self.t0
            self.warnings.append(f"the window opened late ({late:.3g} s into the script, occurrence "
                                 f"{sum(self.seen.values())}): the script's own torch.profiler was "
                                 "recording until then")  # fmt: skip
        self._sync()
        self.prof = self._start(self.warnings)
        self.timed_at = time.perf_counter()
        self.state = "timed"

    def _give_way(self) -> None:
        """The script's own torch.profiler starts inside the window: perfloop's stops."""
        with self.lock:
            if self.state == "timed":
                profiling.stop_profiler(self.prof)
                self.state = "yielded"
            elif self.state == "counting":
                self.counter.__exit__(None, None, None)
                profiling.stop_profiler(self.counted_prof)
                self.counted_prof = None
                self.state = "done"
                self.warnings.append("FLOPs and bytes not counted: the script's own torch.profiler "
                                     "started in the counted step")  # fmt: skip

    # ---- the script's own torch.profiler (any torch.autograd.profiler.profile not perfloop's)
    @contextlib.contextmanager
    def sharing_the_profiler(self):
        cls = torch.autograd.profiler.profile
        prepare, leave = cls._prepare_trace, cls.__exit__
        w = self

        def _prepare_trace(prof):
            if not w.starting:
                w.theirs.add(id(prof))
                if w.state in ("timed", "counting"):
                    w._give_way()
            return prepare(prof)

        def __exit__(prof, *exc):  # noqa: N807
            try:
                return leave(prof, *exc)
            finally:
                w.theirs.discard(id(prof))

        cls._prepare_trace, cls.__exit__ = _prepare_trace, __exit__
        try:
            yield
        finally:
            cls._prepare_trace, cls.__exit__ = prepare, leave

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
        if self.state == "timed" and self.range_name is None:
            self.ended_at = time.perf_counter() - self.t0 - self.window[0]
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
    if window is not None and (len(window) != 2 or not all(math.isfinite(v) for v in window)
                               or window[0] < 0 or not window[1] > 0):  # fmt: skip
        raise ValueError(f"--window: must be START:DURATION in finite seconds, START >= 0, DURATION > 0, "
                         f"got {window!r}")  # fmt: skip
    w = _Window(range_name, skip, steps, window, count_work, _device.has_cuda())
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    profiling.RANGE_WATCHERS.append(w)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(w.tick)
    try:
        with module_ranges(quiet=lambda: bool(w.theirs)), w.sharing_the_profiler(), _exit_in_main_thread():
            w.t0 = time.perf_counter()
            try:
                runpy.run_path(path, run_name="__main__")
            except (SystemExit, _Exit) as exc:
                if exc.code not in (None, 0):
                    raise ScriptError(exc) from exc
                if isinstance(exc, _Exit):
                    w.warnings.append("the script called os._exit(0): its process would end there without "
                                      "running finally blocks or atexit handlers; perfloop made its "
                                      "analysis first")  # fmt: skip
            except Exception as exc:
                raise ScriptError(exc) from exc
            finally:
                w.abandon()
    finally:
        hook.remove()
        profiling.RANGE_WATCHERS.remove(w)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    return _result(w)


@contextlib.contextmanager
def _exit_in_main_thread():
    """os._exit(code) in the script's own thread ends the script like sys.exit, so the analysis
    is still made; from another thread it ends the process as it would, saying so first."""
    real, main = os._exit, threading.get_ident()

    def _exit(code):
        if threading.get_ident() == main:
            raise _Exit(code)
        print(f"perfloop: the script called os._exit({code}) from a worker thread: the process ends "
              "before the analysis", file=sys.stderr, flush=True)  # fmt: skip
        real(code)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _result(w: _Window) -> profiling.Profile:
    if w.range_name is not None and w.seen[w.range_name] == 0:
        seen = ", ".join(f"{n} (x{c})" for n, c in w.seen.most_common()) or "none"
        raise ValueError(f"--range: no range named {w.range_name!r} occurred; ranges seen: {seen}. "
                         "Wrap each step in `with perfloop.annotate('step'):`, or use --window")  # fmt: skip
    if w.state == "yielded" or (w.prof is None and w.blocked):
        raise ValueError("the script runs torch.profiler itself, over the window perfloop was to profile: "
                         "one profiler records at a time, so perfloop gave way and the script's profiler "
                         "recorded as it would alone. Read the trace it writes with `perfloop "
                         "profile --trace-file TRACE.json`, or turn the script's profiler off for "
                         "this run")  # fmt: skip
    if w.prof is None or w.state == "abandoned":
        have = w.seen[w.range_name] if w.range_name else 0
        raise ValueError(f"--skip/--steps: the script ran {have} occurrence(s) of {w.range_name!r}; "
                         f"--skip {w.skip} --steps {w.steps} needs {w.skip + w.steps}" if w.range_name
                         else "--window: the script ended before the window opened")  # fmt: skip
    if w.ended_at is not None:
        w.warnings.append(f"--window: the script ended {w.ended_at:.3g} s into the window of "
                          f"{w.window[1]:g} s: profiled {w.ended_at:.3g} s only")  # fmt: skip
    if w.count_work and w.range_name and w.counted_prof is None:
        w.warnings.append(f"FLOPs and bytes not counted: no occurrence of {w.range_name!r} after the "
                          "profiled ones (keep --skip plus --steps below the script's count)")  # fmt: skip
    counted = profiling.counted(w.counted_prof, w.counter.records, w.on_cuda) if w.counted_prof else None
    periods = sorted(b - a for a, b in zip(w.enters, w.enters[1:], strict=False))
    plain = periods[len(periods) // 2] * 1e3 * max(w.calls, 1) if periods else None
    if w.range_name and plain is None:
        w.warnings.append("idle time measured under the profiler, which slows the host: --skip 2 or more "
                          "times the unprofiled steps and scales the idle to them")  # fmt: skip
    p = profiling.build_profile(w.prof, max(w.calls, 1), w.wall_ms, w.wall_ms, w.on_cuda, w.warnings,
                                counted, range_name=w.range_name, plain_wall_ms=plain)  # fmt: skip
    if not p.items():
        what = f"{w.calls} occurrence(s) of {w.range_name!r}" if w.range_name else f"the window {w.window}"
        raise ValueError(f"the profiled {what} ran no torch op ({w.wall_ms:.3g} ms of wall time): nothing to "
                         "analyse; choose steps or a window where the script computes")  # fmt: skip
    return p
