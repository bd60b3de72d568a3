"""Profile a window of a user's script, run unchanged: `perfloop profile --script train.py`.

The window is the occurrences `skip + 1 .. skip + steps` of a step, then one more occurrence is
counted for FLOPs and bytes. A step is, by default, the work between two `optimizer.step()`
calls of a torch.optim optimizer (the first one that steps), or a range named "step" where the
script has one; by name, any range the script opens: `pl.annotate`, `torch.profiler.
record_function`, NVTX (`torch.cuda.nvtx.range_push`), torch.profiler's own `ProfilerStep#N`
(named "ProfilerStep"). For a script without steps, a time window that opens and closes at the
first module call or range after its start and end. The script's own errors end the run: the
profiler is stopped, the traceback is the script's, and nothing is kept.

The script runs as under plain `python`: its threads call modules freely (module ranges are kept
per thread), a torch.profiler of its own records what it would alone (one profiler records at a
time: perfloop's records only before the script's first starts), `os.chdir` and `os._exit` in
its main thread end where they would, with the analysis still made.
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
from perfloop.analysis import annotate, compilation, counting, profiling, recording
from perfloop.analysis.inductor import tracking_sources
from perfloop.analysis.modules import module_ranges
from perfloop.analysis.stacks import Sampler
from perfloop.analysis.work import WorkCounter
from perfloop.workflows.compiled_script import compile_callbacks, say_compiled
from perfloop.workflows.models_seen import models_seen
from perfloop.workflows.step_sources import OPTIMIZER_STEP, nvtx_sources, step_sources

AUTO = "auto"  # the step: "step" ranges or optimizer.step() boundaries, whichever occurs first


class _Exit(BaseException):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Taken(BaseException):
    pass


def exit_status(code) -> int:
    """The process status Python gives `sys.exit(code)`: None 0, an int modulo 256 (-1 is 255),
    anything else (a message) 1."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


class ScriptError(Exception):
    """The script raised, was interrupted or exited with a non-zero code: `.original` is its
    exception, `.code` the exit code (None when it raised), `.status` the process status python
    would end with, `.profile` the profile taken before it failed (None if none was)."""

    def __init__(self, original: BaseException, profile=None):
        self.original, self.profile = original, profile
        self.code = original.code if isinstance(original, (SystemExit, _Exit)) else None
        if isinstance(original, KeyboardInterrupt):
            self.status = 130
        else:
            self.status = exit_status(self.code) if self.code is not None else 1
        if isinstance(original, KeyboardInterrupt):
            super().__init__("the script was interrupted (Ctrl-C)")
        elif self.code is not None:
            how = "os._exit" if isinstance(original, _Exit) else "sys.exit"
            super().__init__(f"the script exited with {how}({self.code!r})")
        elif _perfloops_import(original):
            super().__init__(
                f"perfloop, called by the script, could not import {original.name!r} ({original}): "
                + (
                    'pip install "perfloop[triton]" for its fused kernels'
                    if original.name == "triton"
                    else "a package perfloop needs for what the script asked is missing"
                )
            )
        else:
            super().__init__(f"the script raised {type(original).__name__}: {original}")


def _perfloops_import(exc: BaseException) -> bool:
    """Whether exc is an ImportError of an import statement in perfloop's own code (not the
    script's): the innermost frame of code that ran it, the import machinery's and the runner's
    own frames aside, is perfloop's."""
    if not isinstance(exc, ImportError):
        return False
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the perfloop package
    frames, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith("<frozen") and code.co_name not in _IMPORT_MACHINERY:
            frames.append(os.path.abspath(code.co_filename))
        tb = tb.tb_next
    while frames and frames[0].startswith(here):  # the runner that ran the script
        frames.pop(0)
    return bool(frames) and frames[-1].startswith(here)


_IMPORT_MACHINERY = {"find_spec", "find_module", "exec_module", "load_module", "_find_and_load"}


