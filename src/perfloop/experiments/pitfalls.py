"""The lecture's pitfalls, measured: launch overhead, timing without a sync, the first call."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from perfloop import ops
from perfloop.analysis.profiling import profile
from perfloop.experiments._common import device, finish, ms, plot_bars, plot_lines, sync
from perfloop.harness.measurement import parse_ms
from perfloop.harness.timing import bench
from perfloop.ops.gelu.torch_impl import naive as gelu_naive


def launch_overhead(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    """A small op (naive GELU, 8 kernels, 1024 elements): eager vs CUDA graph vs reduce-overhead."""
    dev = device()
    x = torch.randn(1024, device=dev)
    kinds = {"eager": lambda: gelu_naive(x)}
    if dev == "cuda":
        ro = torch.compile(gelu_naive, mode="reduce-overhead")
        kinds["torch.compile(reduce-overhead)"] = lambda: ro(x)
    else:
        co = torch.compile(gelu_naive)
        kinds["torch.compile"] = lambda: co(x)
    rows = []
    for name, fn in kinds.items():
        for _ in range(3):
            fn()  # compile, record graphs
        p = profile(fn, calls=20)
        m = bench(fn, budget_s=0.3 if quick else 1.0)
        rows.append(
            [name, p.launches_per_call, ms(p.host_ms_per_call), ms(p.device_ms_per_call), ms(m.median_ms)]
        )
    if dev == "cuda":
        g = bench(gelu_naive, x, graph=True)
        p = profile(gelu_naive, x, calls=20)
        rows.append(["CUDA graph replay", "1 graph", "-", ms(p.device_ms_per_call), ms(g.median_ms)])
        eager = bench(gelu_naive, x).median_ms
        conclusion = (
            f"eager: {ms(eager)} per call for {ms(p.device_ms_per_call)} of kernels -- "
            f"{eager / p.device_ms_per_call:.0f}x overhead; graph replay: {ms(g.median_ms)} "
            f"({eager / g.median_ms:.1f}x faster than eager)"
        )
    else:
        conclusion = (
            "no GPU: no launches to amortize and no CUDA graphs; on the CPU the op costs "
            f"{rows[0][4]} eager and {rows[1][4]} compiled"
        )
    plot = plot_launch_overhead(rows, Path(out_dir or "."))
    return finish(
        "launch-overhead",
        ["how", "launches/call", "host/call", "device/call", "median"],
        rows,
        conclusion,
        [plot],
        store,
        run_id,
    )


def plot_launch_overhead(rows, out: Path) -> str:
    groups = {
        r[0]: {
            "host time/call": parse_ms(r[2]),
            "device time/call": parse_ms(r[3]),
            "measured/call": parse_ms(r[4]),
        }
        for r in rows
    }
    return plot_bars(
        out / "launch_overhead.png", "a small op: where the time of a call goes", "ms per call (log)", groups
    )


def sync_pitfall(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    """The same work timed with time.time() and no sync, with sync, and with events/bench."""
    dev = device()
    n = 16384 if dev == "cuda" else 1024
    x = torch.randn(n, n, device=dev)
    for _ in range(3):
        gelu_naive(x)
    sync()
    reps = 10

    t = time.time()
    for _ in range(reps):
        gelu_naive(x)
    no_sync = (time.time() - t) * 1e3 / reps  # measures only the launches
    sync()
    t = time.time()
    for _ in range(reps):
        gelu_naive(x)
    sync()
    with_sync = (time.time() - t) * 1e3 / reps
    m = bench(gelu_naive, x, budget_s=0.5 if quick else 1.0)
    rows = [
        ["time.time(), no synchronize", ms(no_sync)],
        ["time.time(), synchronize", ms(with_sync)],
        [f"perfloop.bench ({m.meta['timer']})", ms(m.median_ms)],
    ]
    if dev == "cuda":
        conclusion = (
            f"without synchronize the timer read {ms(no_sync)}: {m.median_ms / no_sync:.0f}x too fast "
            f"(it timed the kernel launches, not the kernels); with synchronize {ms(with_sync)}, "
            f"events {ms(m.median_ms)}"
        )
    else:
        conclusion = (
            f"on the CPU work is synchronous: {ms(no_sync)} without sync, {ms(with_sync)} with, "
            f"{ms(m.median_ms)} by bench -- the pitfall needs a GPU to show"
        )
    plot = plot_sync_pitfall(rows, Path(out_dir or "."))
    return finish("sync-pitfall", ["timer", "per call"], rows, conclusion, [plot], store, run_id)


def plot_sync_pitfall(rows, out: Path) -> str:
    groups = {r[0]: {"per call": parse_ms(r[1])} for r in rows}
    return plot_bars(out / "sync_pitfall.png", "the same work, three timers", "ms per call (log)", groups)


def warmup(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    """The first calls against steady state, for eager, compiled and Triton code."""
    dev = device()
    n = 4096 if dev == "cuda" else 512
    x = torch.randn(n, n, device=dev)
    op = ops.get("gelu")
    kinds = {"eager (naive)": lambda: gelu_naive(x), "torch.compile": None}
    if op.variant("triton").why_unavailable(dev) is None and not op.variant("triton").interpreted:
        kinds["triton"] = None
    rows, series = [], {}
    out = Path(out_dir or ".")
    for name in kinds:
        if name == "torch.compile":
            fresh = torch.compile(lambda t: gelu_naive(t) * 1.0)  # a new graph: compiles on call 1
            fn = lambda fresh=fresh: fresh(x)
        elif name == "triton":
            from perfloop.ops.gelu import triton_impl

            # a block size the process has not compiled yet: call 1 compiles
            fn = lambda: triton_impl.gelu(x, block=512)
        else:
            fn = kinds[name]
        firsts = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            firsts.append((time.perf_counter() - t) * 1e3)
        steady = bench(fn, budget_s=0.3 if quick else 1.0).median_ms
        rows.append(
            [name, ms(firsts[0]), ms(firsts[1]), ms(firsts[2]), ms(steady), f"{firsts[0] / steady:.0f}x"]
        )
        series[name] = ([1, 2, 3, 4], [*firsts, steady])
    plot = plot_lines(
        out / "warmup.png", "the first calls against steady state", "call (4 = steady)", "time (ms)", series
    )
    worst = max(rows, key=lambda r: float(r[5][:-1]))
    conclusion = (
        f"the first call of {worst[0]} took {worst[1]}, {worst[5]} its steady state ({worst[4]}): "
        "compilation and autotuning land in call 1, so warm up before timing"
    )
    if "triton" not in kinds:
        conclusion += " (Triton runs interpreted here: not timed)"
    return finish(
        "warmup",
        ["code", "call 1", "call 2", "call 3", "steady", "call 1 / steady"],
        rows,
        conclusion,
        [plot],
        store,
        run_id,
    )
