"""Scaling studies: matmul time against size (flat, then cubic), and an MLP's time
against steps, layers, batch size and width (linear, until launch overhead rules)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from perfloop import ops
from perfloop.experiments._common import device, finish, ms, one_cpu_thread, plot_lines
from perfloop.harness import stats
from perfloop.harness.measurement import Work
from perfloop.harness.timing import bench, compare


def matmul_scaling(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    dev = device()
    if dev == "cuda":
        sizes = [256, 512, 1024, 2048, 4096] + ([] if quick else [8192])
        dtypes = [torch.float32, torch.bfloat16]
    else:
        sizes = [32, 64, 128, 256, 512] + ([] if quick else [1024])
        dtypes = [torch.float32]
    out = Path(out_dir or ".")
    rows, series, fits = [], {}, {}
    for dtype in dtypes:
        times = []
        for d in sizes:
            a = torch.randn(d, d, device=dev, dtype=dtype)
            b = torch.randn(d, d, device=dev, dtype=dtype)
            work = Work(bytes=3 * d * d * a.element_size(), flops=2 * d**3, dtype=str(dtype))
            with one_cpu_thread(dev):
                m = bench(torch.matmul, a, b, work=work, budget_s=0.5 if quick else 1.0)
            times.append(m.median_ms)
            rows.append([d, ops.dtype_name(dtype), ms(m.median_ms), m.tflops])
            if store is not None:
                store.add(
                    run_id,
                    m,
                    op="experiment matmul",
                    variant="a @ b",
                    shape=(d, d, d),
                    dtype=ops.dtype_name(dtype),
                )
        f = stats.fit_power_floor(sizes, times)
        fits[ops.dtype_name(dtype)] = f
        series[ops.dtype_name(dtype)] = (sizes, times)
    plot = plot_lines(
        out / "matmul_scaling.png",
        "square matmul: time against size",
        "d (d x d x d)",
        "median time (ms)",
        series,
    )
    parts = []
    for name, f in fits.items():
        knee = f"d ~ {f['knee']:.0f}" if f.get("knee") else "no size measured"
        parts.append(
            f"{name}: flat at ~{ms(f['floor'])} (fixed cost) until {knee}, then time grows as "
            f"d^{f['exponent']:.2f} (3 is cubic; R^2 {f['r2']:.3f})"
        )
    conclusion = "; ".join(parts) + (" (CPU: one thread)" if dev == "cpu" else "")
    return finish(
        "matmul-scaling",
        ["d", "dtype", "median", "TFLOP/s"],
        rows,
        conclusion,
        [plot],
        store,
        run_id,
        {"fits": fits},
    )


def _mlp(width: int, layers: int, dev: str):
    return [torch.nn.Linear(width, width, device=dev) for _ in range(layers)]


def _step(mlp, x):
    for lin in mlp:
        x = F.gelu(lin(x))
    x.sum().backward()


def mlp_scaling(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    """Time of forward + backward against steps, layers, batch and width, each with a line fit."""
    dev = device()
    base = (
        {"width": 1024, "layers": 4, "batch": 256}
        if dev == "cuda"
        else {"width": 128, "layers": 2, "batch": 32}
    )
    axes = {
        "steps": [1, 2, 4, 8],
        "layers": [1, 2, 4, 8],
        "batch": [1, 4, 16, 64, 256] if dev == "cuda" else [1, 4, 16, 64],
        "width": [256, 512, 1024, 2048] if dev == "cuda" else [64, 128, 256, 512],
    }
    if quick:
        axes = {k: v[:3] for k, v in axes.items()}
    out = Path(out_dir or ".")
    rows, series, fitted = [], {}, {}
    for axis, values in axes.items():
        fns = {}
        for value in values:
            cfg = dict(base)
            steps = value if axis == "steps" else 1
            if axis != "steps":
                cfg[axis] = value
            mlp = _mlp(cfg["width"], cfg["layers"], dev)
            x = torch.randn(cfg["batch"], cfg["width"], device=dev)

            def run(mlp=mlp, x=x, steps=steps):
                for _ in range(steps):
                    _step(mlp, x)

            fns[str(value)] = run
        # the points of an axis interleaved, round by round: a machine whose pace drifts (another
        # process on a core) moves them all alike, not the last ones more
        with one_cpu_thread(dev):
            budget = (0.3 if quick else 1.0) * len(values)
            c = compare(fns, baseline=str(values[0]), budget_s=budget, flush_l2=False)
        times = [c.measurements[str(v)].median_ms for v in values]
        rows += [[axis, v, ms(t)] for v, t in zip(values, times, strict=True)]
        fit = stats.linear_fit(values, times)
        fitted[axis] = fit | {"growth": times[-1] / times[0], "range": values[-1] / values[0]}
        series[axis] = (list(range(len(values))), [t / times[0] for t in times])
    plot = plot_lines(
        out / "mlp_scaling.png",
        "MLP forward + backward: time against each knob",
        "point along the axis",
        "time / first point",
        series,
        log=False,
    )
    lines = [
        f"{a}: {f['growth']:.2f}x the time over a {f['range']:.0f}x range (linear fit R^2 {f['r2']:.3f})"
        for a, f in fitted.items()
    ]
    b = fitted["batch"]
    regime = (
        f"launch-bound at small batch: {b['range']:.0f}x the batch costs only {b['growth']:.2f}x the time"
        if b["growth"] < 0.25 * b["range"]
        else f"batch scales the time {b['growth']:.2f}x over {b['range']:.0f}x: compute-bound"
    )
    conclusion = "; ".join(lines) + ". " + regime + "." + (" (CPU: one thread)" if dev == "cpu" else "")
    return finish(
        "mlp-scaling",
        ["axis", "value", "median (fwd+bwd)"],
        rows,
        conclusion,
        [plot],
        store,
        run_id,
        {"fits": fitted},
    )
