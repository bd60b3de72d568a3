"""LayerNorm and RMSNorm forward and backward in Triton, one kernel each way.

Forward: one program per row, the row in registers; it writes y and the row's statistics
(mean, 1/std: 8 bytes a row). Backward: each program walks a band of rows, recomputes x-hat
from x and the statistics, writes dx, and keeps its band's dw and db partial sums in
registers; one small sum over the programs' partials finishes them. Bytes: forward reads x
and writes y, backward reads x and dy and writes dx -- the 5 passes over x a norm needs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops import native
from perfloop.ops.base import as_rows, cdiv, check_tensor, needs_grad, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.layernorm import MAX_N
from perfloop.ops.tuning import first_at_most, load_table

TUNED = load_table(Path(__file__).parent)  # warps, the backward's band, the dw/db sum's tile (tuned.json)
COLSUM_ROWS, COLSUM_BLOCK = TUNED["colsum_tile"]  # the final dw/db sum: a program's tile of partials a step


@triton.jit
def norm_fwd_kernel(X, W, B, Y, STATS, stride_x, stride_y, n_rows, n_cols, eps,
                    RMS: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    MEAN = STATS
    RSTD = STATS + n_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd_kernel(X, W, DY, DX, STATS, PARTIAL, stride_x, stride_dy, stride_dx, n_rows, n_cols,
                    rows_per_program, RMS: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    MEAN = STATS
    RSTD = STATS + n_rows
    DW = PARTIAL
    DB = PARTIAL + tl.num_programs(0) * n_cols
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, ROWS):  # ROWS rows at a time: more bytes in flight per program
        rows = start + tl.arange(0, ROWS)
        rmask = rows < last
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + rows, mask=rmask, other=0.0)[:, None]) * rstd, 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, axis=1)[:, None] / n_cols
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - xhat * c1 - tl.sum(wdy, axis=1)[:, None] / n_cols) * rstd
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_B:
            db += tl.sum(dy, axis=0)
    tl.store(DW + pid * n_cols + cols, dw, mask=cmask)
    if HAS_B:
        tl.store(DB + pid * n_cols + cols, db, mask=cmask)


@triton.jit
def colsum_kernel(PARTIAL, OUT, n_parts, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[j] = sum of PARTIAL's n_parts rows at column j (fp32), in OUT's dtype; program (i, j)
    sums block i of columns of the j-th (n_parts, n_cols) slab, ROWS rows a step."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slab = tl.program_id(1).to(tl.int64)
    cmask = cols < n_cols
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK], tl.float32)
    for r in range(0, n_parts, ROWS):
        mask = ((r + rows) < n_parts)[:, None] & cmask[None, :]
        offs = (slab * n_parts + r + rows)[:, None] * n_cols + cols[None, :]
        acc += tl.load(PARTIAL + offs, mask=mask, other=0.0)
    tl.store(OUT + slab * n_cols + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cmask)


@functools.cache
def _warps(block: int) -> int:
    return first_at_most(TUNED["fwd_warps"], block)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


@functools.cache
def _bwd_setup(block: int, itemsize: int, device: torch.device) -> tuple[int, int, int]:
    """(most programs, rows a step, warps) of the backward, from the op's table (tuned.json)."""
    rows = first_at_most(TUNED["bwd_rows_a_step"], block)
    per_sm = first_at_most(TUNED["bwd_programs_per_sm"], block)
    warps = first_at_most(TUNED["bwd_warps_by_tile_bytes"], rows * block * itemsize)
    return per_sm * _sms(device), rows, warps


