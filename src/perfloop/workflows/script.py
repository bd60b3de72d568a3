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
import dataclasses
import math
import os
import runpy
import sys
import threading
import time

import torch

from perfloop import device as _device
from perfloop.analysis import annotate, compilation, counting, profiling, recording
from perfloop.analysis.inductor import tracking_sources
from perfloop.analysis.modules import module_ranges
from perfloop.workflows.compiled_script import compile_callbacks, say_compiled
from perfloop.workflows.models_seen import models_seen
from perfloop.workflows.step_sources import MODEL_CALL, OPTIMIZER_STEP, nvtx_sources, step_sources
from perfloop.workflows.window import AUTO, Taken, Window


class _Exit(BaseException):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


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
            said = f"{how_it_ended(original)}: {original}"
            super().__init__(said + (CAPTURE_FAILED if _capture_failed(original) else ""))


CAPTURE_FAILED = (
    "; a CUDA graph capture failed: what runs inside torch.cuda.graph must stay on the device "
    "(no .item(), .cpu(), .tolist(), print of a tensor, torch.multinomial's check, or a new "
    "allocation outside the graph's pool). Run it a few times on a side stream before capturing, "
    "or let torch.compile(mode='reduce-overhead') capture it: that mode skips a region it cannot "
    "capture and says why"
)


# CUDA's refusals of work inside a stream capture (cudaErrorStreamCapture*), and torch's own
CAPTURE_MARKERS = (
    "stream is capturing",  # cudaErrorStreamCaptureUnsupported
    "error during capture",  # cudaErrorStreamCaptureInvalidated
    "streamcapture",  # the error's name, where torch prints it
    "during cuda graph capture",  # torch: "Cannot call ... during CUDA graph capture"
)


def _capture_failed(exc: BaseException) -> bool:
    """Whether exc is a CUDA graph capture refused, not any error that speaks of graphs (Dynamo's
    are RuntimeErrors that do)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in CAPTURE_MARKERS)


def how_it_ended(failed: BaseException | None) -> str:
    """Who ended the script, told truly: the script itself, or perfloop's code raising inside it
    (its hooks, or a perfloop call the script made)."""
    if failed is None:
        return "the script ended"
    if isinstance(failed, (SystemExit, _Exit)):
        how = "os._exit" if isinstance(failed, _Exit) else "sys.exit"
        return f"the script exited with {how}({failed.code!r})"
    if isinstance(failed, KeyboardInterrupt):
        return "the script was interrupted (Ctrl-C)"
    if _raised_in_perfloop(failed):
        return f"perfloop's own code raised {type(failed).__name__} inside the script"
    return f"the script raised {type(failed).__name__}"


def _perfloops_import(exc: BaseException) -> bool:
    """Whether exc is an ImportError of an import statement in perfloop's own code (not the
    script's)."""
    return isinstance(exc, ImportError) and _raised_in_perfloop(exc)


def _raised_in_perfloop(exc: BaseException) -> bool:
    """Whether the innermost frame of code that raised exc, the import machinery's and the
    runner's own frames aside, is perfloop's."""
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
    w = Window(
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
            w.module_stack = lambda: tracker.open
            failed = _run(path, w)
    finally:
        hook.remove()
        annotate.RANGE_WATCHERS.remove(w)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        _usable_stdio()
    if w.sites is None:
        w.sites, w.trees, w.model_bytes = models_seen(tracker.roots, w.warnings)
    if failed is not None:  # the profile, where it was taken before, is kept with the error
        raise ScriptError(failed, _result(w, w.sites, failed) if w.state == "done" else None) from failed
    return _result(w, w.sites)


def _run(path: str, w: Window) -> BaseException | None:
    """Run the script as __main__; its failure (an exception, Ctrl-C, a non-zero exit), or None
    where it ended well or was ended once its profile was taken."""
    w.t0 = time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")
    except Taken:
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


def _result(w: Window, sites: dict | None = None, failed: BaseException | None = None) -> profiling.Profile:
    _check_taken(w)
    if w.ended_at is not None:
        w.warnings.append(
            f"--window: {how_it_ended(failed)} {w.ended_at:.3g} s into the window of "
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
    # optimizer steps': there the profiled span is the steps; a model call's: its module range)
    traced = {OPTIMIZER_STEP: None, "ProfilerStep": "ProfilerStep#*"}.get(w.range_name, w.range_name)
    if w.range_name == MODEL_CALL:
        traced = w.model_calls.traced()
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
            cudagraph_skips=compilation.live_cudagraph_skips(),
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
    seen = sorted(w.tokens.values())
    return dataclasses.replace(
        p, tokens_seen=seen[len(seen) // 2] if seen else None, model_bytes=w.model_bytes
    )


def _check_taken(w: Window) -> None:
    """Raise, saying why and what to pass instead, where the window took no profile of a step."""
    if w.range_name == AUTO:
        seen = ", ".join(f"{n} (x{c})" for n, c in w.seen.most_common(8)) or "none"
        calls = w.model_calls.why_none() if w.model_calls else "not looked for"
        raise ValueError(
            "no step found: looked for optimizer.step() of a torch.optim optimizer and for a "
            f"range named 'step' (pl.annotate, record_function, NVTX); ranges seen: {seen}; "
            f"and for a generation loop's decode calls: {calls}. "
            "Pass --range NAME for one of them, or --window START:DURATION. A generation loop "
            "whose model runs compiled: mark one token's call with "
            '`with torch.profiler.record_function("decode"):` (or pl.annotate) and pass --range decode'
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
        fits = (
            f"; --skip 0 --steps {have} profiles the ones it ran (the first pays any warm-up)" if have else ""
        )
        raise ValueError(
            f"--skip/--steps: the script ran {have} occurrence(s) of {w.range_name!r}; "
            f"--skip {w.skip} --steps {w.steps} needs {w.skip + w.steps}{fits}"
            if w.range_name
            else "--window: the script ended before the window opened"
        )


def _plain_ms(w: Window) -> float | None:
    """The profiled steps' time without the profiler: the median pace of the unprofiled steps that
    did not compile (the steady ones after the profile, where there are two), or None."""
    compiled = set(w.compiled)  # the pace of steps that compiled is not the step's ...
    profiled = range(w.first_timed, w.first_timed + w.steps)
    recompiling = bool(w.range_name and w.first_timed) and all(n in compiled for n in profiled)
    skipped = [  # ... unless every profiled step compiled too: then the later skipped ones' is
        k
        for k in w.enters
        if k + 1 in w.enters and (k in compiled and k > 1 if recompiling else k not in compiled)
    ]
    if len(skipped) > 1:  # the first occurrence pays the warm-up (lazy loading, first plans): run42
        skipped = [k for k in skipped if k != 1]  # read 511 ms for a 5 ms token from it
    periods = sorted(w.enters[k + 1] - w.enters[k] for k in skipped)
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
