"""Where a fused module's host time goes (issue 25, item 1), against torch's own module: for each
pair at issue 25's sizes, forward + backward as `do_bench` times it (ANCHORS.md's method), the
host's own time per call (200 calls issued back to back, one sync at the end: where the host is
the limit, its pace), and a cProfile of those calls (the Python functions the time is spent in);
then both ratios again with torch's call and ours measured in turn, round after round (the GPU
machine's host pace drifts by a third within minutes: one after the other, whole, it misleads).

    PYTHONPATH=src python3 benchmarks/experiments/host_cost.py OUT_DIR [OP,OP...]

For the norms, their fused call through the Python autograd Function (the path before the C++
one, ops/layernorm/native.cpp) is timed too, in turn with the C++ one. Writes
OUT_DIR/host_cost.json and OUT_DIR/host_cost_profile_<name>.txt; needs a GPU.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop.nn as pnn

SHAPES = [(8192, 4096), (1024, 768)]


def pairs(rows: int, width: int, dev: str = "cuda"):
    """(name, torch's callable, perfloop's callable) for forward + backward at (rows, width), bf16."""
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(rows + width)
    x = torch.randn(rows, width, device=dev, dtype=dt, generator=g).requires_grad_()
    dy = torch.randn(rows, width, device=dev, dtype=dt, generator=g)

    def fb(module, *inputs):
        params = list(module.parameters())

        def run():
            y = module(*inputs)
            torch.autograd.grad(y, [t for t in inputs if t.requires_grad] + params, dy if y.ndim else None)

        return run

    out = []
    for name, t_cls, p_cls in (
        ("RMSNorm", nn.RMSNorm, pnn.RMSNorm),
        ("LayerNorm", nn.LayerNorm, pnn.LayerNorm),
    ):
        t_mod, p_mod = t_cls(width, device=dev, dtype=dt), p_cls(width, device=dev, dtype=dt)
        out.append((name, fb(t_mod, x), fb(p_mod, x)))
    b = torch.randn(rows, width, device=dev, dtype=dt, generator=g).requires_grad_()

    def swiglu_torch():
        torch.autograd.grad(F.silu(x) * b, [x, b], dy)

    sw = pnn.SwiGLU()

    def swiglu_ours():
        torch.autograd.grad(sw(x, b), [x, b], dy)

    out.append(("SwiGLU", swiglu_torch, swiglu_ours))
    vocab = 50304 if rows * 50304 * 2 < 8 * 2**30 else 8192
    logits = torch.randn(rows, vocab, device=dev, dtype=dt, generator=g).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    ce_t, ce_p = nn.CrossEntropyLoss(), pnn.CrossEntropyLoss()
    out.append(
        (
            "CrossEntropyLoss",
            lambda: torch.autograd.grad(ce_t(logits, target), [logits]),
            lambda: torch.autograd.grad(ce_p(logits, target), [logits]),
        )
    )
    return out


def host_ms(f, calls: int = 200) -> float:
    for _ in range(10):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / calls * 1e3


def host_spread_ms(f, calls: int = 500, rounds: int = 3) -> dict:
    """The host's time per call as host_parts.py takes it (the best of `rounds` runs of `calls`),
    and each call timed alone within them (median, 90th percentile, max): whether a mean is
    a pace or a few stalls."""
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    best, each = float("inf"), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            f()
            each.append(time.perf_counter() - t)
        best = min(best, (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    each.sort()
    return {
        "best_of_rounds_ms": best * 1e3,
        "median_ms": each[len(each) // 2] * 1e3,
        "p90_ms": each[int(len(each) * 0.9)] * 1e3,
        "max_ms": each[-1] * 1e3,
    }


def paired_ratio(base, other, measure, rounds: int = 9) -> dict:
    """other's time over base's, each round measuring the two back to back (which goes first
    alternating): the median of the rounds' ratios, and their range. A host whose pace drifts
    within minutes moves both sides of a round alike."""
    ratios = []
    for i in range(rounds):
        first, second = (base, other) if i % 2 == 0 else (other, base)
        a, b = measure(first), measure(second)
        ratios.append(b / a if i % 2 == 0 else a / b)
    ratios.sort()
    return {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1], "rounds": rounds}


def python_profile(f, calls: int = 200) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def python_function(f):
    """f with the C++ Functions off: every fused op runs its Python autograd Function instead."""
    from perfloop.ops import native

    def run():
        plan_for = native.plan_for
        native.plan_for = lambda *a: None
        try:
            f()
        finally:
            native.plan_for = plan_for

    return run


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not torch.cuda.is_available():
        print("host_cost: needs a GPU and OUT_DIR", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    only = set(argv[1].split(",")) if len(argv) > 1 else None
    rows_out = []
    for rows, width in SHAPES:
        for name, t_fn, p_fn in pairs(rows, width):
            if only and name not in only:
                continue
            row = {"op": name, "shape": [rows, width]}
            if name in ("RMSNorm", "LayerNorm"):
                py_fn = python_function(p_fn)
                row["python_function"] = {
                    "do_bench_ms": do_bench(py_fn, return_mode="median"),
                    "host_ms": host_ms(py_fn),
                }
                row["cpp_over_python_paired"] = {
                    "do_bench": paired_ratio(py_fn, p_fn, lambda f: do_bench(f, return_mode="median")),
                    "host": paired_ratio(py_fn, p_fn, lambda f: host_ms(f, calls=100)),
                }
                row["python_function_over_torch_paired"] = paired_ratio(
                    t_fn, py_fn, lambda f: do_bench(f, return_mode="median")
                )
            for who, f in (("torch", t_fn), ("perfloop", p_fn)):
                row[who] = {
                    "do_bench_ms": do_bench(f, return_mode="median"),
                    "host_ms": host_ms(f),
                    "host_spread": host_spread_ms(f),
                }
                (out / f"host_cost_profile_{name}_{rows}x{width}_{who}.txt").write_text(python_profile(f))
            row["do_bench_ratio"] = row["perfloop"]["do_bench_ms"] / row["torch"]["do_bench_ms"]
            row["host_ratio"] = row["perfloop"]["host_ms"] / row["torch"]["host_ms"]
            # the same two ratios with torch's call and ours taken in turn, round after round
            row["do_bench_paired"] = paired_ratio(t_fn, p_fn, lambda f: do_bench(f, return_mode="median"))
            row["host_paired"] = paired_ratio(t_fn, p_fn, lambda f: host_ms(f, calls=100))
            print(
                f"{name:18} {rows}x{width}: do_bench {row['do_bench_ratio']:.2f}x torch, host "
                f"{row['perfloop']['host_ms'] * 1e3:.0f} us vs {row['torch']['host_ms'] * 1e3:.0f} us "
                f"({row['host_ratio']:.2f}x); in turn: do_bench {row['do_bench_paired']['median']:.2f}x, "
                f"host {row['host_paired']['median']:.2f}x"
            )
            if "python_function" in row:
                c = row["cpp_over_python_paired"]["do_bench"]
                h = row["cpp_over_python_paired"]["host"]["median"]
                d = row["python_function_over_torch_paired"]["median"]
                print(
                    f"{'':18} C++ Function over the Python one, in turn: do_bench {c['median']:.2f}x "
                    f"({c['min']:.2f}-{c['max']:.2f}), host {h:.2f}x; Python Function / torch {d:.2f}x"
                )
            rows_out.append(row)
            (out / "host_cost.json").write_text(
                json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
