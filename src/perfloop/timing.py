"""How a time is taken: bench, compare and sweep.

On a GPU each sample is bracketed by CUDA events recorded on the stream the
work runs on, with the L2 flushed (outside the events) before it; on the CPU a
`perf_counter` pair brackets a batch of calls long enough that the timer's own
cost is under 0.1%. Samples are taken until the 95% CI of the median is tight
enough or the time budget is spent, whichever comes first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from perfloop import device as _device
from perfloop import stats
from perfloop.measurement import Comparison, Measurement, Speedup, Sweep, SweepPoint, Work

CPU_SAMPLE_S = 1e-3  # a CPU sample lasts >= 1 ms: perf_counter's ~100 ns is then < 0.01%
GRAPH_SAMPLE_MS = 1.0  # a graph replay holds enough calls to last about this long


class BenchError(RuntimeError):
    """The function under measurement failed; the original error is its __cause__."""


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        want = "a positive integer" if integer else "a positive number"
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


def _zero_input_warnings(fn: Callable, args: Sequence) -> list[str]:
    warns = []
    for t in _tensors_in(fn, args):
        if t.numel() and t.dtype != torch.bool and not bool(t.detach().any()):
            warns.append(
                f"an input of shape {tuple(t.shape)} is all zeros: zeros hide unwritten outputs "
                "and can run faster than real data; time on random inputs"
            )
    return warns


# ------------------------------------------------------------------ samplers


@functools.lru_cache(maxsize=4)
def _flush_buffer(dev_index: int) -> torch.Tensor:
    # Twice the L2, so writing it evicts every line the previous call left behind.
    n = max(2 * _device.l2_bytes(dev_index), 8 * 2**20) // 4
    return torch.empty(n, dtype=torch.int32, device=f"cuda:{dev_index}")


class _CudaSampler:
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


class _CpuSampler:
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


def _graph_gaps(sampler: _CudaSampler, samples: list[float]) -> tuple[dict, list[str]]:
    """A graph replay still pays the GPU's gap between dependent kernels. Profile one
    replay (CUPTI) for the kernels' own time: (meta entries, warnings) saying how much of
    the sample is gaps."""
    if torch.autograd.profiler._is_profiler_enabled:  # a profiler is already recording
        return {}, []
    from perfloop.profiling import profile

    try:
        p = profile(sampler.graph.replay, calls=1, warmup=0)
    except Exception:  # CUPTI unavailable: the replay time stands alone
        return {}, []
    if p.kind != "cuda" or p.device_ms_per_call <= 0:
        return {}, []
    reps = sampler.calls_per_sample
    kernel_ms = p.device_ms_per_call / reps
    launches = p.launches_per_call / reps
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


def _prepare(
    fn: Callable,
    args: Sequence,
    kwargs: dict,
    *,
    flush_l2: bool,
    graph: bool,
    warmup_s: float,
    on_cuda: bool,
):
    """Warm up (compilation, autotuning, handles stay out) and build a calibrated sampler."""
    call = (lambda: fn(*args, **kwargs)) if (args or kwargs) else fn
    try:
        call()  # the first call: compiles, autotunes, allocates; it can take seconds
        if on_cuda:
            torch.cuda.synchronize()
        sampler = _CudaSampler(call, flush_l2, graph) if on_cuda else _CpuSampler(call)
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
    return sampler, calls, est


def _validate(fn, budget_s, target_ci, min_samples, max_samples, warmup_s, graph, count="samples"):
    if not callable(fn):
        raise TypeError(f"fn: must be callable (a function of no arguments, or pass args), got {fn!r}")
    _check_positive("budget_s", budget_s)
    _check_positive("target_ci", target_ci)
    lo, hi = f"min_{count}", f"max_{count}"  # "rounds" for compare
    _check_positive(lo, min_samples, integer=True)
    _check_positive(hi, max_samples, integer=True)
    if max_samples < min_samples:
        raise ValueError(f"{hi}: {max_samples} is below {lo}={min_samples}")
    if isinstance(warmup_s, bool) or not isinstance(warmup_s, (int, float)) or warmup_s < 0:
        raise ValueError(f"warmup_s: must be a number >= 0, got {warmup_s!r}")
    if graph and not _device.has_cuda():
        raise ValueError(
            "graph=True: CUDA graphs need a CUDA GPU and none is available here; use graph=False"
        )


def _resolve_ceilings(ceilings, work):
    if ceilings is False or work is None:
        return None
    if isinstance(ceilings, dict):
        return ceilings
    return _device.ceilings()


def bench(
    fn: Callable,
    *args: Any,
    work: Work | None = None,
    label: str = "",
    flush_l2: bool = True,
    graph: bool = False,
    target_ci: float = 0.01,
    budget_s: float = 1.0,
    min_samples: int = 10,
    max_samples: int = 10_000,
    warmup_s: float = 0.025,
    ceilings: dict | bool | None = None,
    **kwargs: Any,
) -> Measurement:
    """Time `fn(*args, **kwargs)` the right way and return a Measurement.

    Warm-up by time (at least one call); then samples until the 95% CI of the
    median is within `target_ci` of it, or `budget_s` is spent. On a GPU: CUDA
    events, L2 flushed between samples (`flush_l2=False` for warm-cache numbers),
    `graph=True` to replay CUDA-graph captures (device time without launch cost; one replay is
    also profiled, and `meta["graph_kernel_ms"]` holds the kernels' own time per call, so the
    GPU's gaps between dependent kernels show -- with a warning when they are over 15%).

    >>> import torch, perfloop as pl
    >>> x = torch.randn(1 << 16)
    >>> m = pl.bench(torch.nn.functional.gelu, x, work=pl.Work(bytes=2 * x.nbytes))
    >>> m.median_ms > 0
    True
    """
    _validate(fn, budget_s, target_ci, min_samples, max_samples, warmup_s, graph)
    on_cuda = _device.has_cuda()
    t0 = time.perf_counter()
    warns = _zero_input_warnings(fn, args)
    sampler, warm_calls, _ = _prepare(
        fn, args, kwargs, flush_l2=flush_l2, graph=graph, warmup_s=warmup_s, on_cuda=on_cuda
    )
    samples: list[float] = []
    deadline = t0 + budget_s
    batch = min_samples
    try:
        while True:
            samples += sampler.take(min(batch, max_samples - len(samples)))
            if len(samples) >= min_samples and stats.relative_ci_halfwidth(samples) <= target_ci:
                reason = "converged"
                break
            if len(samples) >= max_samples:
                reason = "max_samples"
                break
            if time.perf_counter() >= deadline:
                reason = "budget"
                break
            batch = min(2 * batch, 200)
    except Exception as exc:
        raise BenchError(
            f"fn raised while sampling: {type(exc).__name__}: {exc}; the measurement was discarded"
        ) from exc
    if reason == "budget":
        warns.append(
            f"stopped by the time budget ({budget_s:g} s) before the CI reached "
            f"+-{target_ci:.1%}: CI is +-{stats.relative_ci_halfwidth(samples):.1%}"
        )
    graph_meta: dict = {}
    if on_cuda and sampler.graph is not None:
        graph_meta, graph_warns = _graph_gaps(sampler, samples)
        warns += graph_warns
    meta = {
        **graph_meta,
        "stop_reason": reason,
        "target_ci": target_ci,
        "timer": "cuda_event" if on_cuda else "perf_counter",
        "flush_l2": bool(flush_l2 and on_cuda),
        "graph": graph,
        "calls_per_sample": sampler.calls_per_sample,
        "warmup_calls": warm_calls,
        "wall_s": time.perf_counter() - t0,
    }
    return Measurement(
        samples_ms=tuple(samples),
        work=work,
        label=label or getattr(fn, "__name__", "") or str(getattr(fn, "name", "")),
        ceilings=_resolve_ceilings(ceilings, work),
        env=_device.env_fingerprint(),
        meta=meta,
        extra_warnings=tuple(warns),
    )


def compare(
    fns: dict[str, Callable],
    baseline: str | None = None,
    *,
    work: Work | None = None,
    flush_l2: bool = True,
    target_ci: float = 0.01,
    budget_s: float = 2.0,
    min_rounds: int = 10,
    max_rounds: int = 2000,
    alpha: float = 0.01,
    warmup_s: float = 0.025,
) -> Comparison:
    """Time candidates interleaved, round-robin, and give each one's speed-up over `baseline`.

    Every round takes one sample of each candidate, in a rotated order, so drift
    (clocks, temperature, other load) hits all alike; speed-ups are ratios of
    medians with a paired bootstrap 95% CI, tested with Wilcoxon signed-rank on
    the per-round log ratios. A difference is called significant when p < alpha
    and the CI excludes 1.

    >>> import perfloop as pl
    >>> c = pl.compare({"a": lambda: sum(range(1000)), "b": lambda: sum(range(1000))})
    >>> c.speedups["b"].significant
    False
    """
    if not isinstance(fns, dict) or not fns:
        raise ValueError("fns: must be a non-empty dict of {name: callable}")
    for name, f in fns.items():
        if not callable(f):
            raise TypeError(f"fns[{name!r}]: must be callable, got {f!r}")
    baseline = baseline if baseline is not None else next(iter(fns))
    if baseline not in fns:
        raise ValueError(f"baseline: {baseline!r} is not one of {sorted(fns)}")
    _validate(
        next(iter(fns.values())), budget_s, target_ci, min_rounds, max_rounds, warmup_s, False, "rounds"
    )
    on_cuda = _device.has_cuda()
    t0 = time.perf_counter()
    samplers = {}
    for name, f in fns.items():
        try:
            samplers[name] = _prepare(
                f, (), {}, flush_l2=flush_l2, graph=False, warmup_s=warmup_s, on_cuda=on_cuda
            )[0]
        except BenchError as exc:
            raise BenchError(f"fns[{name!r}]: {exc}") from exc.__cause__
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)
    deadline = t0 + budget_s
    reason = "max_rounds"
    rounds = 0
    while rounds < max_rounds:
        # A block of rounds is queued before any is read, so the GPU never idles
        # between candidates; each round visits the candidates in a fresh order.
        block = min(5, max_rounds - rounds)
        queued = []
        for _ in range(block):
            order = names[:]
            rng.shuffle(order)
            queued += [(n, samplers[n].enqueue(1)) for n in order]
        for n, token in queued:
            samples[n] += samplers[n].collect(token)
        rounds += block
        if rounds >= min_rounds:
            if all(stats.relative_ci_halfwidth(s) <= target_ci for s in samples.values()):
                reason = "converged"
                break
            if time.perf_counter() >= deadline:
                reason = "budget"
                break
    env = _device.env_fingerprint()
    ceil = _resolve_ceilings(None, work)
    meas = {
        n: Measurement(
            samples_ms=tuple(samples[n]),
            work=work,
            label=n,
            ceilings=ceil,
            env=env,
            meta={
                "stop_reason": reason,
                "interleaved": True,
                "calls_per_sample": samplers[n].calls_per_sample,
                "flush_l2": bool(flush_l2 and on_cuda),
            },
        )
        for n in names
    }
    speedups = {}
    for n in names:
        if n == baseline:
            continue
        s = stats.paired_speedup(samples[baseline], samples[n])
        excludes_one = not (s["ci"][0] <= 1.0 <= s["ci"][1])
        speedups[n] = Speedup(
            name=n,
            speedup=s["speedup"],
            ci=s["ci"],
            p_value=s["p_value"],
            significant=bool(s["p_value"] < alpha and excludes_one),
        )
    return Comparison(baseline=baseline, measurements=meas, speedups=speedups)


def sweep(
    factory: Callable[[Any], Callable],
    sizes: Iterable,
    *,
    work: Callable[[Any], Work] | None = None,
    size_of: Callable[[Any], float] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    **bench_kwargs: Any,
) -> Sweep:
    """A Measurement per size, and a fit time = floor + c*size^k.

    `factory(size)` builds the function to time (setup stays outside the timed
    call). A size that fails is recorded with its error; the others still run.
    `on_point` sees each point as it lands (to store it before the next starts).

    >>> import perfloop as pl
    >>> s = pl.sweep(lambda n: (lambda: sum(range(n))), sizes=[1000, 10000, 100000])
    >>> 0.5 < s.fit["exponent"] < 1.5  # doctest: +SKIP
    True
    """
    if not callable(factory):
        raise TypeError(f"factory: must be callable (size -> fn), got {factory!r}")
    sizes = list(sizes) if sizes is not None else []
    if not sizes:
        raise ValueError("sizes: empty; give at least one size, e.g. sizes=[1024, 4096, 16384]")
    # Bad bench arguments are the caller's mistake, not a size's: fail before measuring.
    opts = {n: p.default for n, p in inspect.signature(bench).parameters.items()} | bench_kwargs
    _validate(factory, *(opts[n] for n in ("budget_s", "target_ci", "min_samples", "max_samples",
                                           "warmup_s", "graph")))  # fmt: skip
    points = []
    for size in sizes:
        try:
            fn = factory(size)
            m = bench(fn, work=work(size) if work else None, label=str(size), **bench_kwargs)
            point = SweepPoint(size=size, measurement=m)
        except Exception as exc:  # incl. torch.cuda.OutOfMemoryError; Ctrl-C still stops
            point = SweepPoint(size=size, measurement=None, error=f"{type(exc).__name__}: {exc}")
            if _device.has_cuda():
                torch.cuda.empty_cache()
        points.append(point)
        if on_point:
            on_point(point)
    ok = [(p.size, p.measurement.median_ms) for p in points if p.measurement is not None]
    fit = None
    if len(ok) >= 3:
        xs = [size_of(s) if size_of else float(s) for s, _ in ok]
        fit = stats.fit_power_floor(xs, [t for _, t in ok])
    return Sweep(points=tuple(points), fit=fit)