def _bwd_config(n_rows: int, block: int, itemsize: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, rows a step, warps) of the backward for n_rows rows."""
    most, rows, warps = _bwd_setup(block, itemsize, device)
    return max(1, min(n_rows, most)), rows, warps


def forward_parts(x, weight, bias, eps: float, rms: bool):
    """(y, stats): the norm of x over its last dimension, and each row's mean and 1/std (fp32)."""
    n = x.shape[-1]
    x2 = as_rows(x)
    m = x2.shape[0]
    y = torch.empty_like(x2)
    stats = x.new_empty((2, m), dtype=torch.float32)  # mean, 1/std
    block = next_pow2(n)
    if m:
        launch(
            norm_fwd_kernel,
            (m,),
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            stats,
            x2.stride(0),
            y.stride(0),
            m,
            n,
            eps,
            RMS=rms,
            HAS_B=bias is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return (y if x.ndim == 2 else y.view(x.shape)), stats


def backward_parts(dy, x, weight, stats, has_bias: bool, rms: bool):
    """(dx, dweight, dbias or None) of the norm, from its input and the forward's stats."""
    n = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    block = next_pow2(n)
    g, rows, warps = _bwd_config(m, block, x2.element_size(), x2.device)
    slabs = 2 if has_bias else 1
    partial = x2.new_empty((slabs, g, n), dtype=torch.float32)
    sums = weight.new_empty((slabs, n) if has_bias else (n,))
    if m:
        launch(
            norm_bwd_kernel,
            (g,),
            x2,
            weight,
            dy2,
            dx,
            stats,
            partial,
            x2.stride(0),
            dy2.stride(0),
            dx.stride(0),
            m,
            n,
            cdiv(m, g),
            RMS=rms,
            HAS_B=has_bias,
            ROWS=rows,
            BLOCK=block,
            num_warps=warps,
        )
    else:
        partial.zero_()
    launch(
        colsum_kernel,
        (cdiv(n, COLSUM_BLOCK), slabs),
        partial,
        sums,
        g,
        n,
        ROWS=COLSUM_ROWS,
        BLOCK=COLSUM_BLOCK,
    )
    dx = dx if x.ndim == 2 else dx.view(x.shape)
    return dx, *((sums[0], sums[1]) if has_bias else (sums, None))


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, stats = forward_parts(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, stats)
        ctx.has_bias, ctx.rms = bias is not None, rms
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        dx, dw, db = backward_parts(dy, x, weight, stats, ctx.has_bias, ctx.rms)
        return dx, dw, db, None, None


_PLANS: dict = {}  # (shape, dtypes, bias?, rms, device) -> the C++ side's plan, or None


def _make_plan(x, weight, bias, rms: bool):
    """The three kernels compiled for x's shape and dtypes and handed to native.cpp; None where
    the C++ Function cannot run them (native.why_not says why)."""
    ext = native.extension("layernorm")
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    if ext is None or m == 0:
        return None
    block = next_pow2(n)
    g, rows, warps = _bwd_config(m, block, x.element_size(), x.device)
    has_b = bias is not None
    slabs = 2 if has_b else 1

    def t(dtype):  # warmup compiles for a tensor's dtype and alignment: a small aligned one does
        return torch.empty(16, dtype=dtype, device=x.device)

    xd, wd, f32 = t(x.dtype), t(weight.dtype), t(torch.float32)
    bd = t(bias.dtype) if has_b else wd
    rpp = cdiv(m, g)
    fwd = native.add_kernel(
        ext,
        norm_fwd_kernel,
        (m,),
        xd,
        wd,
        bd,
        xd,
        f32,
        n,
        n,
        m,
        n,
        1e-5,
        RMS=rms,
        HAS_B=has_b,
        BLOCK=block,
        num_warps=_warps(block),
    )
    bwd = native.add_kernel(
        ext,
        norm_bwd_kernel,
        (g,),
        xd,
        wd,
        xd,
        xd,
        f32,
        f32,
        n,
        n,
        n,
        m,
        n,
        rpp,
        RMS=rms,
        HAS_B=has_b,
        ROWS=rows,
        BLOCK=block,
        num_warps=warps,
    )
    colsum = native.add_kernel(
        ext,
        colsum_kernel,
        (cdiv(n, COLSUM_BLOCK), slabs),
        f32,
        wd,
        g,
        n,
        ROWS=COLSUM_ROWS,
        BLOCK=COLSUM_BLOCK,
    )
    return native.plan_of("layernorm", ext, (fwd, bwd, colsum), g, rpp, cdiv(n, COLSUM_BLOCK))


def fused_norm(x, weight, bias, eps: float, rms: bool):
    """The norm through autograd where a gradient is wanted (the C++ Function where it runs,
    else the Python one), else its forward alone."""
    if needs_grad(x, weight, bias):
        if x.is_cuda and (bias is None or bias.dtype == weight.dtype):
            dev = x.get_device()
            key = (x.shape, x.dtype, weight.dtype, bias is None, rms, dev)
            plan = native.plan_for(_PLANS, key, lambda: _make_plan(x, weight, bias, rms), x.device)
            if plan is not None:
                stream = torch._C._cuda_getCurrentRawStream(dev)
                return native.extension("layernorm").norm(x, weight, bias, eps, plan, stream)
        return NormFunction.apply(x, weight, bias, eps, rms)
    return forward_parts(x, weight, bias, eps, rms)[0]


def supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None if the kernels take these tensors, else why not."""
    if x.shape[-1] > MAX_N:
        return f"rows of {x.shape[-1]} elements (the kernels hold a row of at most {MAX_N})"
    if weight.shape != x.shape[-1:]:
        return f"a weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {x.dtype}"
    return None


def norm(x, weight, bias=None, eps: float = 1e-5, rms: bool = False):
    check_tensor("x", x)
    why = supported(x, weight)
    if why:
        raise ValueError(f"x: the fused norm does not take {why}")
    return fused_norm(x, weight, bias, eps, rms)


def layer_norm(x, weight, bias, eps: float = 1e-5):
    return norm(x, weight, bias, eps, rms=False)
