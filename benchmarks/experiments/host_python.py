"""The Python around a fused module's kernels, per call, on any machine (issue 25, item 1): each
fused module's forward + backward with its kernel launches left out (`launch` replaced by a
function that returns at once), against an autograd Function that does nothing at all, on a
tiny tensor (on the GPU where there is one; its kernels are never launched). What is left is the
wrapper's own host cost: the module's checks, the autograd Function, reshapes, allocations and
launch settings. The GPU's host (benchmarks/experiments/host_parts.py) pays the same Python ~4x slower (its
forward_parts' non-launch part: 32 us there).

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/experiments/host_python.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def best_us(pieces: dict, calls: int = 1000, rounds: int = 15) -> dict:
    """Each piece's best per-call time over `rounds` runs of `calls`, the pieces taking turns
    in every round (a slow stretch of a shared machine then lands on all of them alike)."""
    for f in pieces.values():
        for _ in range(200):
            f()
    best = dict.fromkeys(pieces, float("inf"))
    for _ in range(rounds):
        for name, f in pieces.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


class Nop(torch.autograd.Function):
    """An autograd Function that does nothing: the floor of any fused call's host path."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(w)


def pieces() -> dict:
    import perfloop.nn as pnn
    from perfloop.ops.attention import triton_impl as at
    from perfloop.ops.cross_entropy import triton_impl as ce
    from perfloop.ops.layernorm import triton_impl as ln
    from perfloop.ops.swiglu import triton_impl as sw

    for mod in (ln, ce, sw, at):
        mod.launch = lambda *a, **k: None  # the kernels left out: their outputs stay unwritten

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels never run: only their Python

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    g = torch.Generator().manual_seed(0)
    x, dy, b, logits = rand(4, 64).requires_grad_(), rand(4, 64), rand(4, 64).requires_grad_(), rand(4, 64)
    logits.requires_grad_()
    target = torch.randint(0, 64, (4,), generator=g).to(dev)
    q, k, v = (rand(1, 2, 16, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = rand(1, 2, 16, 64, dtype=torch.bfloat16)
    rms, norm = pnn.RMSNorm(64, device=dev), pnn.LayerNorm(64, device=dev)
    swiglu, loss = pnn.SwiGLU(), pnn.CrossEntropyLoss()

    def fb(f, inputs, grad=dy):
        return lambda: torch.autograd.grad(f(), inputs, grad)

    return {
        "Nop autograd.Function fwd+bwd": fb(lambda: Nop.apply(x, rms.weight), [x, rms.weight]),
        "perfloop.nn.RMSNorm fwd+bwd": fb(lambda: rms(x), [x, rms.weight]),
        "perfloop.nn.LayerNorm fwd+bwd": fb(lambda: norm(x), [x, norm.weight, norm.bias]),
        "perfloop.nn.SwiGLU fwd+bwd": fb(lambda: swiglu(x, b), [x, b]),
        "perfloop.nn.CrossEntropyLoss fwd+bwd": fb(lambda: loss(logits, target), [logits], None),
        "flash_attention fwd (inputs need grad)": lambda: at.flash_attention(q, k, v, True),
        "flash_attention fwd+bwd": fb(lambda: at.flash_attention(q, k, v, True)[0], [q, k, v], do),
        "layernorm forward_parts": lambda: ln.forward_parts(x.detach(), rms.weight, None, 1e-6, True),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        print("host_python: set TRITON_INTERPRET=1 on a machine without a GPU", file=sys.stderr)
        return 2
    res = best_us(pieces())
    for name, us in res.items():
        print(f"{name:40} {us:7.2f} us")
    if argv:
        out = Path(argv[0])
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_python.json").write_text(json.dumps({"torch": torch.__version__, "us": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
