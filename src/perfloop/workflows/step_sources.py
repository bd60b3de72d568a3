"""Where a script's steps come from, told to its profiling window (workflows.window's Window:
`enter`, `exit`, `boundary`, `settle`): each optimizer's step(), torch.profiler's
record_function ranges, NVTX push/pop -- patched in for the script's run, put back after."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import weakref

import torch

from perfloop.analysis import annotate

OPTIMIZER_STEP = "optimizer.step"
NUMBERED = re.compile(r"#\d+$")  # ProfilerStep#12 -> ProfilerStep


@contextlib.contextmanager
def step_sources(w):
    """Within: the window is told of the script's steps and ranges -- each optimizer's step()
    (the first optimizer's are the boundaries), torch.profiler.record_function ranges (and
    torch.profiler's ProfilerStep#N); NVTX push/pop in nvtx_sources. perfloop's own annotate
    tells it itself."""
    rf_cls = torch.autograd.profiler.record_function
    rf_enter, rf_exit = rf_cls.__enter__, rf_cls.__exit__
    stepping: list = []  # the optimizer whose step() is the boundary
    pending: list = []  # a boundary reached inside step(): acted on once its range has closed

    def flush() -> None:
        # the optimizer's hooks run inside its own record_function range ("Optimizer.step#...",
        # torch's wrapper of every step()): the boundary is acted on once that range has closed
        if pending:
            pending.clear()
            w.boundary(OPTIMIZER_STEP)
        w.settle()

    def told(rf) -> bool:  # torch's own optimizer ranges are told as optimizer.step boundaries
        return not annotate.annotating() and not rf.name.startswith("Optimizer.")

    marks = itertools.count()
    opened = threading.local()  # per thread: the marks of the record_function ranges open
    mark_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a range open -> its mark

    def begun_since(mark: int) -> bool:
        return any(m > mark for m in getattr(opened, "marks", ()))

    w.begun_since, w.mark = begun_since, lambda: next(marks)

    def __enter__(rf):  # told first: a window opening here has the range in its trace
        if told(rf):
            w.enter(NUMBERED.sub("", rf.name))
        out = rf_enter(rf)
        mark_of[rf] = next(marks)
        opened.__dict__.setdefault("marks", []).append(mark_of[rf])
        return out

    def __exit__(rf, *exc):
        try:
            return rf_exit(rf, *exc)
        finally:
            mark = mark_of.pop(rf, None)
            if mark is not None and mark in getattr(opened, "marks", ()):
                opened.marks.remove(mark)
            if told(rf):
                w.exit(NUMBERED.sub("", rf.name))
            elif rf.name.startswith("Optimizer.step#"):
                flush()
            w.settle()

    def stepped(opt, args, kwargs):
        if not stepping:
            stepping.append(opt)
        elif stepping[0] is not opt:
            if len(stepping) == 1:
                stepping.append(opt)
                first = type(stepping[0]).__name__
                w.warnings.append(f"several optimizers step ({first} first): a step ends at {first}.step()")
            return
        pending.append(True)

    import torch.optim.optimizer as optim_module

    hook = optim_module.register_optimizer_step_post_hook(stepped)
    rf_cls.__enter__, rf_cls.__exit__ = __enter__, __exit__
    try:
        yield
    finally:
        hook.remove()
        rf_cls.__enter__, rf_cls.__exit__ = rf_enter, rf_exit


@contextlib.contextmanager
def nvtx_sources(w):
    """Within: the window is told of the script's NVTX ranges (push/pop, per thread)."""
    nvtx = torch.cuda.nvtx
    push, pop = nvtx.range_push, nvtx.range_pop
    names = threading.local()  # per thread: the NVTX ranges open

    def range_push(msg):
        if not annotate.annotating():
            names.__dict__.setdefault("open", []).append(msg)
            w.enter(msg)
        return push(msg)

    def range_pop():
        out = pop()
        stack = names.__dict__.get("open")
        if stack and not annotate.annotating():
            w.exit(stack.pop())
        return out

    nvtx.range_push, nvtx.range_pop = range_push, range_pop
    try:
        yield
    finally:
        nvtx.range_push, nvtx.range_pop = push, pop
