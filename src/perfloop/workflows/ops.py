"""Bench, sweep and profile an op's variants: each variant checked against the float64
reference before it is timed, timed interleaved, every number stored as it lands."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from perfloop.analysis.findings import Diagnosis
from perfloop.analysis.profiling import Profile, profile
from perfloop.device import default_device
from perfloop.harness import gate
from perfloop.harness.measurement import Comparison, Sweep, SweepPoint
from perfloop.harness.timing import bench, compare, sweep
from perfloop.ops.base import Op, dtype_name
from perfloop.results.store import Store
from perfloop.workflows.runs import record_reference


@dataclass
class BenchRow:
    """One variant's line of a comparison: time, rates, share of the ceiling, speed-up."""

    op: str
    variant: str
    shape: list[int]
    dtype: str
    median_ms: float
    ci95_ms: list[float]
    gbps: float | None
    tflops: float | None
    sol: float | None
    speedup: float
    speedup_ci: list[float]
    significant: bool | None
    baseline: str
    warnings: list[str] = field(default_factory=list)
    graph_median_ms: float | None = None
    graph_kernel_ms: float | None = None
    samples_ms: list[float] = field(default_factory=list)  # the raw samples the statistics come from

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.graph_median_ms is None:
            del d["graph_median_ms"], d["graph_kernel_ms"]
        return d


def runnable_variants(
    op: Op, names: Sequence[str] | None, timing: bool, device: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the variants asked for, or all, that can run -- and be timed -- here; {skipped: why}).
    An unknown name raises ValueError naming `variants`."""
    device = device or default_device()
    chosen = list(names or op.variants)
    for n in chosen:
        if n not in op.variants:
            raise ValueError(f"variants: {op.name!r} has no {n!r}; valid: {', '.join(op.variants)}")
    out, skipped = [], {}
    for n in chosen:
        v = op.variant(n)
        why = v.why_unavailable(device)
        if not why and timing and v.interpreted:
            why = "Triton runs in its interpreter here (correct, not fast); `perfloop check` tests it"
        if why:
            skipped[n] = why
        else:
            out.append(n)
    return out, skipped


def bench_variants(
    op: Op,
    variants: Sequence[str],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    budget_s: float = 2.0,
    flush_l2: bool = True,
    graph: bool = False,
    store: Store | None = None,
    run_id: str | None = None,
) -> tuple[Comparison, list[BenchRow]]:
    """Check each variant, then time them interleaved; store each row when `store` is given.

    >>> op = ops.get("gelu")                                                # doctest: +SKIP
    >>> c, rows = bench_variants(op, ["naive", "builtin"], (2048, 2048), torch.float32)  # doctest: +SKIP
    """
    dev = default_device()
    op.check_shape(shape, dtype, dev)
    for v in variants:  # never time a wrong answer
        op.check(v, dtypes=[dtype], shapes=op.test_shapes[2:4], seeds=1, seed=0)
    inputs = op.make_inputs(shape, dtype=dtype, device=dev, seed=0)
    if op.validate:
        op.validate(*inputs)
    work = op.work(shape, dtype)
    fns = {v: (lambda var=op.variant(v): var(*inputs)) for v in variants}
    baseline = op.baseline if op.baseline in fns else variants[0]
    c = compare(
        fns, baseline=baseline, work=work, flush_l2=flush_l2, budget_s=budget_s, reference=gate.reference(dev)
    )
    graphs, graph_errors = {}, {}
    if graph:
        for v in variants:
            try:
                graphs[v] = bench(fns[v], work=work, graph=True, flush_l2=flush_l2)
            except ValueError as exc:
                graph_errors[v] = str(exc)
    rows = []
    name = dtype_name(dtype)
    for v, m in c.measurements.items():
        sp = c.speedups.get(v)
        row = BenchRow(
            op=op.name,
            variant=v,
            shape=list(shape),
            dtype=name,
            median_ms=m.median_ms,
            ci95_ms=list(m.ci95_ms),
            gbps=m.gbps,
            tflops=m.tflops,
            sol=m.sol,
            speedup=sp.speedup if sp else 1.0,
            speedup_ci=list(sp.ci) if sp else [1.0, 1.0],
            significant=sp.significant if sp else None,
            baseline=baseline,
            warnings=list(m.warnings),
            samples_ms=list(m.samples_ms),
        )
        if v in graph_errors:
            row.warnings.append(f"graph: {graph_errors[v]}")
        if v in graphs:
            row.graph_median_ms = graphs[v].median_ms
            row.graph_kernel_ms = graphs[v].meta.get("graph_kernel_ms")
            row.warnings += [f"graph: {w}" for w in graphs[v].warnings]
        rows.append(row)
        if store is not None:
            store.add(
                run_id, m, op=op.name, variant=v, shape=shape, dtype=name, speedup=sp, baseline=baseline
            )
            if v in graphs:
                store.add(run_id, graphs[v], op=op.name, variant=v, shape=shape, dtype=name)
    if store is not None:
        record_reference(store, run_id, c.reference)
    return c, rows


def sweep_variants(
    op: Op,
    variants: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    *,
    budget_s: float = 1.0,
    store: Store | None = None,
    run_id: str | None = None,
    on_point: Callable[[str, SweepPoint], None] | None = None,
) -> dict[str, Sweep]:
    """Each variant over the shapes, with a fit of time against elements; each point is stored
    the moment it is measured (Ctrl-C keeps what was taken), each fit once it is made."""
    dev = default_device()
    for shape in shapes:
        op.check_shape(shape, dtype, dev)
    results = {}
    for v in variants:
        var = op.variant(v)

        def factory(shape, var=var):
            inputs = op.make_inputs(shape, dtype=dtype, device=dev, seed=0)
            return lambda: var(*inputs)

        def landed(pt, v=v):
            if store is not None and pt.measurement is not None:
                store.add(
                    run_id, pt.measurement, op=op.name, variant=v, shape=pt.size, dtype=dtype_name(dtype)
                )
            if on_point is not None:
                on_point(v, pt)

        results[v] = sweep(
            factory,
            shapes,
            work=lambda s: op.work(s, dtype),
            size_of=lambda s: float(math.prod(s)),
            on_point=landed,
            budget_s=budget_s,
        )
        if store is not None and results[v].fit:
            store.add_artifact(run_id, "sweep_fit", {"variant": v, **results[v].fit}, op=op.name, variant=v)
    if store is not None:
        record_reference(store, run_id)
    return results


def sweep_points(results: dict[str, Sweep]) -> dict:
    """The sweeps as plain data: per variant, each point's shape, median (or error) and the fit."""

    def point(p):
        return {
            "shape": list(p.size),
            "median_ms": p.measurement.median_ms if p.measurement else None,
            "error": p.error,
        }

    return {
        v: {"points": [point(p) for p in s.points], "fit": s.fit, "fit_error": s.fit_error}
        for v, s in results.items()
    }