PACED = 20  # the occurrences after the profile timed for the unprofiled pace, at most
MORE_SKIPS = 6  # by default, steps skipped beyond --skip while the one before compiled


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
    sampler: object = None  # the script thread's stack, sampled while the timed profiler runs
    sampler_mark: int = 0
    counter: object = None
    t0: float = 0.0
    timed_at: float = 0.0
    wall_ms: float = 0.0
    enters: dict = field(default_factory=dict)  # occurrence -> when it began, for the skipped ones
    paced: dict = field(default_factory=dict)  # ... for those after the profile, where the script runs on
    auto_skip: bool = False  # skip more than `skip` while the occurrence before compiled (not user-given)
    compiling: bool = False  # Dynamo compiled since the current occurrence began
    compiled: list = field(default_factory=list)  # the occurrences (1-based) in which Dynamo compiled
    has_compiled: bool = False  # Dynamo compiled in the script
    first_timed: int = 0  # the first profiled occurrence
    retaken: list = field(default_factory=list)  # profiled occurrences dropped because they compiled
    calls: int = 0
    warnings: list = field(default_factory=list)
    lock: object = field(default_factory=threading.RLock)
    starting: bool = False  # perfloop's own profiler is being started
    theirs_ran: bool = False  # the script's own torch.profiler has started: perfloop's records no more
    blocked: bool = False  # ... and so kept perfloop's window from opening or closing
    count_blocked: bool = False  # ... or from counting a step
    # a profiler stopped while a record_function range begun under it is still open corrupted
    # torch's heap (a segfault later): such a stop waits until those ranges have closed
    begun_since: object = None  # begun_since(mark): is a range begun after `mark` still open?
    mark: object = None  # () -> the newest range's mark
    started_mark: int = -1
    stop_due: str | None = None  # "timed" or "counting": to stop at the next safe point
    due_at: float = 0.0
    count_next: bool = False  # an occurrence began while the timed stop was due
    ended_at: float | None = None  # seconds the window had recorded when the script ended
    exit_after: bool = False  # end the script (in its main thread) once the profile is taken
    on_taken: object = None  # called once when it is taken and the script runs on
    main_thread: int = field(default_factory=threading.get_ident)
    pid: int = field(default_factory=os.getpid)  # a process forked from the script (a DataLoader
    # worker) inherits the window: there it must do nothing, the profile is the parent's
    taken: bool = False  # the profile was taken, and said so (or the script ended for it)
    read_sites: object = None  # () -> (pl.patch's call sites, inductor.ModuleTree) of the models seen
    trees: object = None
    sites: dict | None = None  # ... read when the window closed, while those models live

    def check_taken(self) -> None:
        """Once the profile is taken, at the next hook in the script's main thread: end the script
        there (exit_after: a BaseException its `except Exception` does not catch), else say so."""
        if self.state != "done" or self.taken or threading.get_ident() != self.main_thread:
            return
        self.taken = True
        if self.exit_after:
            raise _Taken()
        if self.on_taken is not None:
            self.on_taken()

    # ---- ranges
    def forked(self) -> bool:
        return os.getpid() != self.pid

    def enter(self, name: str) -> None:
        if self.forked():
            return
        with self.lock:
            self._enter(name)
        self.check_taken()

    def on_compile(self, *_args, **_kwargs) -> None:
        """Dynamo began compiling (its start callback)."""
        self.compiling = self.has_compiled = True

    def _enter(self, name: str) -> None:
        if name == self.range_name or (self.range_name == AUTO and name in ("step", OPTIMIZER_STEP)):
            if self.compiling and self.seen[name]:
                self.compiled.append(self.seen[name])
            self.compiling = False
        self.seen[name] += 1
        if self.range_name is None:
            self.tick()
            return
        if self.range_name == AUTO and name in ("step", OPTIMIZER_STEP):
            self.range_name = name  # the first of the two to occur is the step
        if name != self.range_name:
            return
        if self.stop_due == "timed":  # the next occurrence began: count it once the stop is made
            self.count_next = True
        n = self.seen[name]
        if self.state == "before":
            self.enters[n] = time.perf_counter()
        elif self.state == "done" and len(self.paced) < PACED:
            self.paced[n] = time.perf_counter()
        # wait past a step that compiled, unless the compiles recur (every step recompiles: that
        # is the steady state, and waiting would walk into Dynamo's recompile limit)
        recurring = {n - 1, n - 2} <= set(self.compiled) and n - 2 > 1
        waiting = (
            self.auto_skip
            and self.compiled[-1:] == [n - 1]
            and not recurring
            and n <= self.skip + 1 + MORE_SKIPS
        )
        if self.state == "before" and n >= self.skip + 1 and not waiting:
            self.first_timed = n
            self._start_timed()
        elif self.state == "timed_done" and self.count_work and self.theirs_ran:
            self.count_blocked, self.state = True, "done"
        elif self.state == "timed_done" and self.count_work:
            self._start_counting()

    def _start_counting(self) -> None:
        self._sync()
        shapes = self.has_compiled  # compiled kernels: their bytes from their recorded buffers
        self.counted_prof = self._start([], shapes=shapes)
        self.counter = WorkCounter()
        self.counter.__enter__()
        self.state = "counting"

    def exit(self, name: str) -> None:
        if name != self.range_name or self.forked():
            return
        with self.lock:
            self._exit()
        self.check_taken()

    def boundary(self, name: str) -> None:
        """A step boundary (an optimizer's step() returned): one occurrence ends, the next begins."""
        if self.forked():
            return
        with self.lock:
            if name == self.range_name:
                self._exit()
            self._enter(name)
        self.check_taken()

    def _exit(self) -> None:
        if self.stop_due:
            return
        if self.state == "timed":
            if self._retake():
                return
            self.calls += 1
            if self.calls == self.steps:
                self._stop_timed()
        elif self.state == "counting":
            self._stop_counting()

    def _retake(self) -> bool:
        """By default, a profiled occurrence that compiled is dropped and the window opens again
        past it -- unless compiles recur (the one before compiled too: the steady state) or a
        range begun under the profiler is still open (stopping now is unsafe)."""
        n = self.seen[self.range_name]
        if (
            not (self.auto_skip and self.compiling and len(self.retaken) < MORE_SKIPS)
            or n - 1 in self.compiled
        ):
            return False
        if self.begun_since is not None and self.begun_since(self.started_mark):
            return False
        self._sync()
        self._end_sampling()
        recording.stop_profiler(self.prof)
        self.prof, self.calls, self.state = None, 0, "before"
        self.retaken.append(n)
        return True

    # ---- a time window, checked at each module call
    @compilation.eager_hook  # traced into a graph, its state read would be a guard
    def tick(self, *_args) -> None:
        if self.range_name is not None or self.window is None or self.forked():
            return
        with self.lock:
            now = time.perf_counter() - self.t0
            start, duration = self.window
            if self.state == "before" and now >= start:
                self._start_timed()
            elif (
                self.state == "timed"
                and time.perf_counter() - self.timed_at >= duration
                and not self.stop_due
            ):
                self.calls = 1
                self._stop_timed()
        self.check_taken()

    # ---- the profilers
    def _sync(self):
        if self.on_cuda:
            torch.cuda.synchronize()

    def _start(self, warnings: list, shapes: bool = False):
        self.started_mark = self.mark() if self.mark else -1
        self.starting = True
        try:
            return recording.start_profiler(self.on_cuda, warnings, shapes)
        finally:
            self.starting = False

    def _start_timed(self):
        if self.theirs_ran:
            self.blocked = True
            return
        self._sync()
        self.prof = self._start(self.warnings)
        self.sampler = Sampler().__enter__()
        self.sampler_mark = self.sampler.mark()
        self.timed_at = time.perf_counter()
        self.state = "timed"

    def _end_sampling(self) -> None:
        if self.sampler is not None and self.sampler.running:
            self.sampler.__exit__(None, None, None)

    def _give_way(self) -> None:
        """The script's own torch.profiler starts: perfloop's stops, and records no more in this
        process (benchmarks/NOTES.md says why)."""
        with self.lock:
            if self.state == "timed":
                self._end_sampling()
                recording.stop_profiler(self.prof)
                self.prof, self.calls, self.state = None, 0, "before"
                self.blocked = True
            elif self.state == "counting":
                self.counter.__exit__(None, None, None)
                recording.stop_profiler(self.counted_prof)
                self.counted_prof, self.state, self.count_blocked = None, "done", True

    # ---- the script's own torch.profiler (any torch.autograd.profiler.profile not perfloop's)
    @contextlib.contextmanager
    def sharing_the_profiler(self):
        cls = torch.autograd.profiler.profile
        prepare = cls._prepare_trace
        w = self

        def _prepare_trace(prof):
            if not w.starting:
                w.theirs_ran = True
                if w.state in ("timed", "counting"):
                    w._give_way()
            return prepare(prof)

        cls._prepare_trace = _prepare_trace
        try:
            yield
        finally:
            cls._prepare_trace = prepare

    def _unsafe(self, what: str) -> bool:
        """Whether stopping now would leave a range begun under the profiler open (then the stop
        is due, made by settle() once they have closed)."""
        if self.begun_since is not None and self.begun_since(self.started_mark):
            if self.stop_due is None:
                self._sync()
                self.stop_due, self.due_at = what, time.perf_counter()
            return True
        return False

    def settle(self) -> None:
        if self.stop_due is not None:
            with self.lock:
                if self.stop_due == "timed":
                    self._stop_timed()
                    if self.state == "timed_done" and self.count_next and not self.theirs_ran:
                        self._start_counting()
                elif self.stop_due == "counting":
                    self._stop_counting()
        self.check_taken()

    def _stop_timed(self, force: bool = False):
        if self.state != "timed" or (not force and self._unsafe("timed")):
            return
        self._sync()
        self.wall_ms = ((self.due_at if self.stop_due else time.perf_counter()) - self.timed_at) * 1e3
        self.stop_due = None
        self._end_sampling()
        recording.stop_profiler(self.prof)
        self.state = "timed_done" if self.count_work and self.range_name else "done"
        if self.read_sites is not None and self.sites is None:
            self.sites, self.trees = self.read_sites()

    def _stop_counting(self, force: bool = False):
        if self.state != "counting" or (not force and self._unsafe("counting")):
            return
        self.stop_due = None
        self.counter.__exit__(None, None, None)
        self._sync()
        recording.stop_profiler(self.counted_prof)
        self.state = "done"

    def abandon(self):
        """Stop whatever is running (the script ended or raised inside the window)."""
        if self.state == "timed" and self.range_name is None:  # seconds the profiler recorded
            self.ended_at = time.perf_counter() - self.timed_at
        if self.state == "counting" and self.stop_due:
            self._stop_counting(force=True)
        elif self.state == "counting":
            self.counter.__exit__(None, None, None)
            recording.stop_profiler(self.counted_prof)
            self.counted_prof = None
        elif self.state == "timed" and self.stop_due:
            self._stop_timed(force=True)
        elif self.state == "timed":
            if self.range_name is None:
                self.calls = 1
                self._stop_timed(force=True)
            else:
                self._end_sampling()
                recording.stop_profiler(self.prof)
                self.state = "abandoned"
        self._end_sampling()


