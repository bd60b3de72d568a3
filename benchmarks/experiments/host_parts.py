"""Where the host time of one fused norm call goes, piece by piece (issue 25, item 1): each piece
issued 500 times back to back with one sync at the end, at 1024 x 768 bf16 (the GPU is never the
limit there), against torch's module. Also prints the installed Triton's launch path, the code a
cached launch must match.

    PYTHONPATH=src python3 benchmarks/experiments/host_parts.py OUT_DIR
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn


def host_us(f, calls: int = 500) -> float:
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "out")
    out.mkdir(parents=True, exist_ok=True)
    import triton
    from host_python import Nop
    from triton.runtime.jit import JITFunction

    import perfloop.nn as pnn
    from perfloop.ops.launch import launch
    from perfloop.ops.layernorm import triton_impl as ln

    dev, dt, rows, width = "cuda", torch.bfloat16, 1024, 768
    x = torch.randn(rows, width, device=dev, dtype=dt).requires_grad_()
    dy = torch.randn(rows, width, device=dev, dtype=dt)
    t_mod, p_mod = nn.RMSNorm(width, device=dev, dtype=dt), pnn.RMSNorm(width, device=dev, dtype=dt)
    t_ln, p_ln = nn.LayerNorm(width, device=dev, dtype=dt), pnn.LayerNorm(width, device=dev, dtype=dt)
    w = p_mod.weight
    xd = x.detach()
    y, stats = ln.forward_parts(xd, w, None, 1e-6, True)
    y2 = torch.empty_like(xd)
    st2 = torch.empty((2, rows), dtype=torch.float32, device=dev)
    args = (xd, w, w, y2, st2, xd.stride(0), y2.stride(0), rows, width, 1e-6)

    def bare_launch():
        ln.norm_fwd_kernel[(rows,)](*args, RMS=True, HAS_B=False, BLOCK=1024, num_warps=4)

    def perfloop_launch():
        launch(ln.norm_fwd_kernel, (rows,), *args, RMS=True, HAS_B=False, BLOCK=1024, num_warps=4)

    ck = ln.norm_fwd_kernel[(rows,)](*args, RMS=True, HAS_B=False, BLOCK=1024, num_warps=4)
    full = (*args, True, False, 1024)

    def cached_launch():
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        ck.run(rows, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *full)

    def fb(f, params=None):
        def run():
            torch.autograd.grad(f(), [x, *(params if params is not None else [w])], dy)

        return run

    class OneLaunch(torch.autograd.Function):  # Nop with one cached launch each way
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            cached_launch()
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            cached_launch()
            return torch.empty_like(a), torch.empty_like(b)

    import threading

    def on_thread(f, calls=500):
        res = {}

        def body():
            res["us"] = host_us(f, calls)

        th = threading.Thread(target=body)
        th.start()
        th.join()
        return res["us"]

    pieces = {
        "torch RMSNorm fwd+bwd": fb(lambda: t_mod(x), [t_mod.weight]),
        "torch LayerNorm fwd+bwd": fb(lambda: t_ln(x), [t_ln.weight, t_ln.bias]),
        "perfloop LayerNorm fwd+bwd": fb(lambda: p_ln(x), [p_ln.weight, p_ln.bias]),
        "perfloop RMSNorm fwd+bwd": fb(lambda: p_mod(x)),
        "torch RMSNorm fwd (no grad)": lambda: t_mod(xd),
        "perfloop RMSNorm fwd (no grad)": lambda: p_mod(xd),
        "NormFunction.apply fwd+bwd": fb(lambda: ln.NormFunction.apply(x, w, None, 1e-6, True)),
        "Nop autograd.Function fwd+bwd": fb(lambda: Nop.apply(x, w)),
        "Nop + one cached launch each way": fb(lambda: OneLaunch.apply(x, w)),
        "forward_parts": lambda: ln.forward_parts(xd, w, None, 1e-6, True),
        "backward_parts": lambda: ln.backward_parts(dy, xd, w, stats, False, True),
        "kernel[grid](...) one launch": bare_launch,
        "CompiledKernel.run one launch": cached_launch,
        "perfloop.ops.launch one launch": perfloop_launch,
        "torch.empty_like": lambda: torch.empty_like(xd),
        "stats[0] (a view)": lambda: stats[0],
        "partial.sum(1).to(bf16)": lambda: st2.sum(1).to(dt),
        "torch.autograd.grad of x*2": fb(lambda: x * 2, []),
    }
    res = {}
    for name, f in pieces.items():
        try:
            res[name] = host_us(f)
        except Exception as e:
            res[name] = f"{type(e).__name__}: {e}"[:300]
        print(f"{name:36} {res[name]} us", flush=True)
    res["backward_parts, timed on another thread"] = on_thread(
        lambda: ln.backward_parts(dy, xd, w, stats, False, True)
    )
    print("backward_parts on another thread", res["backward_parts, timed on another thread"])
    try:
        y2.zero_()
        cached_launch()
        torch.cuda.synchronize()
        res["cached launch equals forward_parts"] = bool(torch.equal(y2, y))
    except Exception as e:
        res["cached launch equals forward_parts"] = f"{type(e).__name__}: {e}"[:300]
    print("cached launch equals:", res["cached launch equals forward_parts"])
    src = inspect.getsource(JITFunction.run)
    tail = src[src.find("if not warmup") :][:1500]
    ck_run = inspect.signature(type(ck).__getitem__) if hasattr(type(ck), "__getitem__") else None
    info = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "host_us": res,
        "jit_run_tail": tail,
        "ck_getitem": str(ck_run),
        "ck_getitem_src": inspect.getsource(type(ck).__getitem__)[:1500],
    }
    (out / "host_parts.json").write_text(json.dumps(info, indent=1))
    print(tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
