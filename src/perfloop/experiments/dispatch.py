"""Same line of code, different kernels: which GEMM `a @ b` dispatches to, by shape and dtype."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from perfloop import ops
from perfloop.analysis.profiling import profile
from perfloop.experiments._common import device, finish, ms, plot_bars
from perfloop.harness.timing import bench


def decode(name: str) -> dict:
    """Library, architecture, tile shape and data type from a GEMM kernel's name, where the
    name carries them (cuBLAS/cuBLASLt 'sm90_xmma_gemm_...', 'nvjet_...', cutlass, ampere_sgemm)."""
    low = name.lower()
    info = {"library": "?", "arch": "?", "tile": "?", "dtype": "?"}
    if "nvjet" in low:
        info["library"] = "cuBLAS (nvjet)"
    elif "cutlass" in low:
        info["library"] = "CUTLASS"
    elif "xmma" in low or "gemm" in low or "sgemm" in low:
        info["library"] = "cuBLAS"
    elif low.startswith("aten::"):
        info["library"] = "CPU BLAS (via " + name + ")"
    if m := re.search(r"sm_?(\d{2,3})", low):
        info["arch"] = f"sm_{m.group(1)}"
    elif m := re.search(r"\b(ampere|volta|turing|hopper|maxwell)", low):
        info["arch"] = m.group(1)
    if m := re.search(r"tilesize(\d+x\d+x\d+)", low) or re.search(r"_(\d{2,3}x\d{2,3}(?:_\d+x\d+)?)_", low):
        info["tile"] = m.group(1)
    # (nvjet names carry no data type: their `_h_`/`_v_` is not fp16, so it is not read as such)
    for pat, dt in (
        ("bf16", "bf16"),
        ("f16", "fp16"),
        ("tf32", "tf32"),
        ("sgemm", "fp32"),
        ("s1688", "tf32"),
        ("f32", "fp32"),
    ):
        if pat in low:
            info["dtype"] = dt
            break
    return info


def matmul_dispatch(quick=False, store=None, run_id=None, out_dir=None) -> dict:
    dev = device()
    if dev == "cuda":
        shapes = [
            (128, 128, 128),
            (1024, 1024, 1024),
            (8192, 8192, 8192),
            (8192, 8192, 64),
            (16, 8192, 8192),
            (8192, 64, 8192),
        ]
        dtypes = [torch.float32, torch.bfloat16]
    else:
        shapes = [(64, 64, 64), (512, 512, 512), (512, 512, 16), (8, 512, 512)]
        dtypes = [torch.float32]
    if quick:
        shapes = shapes[:3]
    rows = []
    for dtype in dtypes:
        for m_, n_, k_ in shapes:
            a = torch.randn(m_, k_, device=dev, dtype=dtype)
            b = torch.randn(k_, n_, device=dev, dtype=dtype)
            p = profile(torch.matmul, a, b, calls=3)
            main = p.kernels[0]
            info = decode(main.name)
            t = bench(torch.matmul, a, b, budget_s=0.3 if quick else 0.5).median_ms
            rows.append(
                [
                    f"{m_}x{n_}x{k_}",
                    ops.dtype_name(dtype),
                    main.short[:48],
                    info["library"],
                    info["arch"],
                    info["tile"],
                    info["dtype"] if info["dtype"] != "?" else "? (not in the name)",
                    ms(t),
                    2 * m_ * n_ * k_ / (t * 1e-3) / 1e12,
                ]
            )
    kernels = {r[2] for r in rows}
    if dev == "cuda":
        conclusion = (
            f"{len(rows)} calls of the same `a @ b` ran {len(kernels)} distinct kernels: the library "
            "picks a kernel (tile shape, split, precision path) per shape and dtype"
        )
    else:
        conclusion = (
            f"on the CPU all {len(rows)} calls go through {', '.join(sorted(kernels))} to the CPU "
            "BLAS; its kernel choice is not visible to the profiler -- run this on a GPU"
        )
    plot = plot_matmul_dispatch(rows, Path(out_dir or "."))
    return finish(
        "matmul-dispatch",
        ["shape MxNxK", "dtype", "kernel", "library", "arch", "tile", "math", "median", "TFLOP/s"],
        rows,
        conclusion,
        [plot],
        store,
        run_id,
    )


def plot_matmul_dispatch(rows, out: Path) -> str:
    groups: dict = {}
    for shape, dtype, *_, tflops in rows:
        groups.setdefault(shape, {})[dtype] = float(tflops)
    return plot_bars(
        out / "matmul_dispatch.png", "`a @ b`: TFLOP/s of the kernel each shape got", "TFLOP/s (log)", groups
    )
