"""Where the fused norm's time goes on a GPU: its forward and backward kernels alone (device
time, CUDA-graph replays), over the backward's programs per SM and warps; and the kernels of one
forward + backward against torch's.

    PYTHONPATH=src python3 benchmarks/tuning/norm_tune.py OUT_DIR [ROWSxCOLS, default 8192x4096]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton

import perfloop as pl
from perfloop.ops.layernorm import triton_impl as T


def main(out: Path, m: int, n: int) -> None:
    res = {"device": pl.device_info()["name"], "shape": [m, n], "rows": []}
    for dtype in (torch.bfloat16, torch.float32):
        _tune(dtype, res, m, n)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"norm-tune-{m}x{n}.json").write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(r)
    for k, v in res["profiles"].items():
        print(k, v)


def _tune(dtype, res: dict, m: int, n: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    stats = torch.empty((2, m), device="cuda", dtype=torch.float32)
    block = triton.next_power_of_2(n)
    size = x.element_size()
    for warps in (4, 8, 16):

        def fwd(warps=warps):
            T.norm_fwd_kernel[(m,)](
                x, w, b, y, stats, n, n, m, n, 1e-5, RMS=False, HAS_B=True, BLOCK=block, num_warps=warps
            )

        t = pl.bench(fwd, graph=True, budget_s=0.5).median_ms
        res["rows"].append(
            {
                "dtype": str(dtype),
                "kernel": "fwd",
                "warps": warps,
                "ms": t,
                "gbps": 2 * m * n * size / t / 1e6,
            }
        )
    fwd()
    dx = torch.empty_like(x)
    for per_sm, warps, rows in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4)):
        g = per_sm * sms
        partial = torch.empty((2, g, n), device="cuda", dtype=torch.float32)

        def bwd(g=g, partial=partial, warps=warps, rows=rows):
            T.norm_bwd_kernel[(g,)](
                x,
                w,
                dy,
                dx,
                stats,
                partial,
                n,
                n,
                n,
                m,
                n,
                triton.cdiv(m, g),
                RMS=False,
                HAS_B=True,
                ROWS=rows,
                BLOCK=block,
                num_warps=warps,
            )

        t = pl.bench(bwd, graph=True, budget_s=0.3).median_ms
        res["rows"].append(
            {
                "dtype": str(dtype),
                "kernel": "bwd",
                "programs_per_sm": per_sm,
                "warps": warps,
                "rows": rows,
                "ms": t,
                "gbps": 3 * m * n * size / t / 1e6,
            }
        )
    # one forward + backward through the module and through torch's: kernels and device time
    for label, mod in (("perfloop", pl.nn.LayerNorm(n)), ("torch", torch.nn.LayerNorm(n))):
        mod = mod.to("cuda", dtype)
        xr = x.clone().requires_grad_()

        def step(mod=mod, xr=xr):
            torch.autograd.grad(mod(xr), [xr, *mod.parameters()], dy)

        p = pl.profile(step, calls=5, count_work=False)
        res.setdefault("profiles", {})[f"{label} {dtype}"] = {
            "device_ms": p.device_ms_per_call,
            "wall_ms": p.wall_ms_per_call,
            "kernels": [(k.short, k.calls // 5, k.total_ms / 5) for k in p.kernels],
        }


if __name__ == "__main__":
    m, n = map(int, (sys.argv[2] if len(sys.argv) > 2 else "8192x4096").split("x"))
    main(Path(sys.argv[1]), m, n)