def _checked(path, skip, steps, range_name, window) -> tuple[str, bool, int, bool]:
    """profile_script's arguments checked: (path, whether it is a runnable folder, skip, whether
    skip was left to perfloop)."""
    path = os.fspath(path)
    runnable_dir = os.path.isdir(path) and os.path.isfile(os.path.join(path, "__main__.py"))
    if not (os.path.isfile(path) or runnable_dir):
        raise FileNotFoundError(f"script: {path} is not a file, nor a folder holding __main__.py")
    auto_skip = skip is None
    skip = 2 if skip is None else skip
    for name, v, low in (("skip", skip, 0), ("steps", steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"--{name}: must be an integer >= {low}, got {v!r}")
    if range_name is None and window is None:
        raise ValueError("--range or --window: say which part of the script to profile")
    if window is not None and (
        len(window) != 2 or not all(math.isfinite(v) for v in window) or window[0] < 0 or not window[1] > 0
    ):
        raise ValueError(
            f"--window: must be START:DURATION in finite seconds, START >= 0, DURATION > 0, got {window!r}"
        )
    return path, runnable_dir, skip, auto_skip


def profile_script(
    path: str | os.PathLike,
    argv: list[str] = (),
    range_name: str | None = AUTO,
    skip: int | None = 0,
    steps: int = 1,
    window: tuple[float, float] | None = None,
    count_work: bool = True,
    exit_after: bool = False,
    on_taken=None,
) -> profiling.Profile:
    """Run the script at `path` with `argv` as its arguments and profile a window of it.

    `skip=None`: 2, and more (up to MORE_SKIPS) while the step before compiled (Dynamo).
    `range_name`: the step whose occurrences `skip + 1 .. skip + steps` are profiled (calls =
    steps): AUTO (optimizer.step() boundaries, or "step" ranges), OPTIMIZER_STEP, or a range's
    name; None with `window=(start s, duration s)`: the time window instead. `exit_after`: end
    the script once the profile is taken (its `finally` blocks run, its later steps do not), as
    Nsight Systems' `--capture-range-end=stop`; else `on_taken()` is called then, once.
    Raises ValueError for a window that never opened (naming the ranges seen), ScriptError
    when the script raised.
    """
    path, runnable_dir, skip, auto_skip = _checked(path, skip, steps, range_name, window)
    w = _Window(
        range_name,
        skip,
        steps,
        window,
        count_work,
        _device.has_cuda(),
        exit_after=exit_after,
        on_taken=on_taken,
        auto_skip=auto_skip,
    )
    recording.prepare_profiler()  # before the script's clock starts, not inside its window
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.abspath(path) if runnable_dir else os.path.dirname(os.path.abspath(path)))
    annotate.RANGE_WATCHERS.append(w)
    compilation.eager_hooks_skipped()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(w.tick)
    try:
        with (
            tracking_sources(),  # the script's compiled kernels placed in its modules
            compile_callbacks(w.on_compile),
            module_ranges(quiet=lambda: w.theirs_ran) as tracker,
            w.sharing_the_profiler(),
            _exit_in_main_thread(),
            step_sources(w),
            nvtx_sources(w),
        ):
            w.read_sites = lambda: models_seen(tracker.roots, w.warnings)
            failed = _run(path, w)
    finally:
        hook.remove()
        annotate.RANGE_WATCHERS.remove(w)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        _usable_stdio()
    if w.sites is None:
        w.sites, w.trees = models_seen(tracker.roots, w.warnings)
    if failed is not None:  # the profile, where it was taken before, is kept with the error
        raise ScriptError(failed, _result(w, w.sites) if w.state == "done" else None) from failed
    return _result(w, w.sites)


