"""Gated activations act(a) * b -- SwiGLU (act = silu) and GeGLU (act = GELU, tanh or exact form) --
forward and backward in Triton: one elementwise kernel each way.

Forward reads a and b and writes y (3 passes); backward reads a, b and dy and writes da and db
(5 passes), recomputing the activation rather than storing it: 8 passes in all, the fewest.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops import native
from perfloop.ops.base import cdiv, check_tensor, needs_grad
from perfloop.ops.gelu.triton_impl import gelu_erf, gelu_erf_grad, gelu_tanh, gelu_tanh_grad
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)  # elements a program, warps (tuned.json)
BLOCK, WARPS = TUNED["block"], TUNED["num_warps"]
SILU, GELU_TANH, GELU_ERF = 0, 1, 2  # the activations, for the kernels' ACT


@triton.jit
def gated_fwd_kernel(A, B, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        act = gelu_tanh(a)
    elif ACT == 2:
        act = gelu_erf(a)
    else:
        act = a * tl.sigmoid(a)
    tl.store(Y + offs, (act * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def gated_bwd_kernel(A, B, DY, DA, DB, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        act = gelu_tanh(a)
        dact = gelu_tanh_grad(a)
    elif ACT == 2:
        act = gelu_erf(a)
        dact = gelu_erf_grad(a)
    else:
        s = tl.sigmoid(a)
        act = a * s
        dact = s * (1.0 + a * (1.0 - s))
    tl.store(DA + offs, (dy * b * dact).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dy * act).to(DB.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def gated_forward(a, b, act: int) -> torch.Tensor:
    """act(a) * b of two contiguous tensors of one shape and dtype."""
    y = torch.empty_like(a)
    n = a.numel()
    if n:
        launch(gated_fwd_kernel, (cdiv(n, BLOCK),), a, b, y, n, ACT=act, BLOCK=BLOCK, num_warps=WARPS)
    return y


class GatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, act):
        ctx.save_for_backward(a, b)
        ctx.act = act
        return gated_forward(a, b, act)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        dy = _flat(dy)
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        if n:
            launch(
                gated_bwd_kernel,
                (cdiv(n, BLOCK),),
                a,
                b,
                dy,
                da,
                db,
                n,
                ACT=ctx.act,
                BLOCK=BLOCK,
                num_warps=WARPS,
            )
        return da, db, None


_PLANS: dict = {}  # (size, dtype, activation, device) -> the C++ side's plan, or None


def _make_plan(a, act: int):
    """The two kernels compiled for a's size and dtype and handed to native.cpp; None where the
    C++ Function cannot run them (native.why_not says why)."""
    ext = native.extension("swiglu")
    n = a.numel()
    if ext is None or n == 0:
        return None
    t = torch.empty(16, dtype=a.dtype, device=a.device)  # warmup compiles for dtype and alignment
    grid = (cdiv(n, BLOCK),)
    meta = {"ACT": act, "BLOCK": BLOCK, "num_warps": WARPS}
    fwd = native.add_kernel(ext, gated_fwd_kernel, grid, t, t, t, n, **meta)
    bwd = native.add_kernel(ext, gated_bwd_kernel, grid, t, t, t, t, t, n, **meta)
    return native.plan_of("swiglu", ext, (fwd, bwd), grid[0])


def _gated_function(a, b, act: int):
    """act(a) * b through autograd: the C++ Function where it runs, else the Python one."""
    if a.is_cuda:
        dev = a.get_device()
        plan = native.plan_for(_PLANS, (a.numel(), a.dtype, act, dev), lambda: _make_plan(a, act), a.device)
        if plan is not None:
            stream = torch._C._cuda_getCurrentRawStream(dev)
            return native.extension("swiglu").gated(a, b, plan, stream)
    return GatedFunction.apply(a, b, act)


def _gated(a, b, act: int):
    check_tensor("a", a)
    check_tensor("b", b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"a, b: need the same shape and dtype, got {tuple(a.shape)} {a.dtype} and "
            f"{tuple(b.shape)} {b.dtype}"
        )
    a, b = _flat(a), _flat(b)
    return _gated_function(a, b, act) if needs_grad(a, b) else gated_forward(a, b, act)


def swiglu(a, b):
    return _gated(a, b, SILU)


def geglu(a, b, approximate: str = "tanh"):
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: {approximate!r} is neither 'tanh' nor 'none' (torch's two forms)")
    return _gated(a, b, GELU_TANH if approximate == "tanh" else GELU_ERF)
