"""How one sample is taken: warm-up, device events or a synchronized clock, the L2 flush,
CUDA-graph replays, and the loop that samples until the CI of the median is tight.

On a GPU each sample is bracketed by CUDA events recorded on the stream the
work runs on, with the L2 flushed (outside the events) before it; on the CPU a
`perf_counter` pair brackets a batch of calls long enough that the timer's own
cost is under 0.1%. `bench`, `compare` and `sweep` (timing.py) and the ceilings
(ceilings.py) are built on these pieces.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import DeviceType

from perfloop import device as _device
from perfloop.harness import stats
from perfloop.harness.stats import BUSY_OTHERS

CPU_SAMPLE_S = 1e-3  # a CPU sample lasts >= 1 ms: perf_counter's ~100 ns is then < 0.01%
GRAPH_SAMPLE_MS = 1.0  # a graph replay holds enough calls to last about this long


class BenchError(RuntimeError):
    """The function under measurement failed; the original error is its __cause__."""


def check_positive(name: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
        want = "a positive integer" if integer else "a finite positive number"
        raise ValueError(f"{name}: must be {want}, got {value!r}")


# --------------------------------------------------------------------- zeros


def _tensors_in(fn: Callable, args: Sequence) -> list[torch.Tensor]:
    """Tensors a call will read: explicit args, partial args, closure cells, bound self."""
    found: list = list(args)
    f = fn
    while isinstance(f, functools.partial):
        found += list(f.args) + list(f.keywords.values())
        f = f.func
    for cell in getattr(f, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found.append(cell.cell_contents)
    for v in getattr(f, "__defaults__", None) or ():
        found.append(v)
    out = []
    for v in found:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def input_states(fn: Callable, args: Sequence) -> list[tuple[torch.Tensor, bool, bool]]:
    """(tensor, all zeros, all finite) for each input, to compare after the samples."""
    out = []
    for t in _tensors_in(fn, args):
        if t.numel() and t.dtype != torch.bool:
            d = t.detach()
            finite = bool(torch.isfinite(d).all()) if d.is_floating_point() else True
            out.append((t, not bool(d.any()), finite))
    return out


def zero_input_warnings(states: list[tuple[torch.Tensor, bool, bool]]) -> list[str]:
    """Inputs that are all zeros before any call (`input_states`)."""
    return [
        f"an input of shape {tuple(t.shape)} is all zeros: zeros hide unwritten outputs and can run "
        "faster than real data; time on random inputs"
        for t, zero, _ in states
        if zero
    ]


def input_drift_warnings(before: list[tuple[torch.Tensor, bool, bool]]) -> list[str]:
    """Inputs that the timed calls turned into zeros, infs or NaNs: later samples timed other data."""
    warns = []
    for t, was_zero, was_finite in before:
        d = t.detach()
        if not was_zero and not bool(d.any()):
            warns.append(
                f"an input of shape {tuple(t.shape)} became all zeros while it was timed: fn "
                "overwrites its input in place, so the later samples timed zeros; give each "
                "call fresh inputs (or clone inside fn)"
            )
        elif was_finite and d.is_floating_point() and not bool(torch.isfinite(d).all()):
            warns.append(
                f"an input of shape {tuple(t.shape)} became inf/NaN while it was timed: fn "
                "changes its input in place, so the later samples timed infs or NaNs; give each "
                "call fresh inputs (or clone inside fn)"
            )
    return warns


# ------------------------------------------------------------------ contention


def _machine_busy_s() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuLoad:
    """How much CPU other processes took while samples were taken: the machine's busy time
    (from /proc/stat) minus this process's own CPU time, per second of wall time."""

    def __enter__(self) -> CpuLoad:
        self.t0, self.own0, self.busy0 = time.perf_counter(), time.process_time(), _machine_busy_s()
        self.other_cores: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        busy = _machine_busy_s()
        wall = time.perf_counter() - self.t0
        if busy is None or self.busy0 is None or wall < 0.05:
            return
        own = time.process_time() - self.own0
        self.other_cores = max(0.0, (busy - self.busy0 - own) / wall)

    def warning(self) -> str | None:
        if self.other_cores is None or self.other_cores <= BUSY_OTHERS:
            return None
        cores = os.cpu_count() or 1
        return (
            f"contended: other processes used ~{self.other_cores:.1f} of {cores} CPU cores while this "
            "was timed, so the samples include waiting for the CPU (a tight CI does not mean a true "
            "time); measure on an idle machine, or compare candidates interleaved"
        )


