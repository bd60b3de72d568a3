"""How a time is taken: bench, compare and sweep.

Warm-up, then samples (sampling.py: device events or a synchronized clock, the L2
flushed) until the 95% CI of the median is tight enough or the time budget is
spent; throughput is reported against the machine's measured ceilings.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from perfloop import device as _device
from perfloop.harness import stats
from perfloop.harness.ceilings import ceilings as measured_ceilings
from perfloop.harness.measurement import Comparison, Measurement, Speedup, Sweep, SweepPoint, Work
from perfloop.harness.sampling import (
    BenchError,
    CpuLoad,
    graph_gaps,
    input_drift_warnings,
    input_states,
    prepare,
    sample_until,
    validate,
    zero_input_warnings,
)

__all__ = ["BenchError", "bench", "compare", "sweep"]


_REFERENCE = "\0reference"  # the reference workload's slot among a comparison's candidates


def _resolve_ceilings(ceilings, work):
    if ceilings is False or work is None:
        return None
    if isinstance(ceilings, dict):
        return ceilings
    return measured_ceilings()


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
    validate(fn, budget_s, target_ci, min_samples, max_samples, warmup_s, graph)
    on_cuda = _device.has_cuda()
    t0 = time.perf_counter()
    before = input_states(fn, args)
    warns = zero_input_warnings(before)
    sampler, warm_calls, _, _ = prepare(
        fn, args, kwargs, flush_l2=flush_l2, graph=graph, warmup_s=warmup_s, on_cuda=on_cuda
    )
    try:
        with CpuLoad() as load:
            samples, reason = sample_until(
                sampler,
                min_samples=min_samples,
                max_samples=max_samples,
                target_ci=target_ci,
                deadline=t0 + budget_s,
            )
    except Exception as exc:
        raise BenchError(
            f"fn raised while sampling: {type(exc).__name__}: {exc}; the measurement was discarded"
        ) from exc
    warns += input_drift_warnings(before) + _sampling_warnings(samples, reason, budget_s, target_ci)
    contended = None if on_cuda else load.warning()
    if contended:
        warns.append(contended)
    graph_meta: dict = {}
    if on_cuda and sampler.graph is not None:
        graph_meta, graph_warns = graph_gaps(sampler, samples)
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
        "other_cpu_cores": None if on_cuda else load.other_cores,
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


def _sampling_warnings(samples, reason: str, budget_s: float, target_ci: float) -> list[str]:
    if reason != "budget":
        return []
    return [
        f"stopped by the time budget ({budget_s:g} s) before the CI reached "
        f"+-{target_ci:.1%}: CI is +-{stats.relative_ci_halfwidth(samples):.1%}"
    ]


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
    min_effect: float = 0.005,
    warmup_s: float = 0.025,
    check_values: bool = False,
    reference: Callable | None = None,
) -> Comparison:
    """Time candidates interleaved, round-robin, and give each one's speed-up over `baseline`.

    Every round takes one sample of each candidate, in a rotated order, so drift
    (clocks, temperature, other load) hits all alike; speed-ups are ratios of
    medians with a paired bootstrap 95% CI, tested with Wilcoxon signed-rank on
    the per-round log ratios. A difference is called significant when p < alpha,
    the CI excludes 1 and the speed-up is more than `min_effect` away from 1 (0.5%: below
    that, a candidate's place in the round and the timer move the ratio as much). Before any
    sample is taken, each candidate's output must match the baseline's in shape and dtype
    (and, with `check_values`, in value): a speed-up of a function that computes something
    else means nothing. A `reference` workload, when given,
    is timed in the same rounds (not checked, no speed-up): `Comparison.reference`, which the
    regression gate divides each round by to cancel the machine's drift.

    >>> import perfloop as pl
    >>> c = pl.compare({"a": lambda: sum(range(1000)), "b": lambda: sum(range(1000))})
    >>> c.speedups["b"].significant
    False
    """
    baseline = _compare_args(fns, baseline, min_effect)
    validate(next(iter(fns.values())), budget_s, target_ci, min_rounds, max_rounds, warmup_s, False, "rounds")
    on_cuda = _device.has_cuda()
    t0 = time.perf_counter()
    timed = {**fns, _REFERENCE: reference} if reference is not None else fns
    samplers = _prepared(timed, baseline, check_values, flush_l2, warmup_s, on_cuda)
    names = list(timed)

    def judged(samples: dict, n_boot: int = 2000) -> dict:
        """Each candidate: (paired stats, CI excludes 1, effect under min_effect, p < alpha)."""
        out = {}
        for n in fns:
            if n != baseline:
                s = stats.paired_speedup(samples[baseline], samples[n], n_boot=n_boot)
                small = abs(math.log(s["speedup"])) <= math.log1p(min_effect)
                out[n] = (s, not (s["ci"][0] <= 1.0 <= s["ci"][1]), small, s["p_value"] < alpha)
        return out

    def settled(samples: dict) -> bool:
        """The CI and the signed-rank test say the same of every candidate whose effect counts
        (a few rounds a hog preempted can hold the test back where the CI is already clear)."""
        return all(small or excl == by_p for _, excl, small, by_p in judged(samples, 200).values())

    with CpuLoad() as load:
        samples, reason = _interleave(samplers, min_rounds, max_rounds, target_ci, t0 + budget_s, settled)
    meas = _measurements(
        samples, samplers, names, work, reason, flush_l2 and on_cuda, None if on_cuda else load
    )
    ref = meas.pop(_REFERENCE, None)
    speedups = {
        n: Speedup(
            name=n,
            speedup=s["speedup"],
            ci=s["ci"],
            p_value=s["p_value"],
            significant=excl and not small and by_p,
        )
        for n, (s, excl, small, by_p) in judged(samples).items()
    }
    return Comparison(baseline=baseline, measurements=meas, speedups=speedups, reference=ref)


def _measurements(samples, samplers, names, work, reason: str, flushed: bool, load) -> dict:
    """One Measurement per candidate of an interleaved run (`load`: the CPU's, None on a GPU)."""
    contended = load.warning() if load is not None else None
    env = _device.env_fingerprint()
    ceil = _resolve_ceilings(None, work)
    meta = {"stop_reason": reason, "interleaved": True, "flush_l2": bool(flushed)}
    meta["other_cpu_cores"] = load.other_cores if load is not None else None
    return {
        n: Measurement(
            samples_ms=tuple(samples[n]),
            work=work,
            label=n,
            ceilings=ceil,
            env=env,
            meta=meta | {"calls_per_sample": samplers[n].calls_per_sample},
            extra_warnings=(contended,) if contended else (),
        )
        for n in names
    }


def _compare_args(fns, baseline: str | None, min_effect) -> str:
    """The baseline's name, after compare's arguments are checked."""
    if not isinstance(fns, dict) or not fns:
        raise ValueError("fns: must be a non-empty dict of {name: callable}")
    for name, f in fns.items():
        if not callable(f):
            raise TypeError(f"fns[{name!r}]: must be callable, got {f!r}")
    baseline = baseline if baseline is not None else next(iter(fns))
    if baseline not in fns:
        raise ValueError(f"baseline: {baseline!r} is not one of {sorted(fns)}")
    if not (isinstance(min_effect, (int, float)) and 0 <= min_effect < 1):
        raise ValueError(
            f"min_effect: the smallest speed-up called significant, as a fraction in [0, 1) "
            f"(0.005 = 0.5%), got {min_effect!r}"
        )
    return baseline


def _prepared(timed: dict, baseline: str, check_values: bool, flush_l2, warmup_s, on_cuda) -> dict:
    """Each candidate's sampler, warmed up, once every output matched the baseline's."""
    samplers, outputs = {}, {}
    for name, f in timed.items():
        try:
            samplers[name], _, _, outputs[name] = prepare(
                f, (), {}, flush_l2=flush_l2, graph=False, warmup_s=warmup_s, on_cuda=on_cuda
            )
        except BenchError as exc:
            raise BenchError(f"fns[{name!r}]: {exc}") from exc.__cause__
    outputs.pop(_REFERENCE, None)
    _check_same_outputs(outputs, baseline, check_values)
    return samplers


def _interleave(
    samplers: dict,
    min_rounds: int,
    max_rounds: int,
    target_ci: float,
    deadline: float,
    settled: Callable[[dict], bool] | None = None,
) -> tuple[dict[str, list[float]], str]:
    """Rounds of one sample of each candidate, in a fresh order each round, until every CI is
    within target_ci (and `settled` holds), max_rounds, or the deadline. A block of rounds is
    queued before any is read, so the GPU never idles between candidates."""
    names = list(samplers)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)
    rounds = 0
    while rounds < max_rounds:
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
            if all(stats.relative_ci_halfwidth(s) <= target_ci for s in samples.values()) and (
                settled is None or settled(samples)
            ):
                return samples, "converged"
            if time.perf_counter() >= deadline:
                return samples, "budget"
    return samples, "max_rounds"


def _outline(out: Any) -> Any:
    """What an output is, for comparing candidates: shapes and dtypes of its tensors."""
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), str(out.dtype).replace("torch.", ""))
    if isinstance(out, (list, tuple)):
        return tuple(_outline(o) for o in out)
    return type(out).__name__


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _check_same_outputs(outs: dict[str, Any], baseline: str, check_values: bool) -> None:
    """The candidates' first outputs: the same shapes and dtypes as the baseline's (and, with
    `check_values`, close in value), or ValueError naming the one that differs."""
    want = _outline(outs[baseline])
    for name, out in outs.items():
        got = _outline(out)
        if got != want:
            raise ValueError(
                f"fns[{name!r}]: its output {got} differs from the baseline {baseline!r}'s "
                f"{want}; candidates must compute the same thing to be compared"
            )
        if check_values and name != baseline:
            for a, b in zip(_tensors(outs[baseline]), _tensors(out), strict=True):
                if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3, equal_nan=True):
                    err = (a.float() - b.float()).abs().max().item()
                    raise ValueError(
                        f"fns[{name!r}]: its output differs from the baseline {baseline!r}'s "
                        f"by up to {err:.3g} (rtol 1e-2, atol 1e-3)"
                    )


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
    validate(
        factory,
        *(opts[n] for n in ("budget_s", "target_ci", "min_samples", "max_samples", "warmup_s", "graph")),
    )
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
    fit, why = _fit(points, size_of)
    return Sweep(points=tuple(points), fit=fit, fit_error=why)


def _fit(points: list[SweepPoint], size_of) -> tuple[dict | None, str | None]:
    """The fit of time against size, or None and the reason it could not be made; the
    points stand either way."""
    ok = [(p.size, p.measurement.median_ms) for p in points if p.measurement is not None]
    if len(ok) < 3:
        return None, f"no fit: {len(ok)} sizes measured, a fit needs 3"
    try:
        xs = [float(size_of(s)) if size_of else float(s) for s, _ in ok]
    except (TypeError, ValueError) as exc:
        return None, f"no fit: a size is not a number ({exc}); pass size_of= to map each size to one"
    bad = [s for s, x in zip(ok, xs, strict=True) if not (x > 0 and math.isfinite(x))]
    if bad:
        return None, f"no fit: size {bad[0][0]!r} is not a positive number (a fit is in log space)"
    try:
        return stats.fit_power_floor(xs, [t for _, t in ok]), None
    except (ValueError, RuntimeError, np.linalg.LinAlgError) as exc:
        return None, f"no fit: {exc}"