def sweep_series(results: dict[str, Sweep]) -> dict[str, tuple[list[int], list[float]]]:
    """{variant: (elements, median ms)} for a time-against-size plot."""
    return {
        v: (
            [math.prod(p.size) for p in s.points if p.measurement],
            [p.measurement.median_ms for p in s.points if p.measurement],
        )
        for v, s in results.items()
    }


def profile_variant(
    op: Op,
    variant: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    calls: int = 3,
    trace: str | None = None,
    memory_snapshot: str | None = None,
    cuda_profiler_range: bool = False,
) -> tuple[Profile, Diagnosis]:
    """Profile `calls` calls of one variant on the op's seeded inputs, and diagnose it."""
    op.check_shape(shape, dtype)
    inputs = op.make_inputs(shape, dtype=dtype, device=default_device(), seed=0)
    v = op.variant(variant)
    p = profile(
        lambda: v(*inputs),
        calls=calls,
        work=op.work(shape, dtype),
        memory_snapshot=memory_snapshot,
        cuda_profiler_range=cuda_profiler_range,
    )
    if trace:
        p.export_trace(trace)
    return p, p.diagnose()


__all__ = [
    "BenchRow",
    "bench_variants",
    "profile_variant",
    "runnable_variants",
    "sweep_points",
    "sweep_series",
    "sweep_variants",
]