# ------------------------------------------------------------------ samplers


@functools.lru_cache(maxsize=4)
def _flush_buffer(dev_index: int) -> torch.Tensor:
    # Twice the L2, so writing it evicts every line the previous call left behind.
    n = max(2 * _device.l2_bytes(dev_index), 8 * 2**20) // 4
    return torch.empty(n, dtype=torch.int32, device=f"cuda:{dev_index}")


class CudaSampler:
    """Event-timed samples on the current stream; optional L2 flush and CUDA graph."""

    def __init__(self, call: Callable[[], Any], flush_l2: bool, graph: bool):
        self.call = call
        self.flush = _flush_buffer(torch.cuda.current_device()) if flush_l2 else None
        self.graph = None
        self.calls_per_sample = 1
        if graph:
            self._capture()

    def one_call_ms(self) -> float:
        """One call's time, events only (no flush), for calibration."""
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self._run()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / self.calls_per_sample

    def _capture(self) -> None:
        def capture(reps: int) -> torch.cuda.CUDAGraph:
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.call()  # warm-up on a side stream, as capture requires
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                for _ in range(reps):
                    self.call()
            return g

        # A call that syncs with the host (.item(), printing a tensor) cannot be
        # captured, and a failed capture can leave CUDA's RNG state unusable: find
        # host syncs with a dry run first.
        old = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            self.call()
        except RuntimeError as exc:
            raise ValueError(
                f"graph=True: the function synchronizes with the host ({exc}), so it cannot be "
                "captured in a CUDA graph; remove .item()/.cpu()/printing, or use graph=False."
            ) from exc
        finally:
            torch.cuda.set_sync_debug_mode(old)
        try:
            self.graph = capture(1)
            self.graph.replay()
            torch.cuda.synchronize()
            est = self.one_call_ms()
            reps = max(1, min(1000, math.ceil(GRAPH_SAMPLE_MS / max(est, 1e-4))))
            if reps > 1:
                self.graph = capture(reps)
                self.calls_per_sample = reps
        except Exception as exc:  # capture errors come from many layers
            torch.cuda.synchronize()
            raise ValueError(
                f"graph=True: the function could not be captured in a CUDA graph ({exc}). "
                "Capture needs static shapes, no host syncs (.item(), printing, CPU tensors) "
                "and no allocation outside PyTorch's allocator; use graph=False."
            ) from exc

    def _run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.call()

    def enqueue(self, n: int):
        """Queue n samples without waiting: the GPU stays busy (and its clocks up)."""
        pairs = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.flush is not None:
                self.flush.zero_()  # outside the events: never part of a sample
            s.record()
            self._run()
            e.record()
            pairs.append((s, e))
        return pairs

    def collect(self, pairs) -> list[float]:
        pairs[-1][1].synchronize()
        return [s.elapsed_time(e) / self.calls_per_sample for s, e in pairs]

    def take(self, n: int) -> list[float]:
        return self.collect(self.enqueue(n))


class CpuSampler:
    """perf_counter around a batch of calls long enough to drown the timer's cost."""

    def __init__(self, call: Callable[[], Any]):
        self.call = call
        self.calls_per_sample = 1

    def one_call_ms(self) -> float:
        t0 = time.perf_counter()
        self.call()
        return (time.perf_counter() - t0) * 1e3

    def calibrate(self, est_ms: float) -> None:
        self.calls_per_sample = max(1, math.ceil(CPU_SAMPLE_S * 1e3 / max(est_ms, 1e-6)))

    def enqueue(self, n: int) -> list[float]:
        return self.take(n)

    def collect(self, times: list[float]) -> list[float]:
        return times

    def take(self, n: int) -> list[float]:
        out = []
        k = self.calls_per_sample
        call = self.call
        for _ in range(n):
            t0 = time.perf_counter()
            for _ in range(k):
                call()
            out.append((time.perf_counter() - t0) * 1e3 / k)
        return out