def _run(path: str, w: _Window) -> BaseException | None:
    """Run the script as __main__; its failure (an exception, Ctrl-C, a non-zero exit), or None
    where it ended well or was ended once its profile was taken."""
    w.t0 = time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")
    except _Taken:
        pass
    except (SystemExit, _Exit) as exc:
        if exit_status(exc.code) != 0:
            return exc
        if isinstance(exc, _Exit):
            w.warnings.append(
                "the script called os._exit(0): its process would end there without running "
                "finally blocks or atexit handlers; perfloop made its analysis first"
            )
    except (Exception, KeyboardInterrupt) as exc:
        return exc
    finally:
        w.abandon()
    return None


def _usable_stdio() -> None:
    """A script that closed sys.stdout or sys.stderr (fd 1 and 2 stay open: Python's own stdio
    objects do not close them) leaves perfloop a stream to say its analysis on."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None or getattr(stream, "closed", False):
            raw = open(fd, "wb", closefd=False)  # noqa: SIM115 (the stream outlives this call)
            setattr(sys, name, io.TextIOWrapper(raw, line_buffering=True))


@contextlib.contextmanager
def _exit_in_main_thread():
    """os._exit(code) in the script's own thread ends the script like sys.exit, so the analysis
    is still made; from another thread it ends the process as it would, saying so first; in a
    process forked from the script (a DataLoader worker ends so) it ends that process at once."""
    real, main, pid = os._exit, threading.get_ident(), os.getpid()

    def _exit(code):
        if os.getpid() != pid:
            real(code)
        if threading.get_ident() == main:
            raise _Exit(code)
        print(
            f"perfloop: the script called os._exit({code}) from a worker thread: the process ends "
            "before the analysis",
            file=sys.stderr,
            flush=True,
        )
        real(code)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _result(w: _Window, sites: dict | None = None) -> profiling.Profile:
    _check_taken(w)
    if w.ended_at is not None:
        w.warnings.append(
            f"--window: the script ended {w.ended_at:.3g} s into the window of "
            f"{w.window[1]:g} s: profiled {w.ended_at:.3g} s only"
        )
    if w.count_work and w.range_name and w.counted_prof is None:
        why = (
            "the script's own torch.profiler had started by the one after the profiled ones"
            if w.count_blocked
            else "keep --skip plus --steps below the script's count"
        )
        w.warnings.append(f"FLOPs and bytes not counted: no occurrence of {w.range_name!r} to count ({why})")
    counted = (
        counting.counted(w.counted_prof, w.counter.records, w.on_cuda, w.trees) if w.counted_prof else None
    )
    say_compiled(w)
    plain = _plain_ms(w)
    # the profile's own copies of the range bound it where the trace has them (not NVTX's, not
    # optimizer steps': there the profiled span is the steps)
    traced = {OPTIMIZER_STEP: None, "ProfilerStep": "ProfilerStep#*"}.get(w.range_name, w.range_name)
    samples = w.sampler.align(w.prof.events(), w.sampler_mark) if w.sampler is not None else None
    p = profiling.build_profile(
        profiling.Recording(
            w.prof,
            max(w.calls, 1),
            w.wall_ms,
            w.wall_ms,
            w.on_cuda,
            w.warnings,
            counted,
            range_name=traced,
            plain_wall_ms=plain,
            samples=samples,
            window_cut_s=w.ended_at,
            compile_metrics=compilation.live_metrics(),
            break_reasons=compilation.live_break_reasons(),
            step=w.range_name,
            sites=sites,
            trees=w.trees,
        )
    )
    if not p.items():
        what = f"{w.calls} occurrence(s) of {w.range_name!r}" if w.range_name else f"the window {w.window}"
        raise ValueError(
            f"the profiled {what} ran no torch op ({w.wall_ms:.3g} ms of wall time): nothing to "
            "analyse; choose steps or a window where the script computes"
        )
    return p


def _check_taken(w: _Window) -> None:
    """Raise, saying why and what to pass instead, where the window took no profile of a step."""
    if w.range_name == AUTO:
        seen = ", ".join(f"{n} (x{c})" for n, c in w.seen.most_common(8)) or "none"
        raise ValueError(
            "no step found: looked for optimizer.step() of a torch.optim optimizer and for a "
            f"range named 'step' (pl.annotate, record_function, NVTX); ranges seen: {seen}. "
            "Pass --range NAME for one of them, or --window START:DURATION"
        )
    if w.range_name is not None and w.seen[w.range_name] == 0:
        seen = ", ".join(f"{n} (x{c})" for n, c in w.seen.most_common(8)) or "none"
        raise ValueError(
            f"--range: no range named {w.range_name!r} occurred; ranges seen: {seen}. "
            "Pass one of them, leave --range out (steps by optimizer.step()), or use "
            "--window"
        )
    if w.prof is None and w.blocked:
        raise ValueError(
            "the script runs torch.profiler itself, and it started before perfloop's window "
            "closed: one profiler records at a time and perfloop's records only before the "
            "script's first starts, so it gave way and the script's profiler recorded as it "
            "would alone. Profile earlier steps (a smaller --skip or --steps), read the "
            "trace the script writes with `perfloop profile --trace-file TRACE.json`, or "
            "turn the script's profiler off for this run"
        )
    if w.prof is None or w.state == "abandoned":
        have = w.seen[w.range_name] if w.range_name else 0
        raise ValueError(
            f"--skip/--steps: the script ran {have} occurrence(s) of {w.range_name!r}; "
            f"--skip {w.skip} --steps {w.steps} needs {w.skip + w.steps}"
            if w.range_name
            else "--window: the script ended before the window opened"
        )


def _plain_ms(w: _Window) -> float | None:
    """The profiled steps' time without the profiler: the median pace of the unprofiled steps that
    did not compile (the steady ones after the profile, where there are two), or None."""
    compiled = set(w.compiled)  # the pace of steps that compiled is not the step's ...
    profiled = range(w.first_timed, w.first_timed + w.steps)
    recompiling = bool(w.range_name and w.first_timed) and all(n in compiled for n in profiled)
    periods = sorted(  # ... unless every profiled step compiled too: then the later skipped ones' is
        w.enters[k + 1] - w.enters[k]
        for k in w.enters
        if k + 1 in w.enters and (k in compiled and k > 1 if recompiling else k not in compiled)
    )
    after = sorted(w.paced[k + 1] - w.paced[k] for k in w.paced if k + 1 in w.paced and k not in compiled)
    if len(after) >= 2 and not recompiling:  # steady steps, where the early skipped ones may still warm up
        periods = after
    plain = periods[len(periods) // 2] * 1e3 * max(w.calls, 1) if periods else None
    if w.range_name and plain is None and len(w.enters) > 2:
        w.warnings.append(
            "idle time measured under the profiler, which slows the host: the skipped steps "
            "all compiled, so their pace is not the step's"
        )
    elif w.range_name and plain is None:
        w.warnings.append(
            "idle time measured under the profiler, which slows the host: --skip 2 or more "
            "times the unprofiled steps and scales the idle to them"
        )
    return plain
