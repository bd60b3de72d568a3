"""RoPE's table (tuned.json): each (pairs a program, warps) timed forward + backward on q and k at
benchmarks/rope.py's shape; prints the times, fastest first.

    PYTHONPATH=src python3 benchmarks/tuning/rope_tune.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from perfloop.ops.rope import angles
from perfloop.ops.rope import triton_impl as impl


def main() -> None:
    b, h, t, d = 4, 32, 4096, 128
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = (x.to("cuda", torch.bfloat16) for x in angles(t, d))

    def step():
        outs = impl.rope(q, cos, sin), impl.rope(k, cos, sin)
        torch.autograd.grad(outs, (q, k), (dq, dk))

    times = []
    for elements in (1024, 2048, 4096, 8192, 16384):
        for warps in (2, 4, 8, 16):
            impl.TUNED.update(elements=elements, rows_max=256, num_warps=warps)
            ms = do_bench(step, return_mode="median")
            times.append({"elements": elements, "num_warps": warps, "ms": ms})
    times.sort(key=lambda r: r["ms"])
    Path(sys.argv[1]).write_text(json.dumps(times, indent=1))
    print(json.dumps(times[:6], indent=1))


if __name__ == "__main__":
    main()