def replay_kernel_time(replay: Callable[[], Any]) -> tuple[float, int] | None:
    """(device ms, kernels) of one call of `replay`, from CUPTI through torch.profiler;
    None where CUPTI records nothing."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
    except Exception:  # CUPTI unavailable or busy
        return None
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return None
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels)


def graph_gaps(sampler: CudaSampler, samples: list[float]) -> tuple[dict, list[str]]:
    """A graph replay still pays the GPU's gap between dependent kernels. Time one replay's
    kernels (CUPTI) for their own time: (meta entries, warnings) saying how much of the sample
    is gaps."""
    if torch.autograd.profiler._is_profiler_enabled:  # a profiler is already recording
        return {}, []
    measured = replay_kernel_time(sampler.graph.replay)
    if measured is None or measured[0] <= 0:  # the replay time stands alone
        return {}, []
    reps = sampler.calls_per_sample
    kernel_ms = measured[0] / reps
    launches = measured[1] / reps
    meta = {"graph_kernel_ms": kernel_ms, "graph_kernels_per_call": launches}
    median = stats.quantile(samples, 0.5)
    ratio = median / kernel_ms
    if ratio <= 1.15:
        return meta, []
    gap_us = (median - kernel_ms) * 1e3 / max(launches, 1)
    head = f"graph replay is {ratio:.2f}x the kernels' own time ({kernel_ms * 1e3:.2f} us a call, CUPTI): "
    if launches < 1.5:  # one kernel a call: nothing to fuse; the gap is to the next call's kernel
        return meta, [
            head + f"the rest is the GPU's ~{gap_us:.2f} us from one kernel to the next, a floor "
            "for a one-kernel call; give each call more work (a larger size, a batch) to amortize it"
        ]
    return meta, [
        head + f"the rest is the GPU's gap between {launches:.0f} dependent kernels "
        f"(~{gap_us:.2f} us each); fusing them into fewer kernels removes it"
    ]


def prepare(
    fn: Callable,
    args: Sequence,
    kwargs: dict,
    *,
    flush_l2: bool,
    graph: bool,
    warmup_s: float,
    on_cuda: bool,
):
    """Warm up (compilation, autotuning, handles stay out) and build a calibrated sampler:
    (sampler, warm-up calls, one call's ms, the first call's output)."""
    call = (lambda: fn(*args, **kwargs)) if (args or kwargs) else fn
    try:
        first = call()  # the first call: compiles, autotunes, allocates; it can take seconds
        if on_cuda:
            torch.cuda.synchronize()
        sampler = CudaSampler(call, flush_l2, graph) if on_cuda else CpuSampler(call)
        t_end = time.perf_counter() + warmup_s
        calls = 1
        est = sampler.one_call_ms()
        while time.perf_counter() < t_end:
            est = min(est, sampler.one_call_ms())
            calls += 1
    except ValueError:
        raise
    except Exception as exc:
        raise BenchError(
            f"fn raised during warm-up: {type(exc).__name__}: {exc}; nothing was measured"
        ) from exc
    if not on_cuda:
        sampler.calibrate(est)
    return sampler, calls, est, first


def validate(fn, budget_s, target_ci, min_samples, max_samples, warmup_s, graph, count="samples"):
    if not callable(fn):
        raise TypeError(f"fn: must be callable (a function of no arguments, or pass args), got {fn!r}")
    check_positive("budget_s", budget_s)
    check_positive("target_ci", target_ci)
    lo, hi = f"min_{count}", f"max_{count}"  # "rounds" for compare
    check_positive(lo, min_samples, integer=True)
    check_positive(hi, max_samples, integer=True)
    if max_samples < min_samples:
        raise ValueError(f"{hi}: {max_samples} is below {lo}={min_samples}")
    if isinstance(warmup_s, bool) or not isinstance(warmup_s, (int, float)) or not 0 <= warmup_s < math.inf:
        raise ValueError(f"warmup_s: must be a finite number >= 0 (seconds), got {warmup_s!r}")
    if graph and not _device.has_cuda():
        raise ValueError(
            "graph=True: CUDA graphs need a CUDA GPU and none is available here; use graph=False"
        )


def sample_until(
    sampler, *, min_samples: int, max_samples: int, target_ci: float, deadline: float
) -> tuple[list[float], str]:
    """Samples in growing batches until the 95% CI of the median is within `target_ci`
    of it ("converged"), `max_samples` are taken, or the clock passes `deadline` ("budget")."""
    samples: list[float] = []
    batch = min_samples
    while True:
        samples += sampler.take(min(batch, max_samples - len(samples)))
        if len(samples) >= min_samples and stats.relative_ci_halfwidth(samples) <= target_ci:
            return samples, "converged"
        if len(samples) >= max_samples:
            return samples, "max_samples"
        if time.perf_counter() >= deadline:
            return samples, "budget"
        batch = min(2 * batch, 200)
