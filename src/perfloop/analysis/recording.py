"""Running calls under torch.profiler: starting and stopping it (with the native start/stop
chatter held back), the calls timed with and without it, each call's bounds and the launching
thread's stack samples on its timeline, and one call's peak memory."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch


@contextlib.contextmanager
def _without_usdt_lines():
    """The profiler's native start/stop print "USDT: ..." probe lines on some builds: hold the
    process's stdout and stderr meanwhile, and pass every other line on to where it was going."""
    import sys
    import tempfile

    streams = {1: sys.stdout, 2: sys.stderr}
    for stream in streams.values():
        stream.flush()
    saved = {fd: os.dup(fd) for fd in streams}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        held = {1: out, 2: err}
        try:
            for fd, f in held.items():
                os.dup2(f.fileno(), fd)
            yield
        finally:
            for fd, stream in streams.items():
                stream.flush()
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
                held[fd].seek(0)
                lines = held[fd].read().decode(errors="replace").splitlines(True)
                kept = "".join(ln for ln in lines if not ln.startswith("USDT"))
                if kept:
                    stream.write(kept)


def peak_memory(call: Callable, memory_snapshot) -> int:
    """Bytes one call allocates at its peak beyond what was held before; with
    `memory_snapshot`, the allocator's history of that call written there."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if memory_snapshot:
        torch.cuda.memory._dump_snapshot(str(memory_snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak


def prepare_profiler() -> None:
    """Import what torch.profiler's first start imports (torch._inductor's config, 1-2 s on a
    CPU), so a window opened later in a running script starts in milliseconds and does not
    stall the script it measures. Touches no device."""
    import torch._inductor.config  # noqa: F401


def start_profiler(on_cuda: bool, warnings: list[str], shapes: bool = False):
    """torch.profiler recording CPU and (on a GPU) CUDA activity, already started; CPU only,
    with a warning, where CUPTI is missing or busy. `shapes`: each op's arguments' shapes too."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # keep events from every call (torch >= 2.5 clears them per cycle otherwise)
        prof = torch.profiler.profile(activities=acts, acc_events=True, record_shapes=shapes)
    except TypeError:
        prof = torch.profiler.profile(activities=acts, record_shapes=shapes)
    try:
        with _without_usdt_lines():
            prof.__enter__()
    except Exception as exc:
        warnings.append(f"CUDA activity profiling unavailable ({exc}); CPU activities only")
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=shapes)
        prof.__enter__()
    return prof


def plain_wall_ms(call, calls: int, sync, fastest: bool = False) -> float:
    """Wall time of `calls` calls without the profiler, whose per-op cost slows the host; with
    `fastest` (a CPU, where another process's time slices land in whichever call runs), `calls`
    times the fastest call's."""
    sync()
    t0 = time.perf_counter()
    if not fastest:
        for _ in range(calls):
            call()
        sync()
        return (time.perf_counter() - t0) * 1e3
    each = [t0]
    for _ in range(calls):
        call()
        each.append(time.perf_counter())
    sync()
    return min(b - a for a, b in zip(each[:-1], each[1:], strict=True)) * calls * 1e3


def with_dtypes(prof) -> list:
    """The events of a (stopped) profile, each op with its arguments' dtypes (`input_dtypes`)
    where shapes were recorded: torch before 2.12 keeps them on the raw kineto events only."""
    events = prof.events()
    if not events or hasattr(events[0], "input_dtypes"):
        return events
    try:
        results = prof.profiler.kineto_results
        start = results.trace_start_ns()
        raw = {(k.name(), k.start_ns() - start): k.dtypes() for k in results.events() if k.dtypes()}
    except (AttributeError, RuntimeError):  # a torch that keeps neither
        return events
    for e in events:
        e.input_dtypes = raw.get((e.name, round(e.time_range.start * 1e3)), [])
    return events


def stop_profiler(prof) -> None:
    with _without_usdt_lines():
        prof.__exit__(None, None, None)


def timed_calls(call, calls: int, on_cuda: bool, cuda_profiler_range: bool, warnings: list[str]):
    """(profiler, wall ms, host s) of `calls` calls under the profiler."""
    from perfloop.analysis.stacks import Sampler

    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    prof = start_profiler(on_cuda, warnings)
    try:
        nsys = on_cuda and cuda_profiler_range
        if nsys:
            torch.cuda.profiler.start()
        bounds = []  # each call's start and end, perf_counter_ns
        with Sampler() as sampler:
            marked = sampler.mark()
            t0 = time.perf_counter()
            host = 0.0
            for _ in range(calls):
                h0 = time.perf_counter_ns()
                call()
                bounds.append((h0, time.perf_counter_ns()))
                host += (bounds[-1][1] - h0) / 1e9
            sync()
            bounds[-1] = (bounds[-1][0], time.perf_counter_ns())  # the last call ends when its work does
        if nsys:
            torch.cuda.profiler.stop()
        wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        stop_profiler(prof)  # stopped cleanly even when fn raised
    events = prof.events()
    offset = Sampler.offset(events, marked)
    # the calls on the profiler's timeline: the gaps between them are the harness's, not the user's
    spans = None if offset is None else [(a / 1e3 + offset, b / 1e3 + offset) for a, b in bounds]
    return prof, wall_ms, host, sampler.align(events, marked), spans
