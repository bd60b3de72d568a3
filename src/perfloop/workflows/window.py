"""The profiling window of a script run by workflows.script: which occurrences of the step are
skipped, profiled and counted, told by the script's own hooks (step_sources, annotate, module
calls) as it runs, and the profiler started and stopped where that is safe."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from perfloop.analysis import compilation, recording
from perfloop.analysis.stacks import Sampler
from perfloop.analysis.work import WorkCounter
from perfloop.workflows.step_sources import AUTO, MODEL_CALL, OPTIMIZER_STEP

# AUTO's step: "step" ranges, optimizer.step() boundaries or the model's decode calls, whichever occurs first
AUTO_STEPS = ("step", OPTIMIZER_STEP, MODEL_CALL)


class Taken(BaseException):
    pass


PACED = 20  # the occurrences after the profile timed for the unprofiled pace, at most
MORE_SKIPS = 6  # by default, steps skipped beyond --skip while the one before compiled


@dataclass
class Window:
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
    # the module ranges (module_ranges') open on this thread, a list to edit: one begun with no
    # profiler on has no guard, and exited under one fails torch's assert ("no guard is set")
    module_stack: object = None
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
    model_bytes: dict | None = None  # ... and the bytes a step of theirs must read
    tokens: dict = field(default_factory=dict)  # profiled occurrence -> its first embedding lookup's size
    model_calls: object = None  # step_sources.ModelCalls: the script's model calls, where no step was found

    def check_taken(self) -> None:
        """Once the profile is taken, at the next hook in the script's main thread: end the script
        there (exit_after: a BaseException its `except Exception` does not catch), else say so."""
        if self.state != "done" or self.taken or threading.get_ident() != self.main_thread:
            return
        self.taken = True
        if self.exit_after:
            raise Taken()
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
        if name == self.range_name or (self.range_name == AUTO and name in AUTO_STEPS):
            if self.compiling and self.seen[name]:
                self.compiled.append(self.seen[name])
            self.compiling = False
        self.seen[name] += 1
        if self.range_name is None:
            self.tick()
            return
        if self.range_name == AUTO and name in AUTO_STEPS:
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
        on_main = threading.get_ident() == self.main_thread  # else at the next occurrence there
        if self.state == "before" and n >= self.skip + 1 and not waiting and on_main:
            self.first_timed = n
            self._start_timed()
        elif self.state == "timed_done" and self.count_work and self.theirs_ran:
            self.count_blocked, self.state = True, "done"
        elif self.state == "timed_done" and self.count_work and on_main:
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
        self._stop(self.prof)
        self.prof, self.calls, self.state = None, 0, "before"
        self.retaken.append(n)
        return True

    # ---- a time window, checked at each module call
    @compilation.eager_hook  # traced into a graph, its state read would be a guard
    def tick(self, module=None, args=()) -> None:
        self._note_tokens(module, args)
        if self.forked() or threading.get_ident() != self.main_thread:
            return  # torch.profiler records the thread that starts it: the script's main thread
        if self.stop_due:
            self.settle()
            return
        if self.range_name is not None or self.window is None:
            return
        with self.lock:
            now = time.perf_counter() - self.t0
            start, duration = self.window
            if self.state == "before" and now >= start:
                self._start_timed()
            elif self.state == "timed" and time.perf_counter() - self.timed_at >= duration:
                self.calls = 1
                self._stop_timed()
        self.check_taken()

    def _note_tokens(self, module, args) -> None:
        """The tokens a profiled occurrence takes in: its first embedding lookup's indices (a
        decode step's batch, a prefill's prompt). Compiled code runs no module hooks: there
        tokens.read falls back to --tokens or the KV cache's batch."""
        if self.state != "timed" or not self.range_name or not args:
            return
        n = self.seen[self.range_name]
        lookup = isinstance(module, torch.nn.Embedding) and isinstance(args[0], torch.Tensor)
        if lookup and n not in self.tokens:
            self.tokens[n] = args[0].numel()

    # ---- the profilers
    def _sync(self):
        if self.on_cuda:
            torch.cuda.synchronize()

    def _start(self, warnings: list, shapes: bool = False):
        self.started_mark = self.mark() if self.mark else -1
        self._forget_module_ranges()
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

    def _forget_module_ranges(self) -> None:
        """This thread's module ranges open, begun with no profiler on, are let go unexited: a
        profiler starting now would make their exit fail torch's assert (they have no guard)."""
        if self.module_stack is not None:
            stack = self.module_stack()
            stack[:] = [None] * len(stack)

    def _stop(self, prof) -> None:
        """Stop perfloop's profiler, ending first this thread's module ranges begun under it
        (they end at the window's edge): ended after, their exit would write into the stopped
        profiler's freed state, or meet the next profiler's with no guard of its own."""
        if self.module_stack is not None:
            stack = self.module_stack()
            for i in reversed(range(len(stack))):
                if stack[i] is not None:
                    stack[i].__exit__(None, None, None)
                    stack[i] = None
        recording.stop_profiler(prof)

    def _end_sampling(self) -> None:
        if self.sampler is not None and self.sampler.running:
            self.sampler.__exit__(None, None, None)

    def _give_way(self) -> None:
        """The script's own torch.profiler starts: perfloop's stops, and records no more in this
        process (benchmarks/NOTES.md says why)."""
        with self.lock:
            if self.state == "timed":
                self._end_sampling()
                self._stop(self.prof)
                self.prof, self.calls, self.state = None, 0, "before"
                self.blocked = True
            elif self.state == "counting":
                self.counter.__exit__(None, None, None)
                self._stop(self.counted_prof)
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
                w._forget_module_ranges()  # begun with no profiler on: the script's starts now
            return prepare(prof)

        cls._prepare_trace = _prepare_trace
        try:
            yield
        finally:
            cls._prepare_trace = prepare

    def _unsafe(self, what: str) -> bool:
        """Whether stopping now would leave a range begun under the profiler open, or is on
        another thread than the one that started it (then the stop is due, made by settle() once
        those ranges have closed, in the script's main thread)."""
        off_main = threading.get_ident() != self.main_thread
        if off_main or (self.begun_since is not None and self.begun_since(self.started_mark)):
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
        # a time window's profile holds all it recorded, so its wall time runs to the real stop
        late = self.stop_due is not None and self.range_name is None
        end = self.due_at if self.stop_due and not late else time.perf_counter()
        self.wall_ms = (end - self.timed_at) * 1e3
        if late:
            self.warnings.append(
                f"--window: recorded {self.wall_ms / 1e3:.3g} s, {end - self.due_at:.3g} s past the "
                "window's end: a record_function range the script began inside the window was still "
                "open there, and the profiler stops only once those have closed (stopped under an "
                "open one, torch's profiler corrupts memory)"
            )
        self.stop_due = None
        self._end_sampling()
        self._stop(self.prof)
        self.state = "timed_done" if self.count_work and self.range_name else "done"
        if self.read_sites is not None and self.sites is None:
            self.sites, self.trees, self.model_bytes = self.read_sites()

    def _stop_counting(self, force: bool = False):
        if self.state != "counting" or (not force and self._unsafe("counting")):
            return
        self.stop_due = None
        self.counter.__exit__(None, None, None)
        self._sync()
        self._stop(self.counted_prof)
        self.state = "done"

    def abandon(self):
        """Stop whatever is running (the script ended or raised inside the window)."""
        if self.state == "timed" and self.range_name is None:  # seconds the profiler recorded
            self.ended_at = time.perf_counter() - self.timed_at
        if self.state == "counting" and self.stop_due:
            self._stop_counting(force=True)
        elif self.state == "counting":
            self.counter.__exit__(None, None, None)
            self._stop(self.counted_prof)
            self.counted_prof = None
        elif self.state == "timed" and self.stop_due:
            self._stop_timed(force=True)
        elif self.state == "timed":
            if self.range_name is None:
                self.calls = 1
                self._stop_timed(force=True)
            else:
                self._end_sampling()
                self._stop(self.prof)
                self.state = "abandoned"
        self._end_sampling()
