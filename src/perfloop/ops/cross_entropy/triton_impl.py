"""Cross entropy from logits in Triton: forward, one read of the logits; backward, one read and
one write.

Forward: one program per row walks the row in tiles with a running max and sum of exponentials
(online softmax) and writes the row's log-sum-exp and loss (8 bytes a row). Backward: one
program per row reads the row again and writes dlogits = (softmax - one_hot(target)) * dloss /
n_valid directly, in the logits' dtype. The logits are never copied to fp32 and the gradient is
made where autograd asks for it, scaled by the upstream gradient (no multiply pass after).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops import native
from perfloop.ops.base import check_tensor, needs_grad, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)  # a row's tile and warps (tuned.json)
BLOCK, WARPS = TUNED["block"], TUNED["num_warps"]
MEAN_BLOCK = TUNED["mean_block"]  # rows a step of the one program that takes the mean


@triton.jit
def row_lse(base, n_cols, BLOCK: tl.constexpr):
    """log-sum-exp of one row, walked in tiles with a running max and sum (online softmax)."""
    m = tl.full([BLOCK], -1e30, tl.float32)  # finite: no inf - inf where a lane sees only padding
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_max = tl.max(m, axis=0)
    return row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))


@triton.jit
def row_loss(base, t_ptr, loss_ptr, ok_ptr, n_cols, ignore_index, BLOCK: tl.constexpr):
    """One row's loss (lse - x[t], 0 where t is ignored) stored; returns (lse, t, valid). A target
    out of range clears the flag at ok_ptr (asserted after the launch) and is never read."""
    lse = row_lse(base, n_cols, BLOCK)
    t = tl.load(t_ptr)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < n_cols)
    tl.store(ok_ptr, in_range.to(tl.int32), mask=valid & ~in_range)  # 0 where stored
    x_t = tl.load(base + tl.where(valid & in_range, t, 0)).to(tl.float32)
    tl.store(loss_ptr, tl.where(valid, lse - x_t, 0.0))
    return lse, t, valid


@triton.jit
def row_grad(base, out, t, lse, scale, n_cols, BLOCK: tl.constexpr):
    """(softmax - one_hot(t)) * scale of one row, written to `out` (may be the row itself)."""
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)
        tl.store(out + cols, (g * scale).to(out.dtype.element_ty), mask=mask)


@triton.jit
def ce_fwd_kernel(L, T, LSE, LOSS, OK, stride_l, n_cols, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse, t, valid = row_loss(L + row * stride_l, T + row, LOSS + row, OK, n_cols, ignore_index, BLOCK)
    tl.store(LSE + row, lse)


@triton.jit
def ce_bwd_kernel(
    L, T, LSE, DL, DLOSS, NVALID, stride_l, stride_dl, n_cols, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row)
    scale = tl.load(DLOSS).to(tl.float32) / tl.maximum(tl.load(NVALID).to(tl.float32), 1.0)
    scale = tl.where(t != ignore_index, scale, 0.0)
    row_grad(L + row * stride_l, DL + row * stride_dl, t, tl.load(LSE + row), scale, n_cols, BLOCK)


@triton.jit
def ce_mean_kernel(LOSS, T, MEAN, NVALID, n_rows, ignore_index, BLOCK: tl.constexpr):
    """One program: the mean of the rows' losses over the rows not ignored (0/0 = nan with none,
    as torch), written in MEAN's dtype, and their count."""
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < n_rows
        total += tl.load(LOSS + rows, mask=mask, other=0.0)
        count += (tl.load(T + rows, mask=mask, other=ignore_index) != ignore_index).to(tl.int32)
    n = tl.sum(count, axis=0)
    tl.store(MEAN, (tl.sum(total, axis=0) / n.to(tl.float32)).to(MEAN.dtype.element_ty))
    tl.store(NVALID, n.to(NVALID.dtype.element_ty))


@triton.jit
def ce_loss_grad_kernel(L, T, LOSS, NVALID, OK, stride_l, n_cols, ignore_index, BLOCK: tl.constexpr):
    """Both at once, for a row no one else needs: its loss, then its gradient (for an upstream
    gradient of 1) over the row itself -- the second read while the row is still in L2."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    lse, t, valid = row_loss(base, T + row, LOSS + row, OK, n_cols, ignore_index, BLOCK)
    scale = tl.where(valid, 1.0 / tl.maximum(tl.load(NVALID).to(tl.float32), 1.0), 0.0)
    row_grad(base, base, t, lse, scale, n_cols, BLOCK)


_OK: dict = {}  # per device: 1 until a kernel saw a target out of range (then the context is lost)


def check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """Torch's refusal of a target outside [0, n_classes) that is not ignore_index. On the CPU:
    IndexError with torch's message, now. On a GPU, as torch's own kernel does, a device-side
    assert without a sync: the kernels clear the flag returned here, `assert_targets` checks it."""
    if target.device.type == "cpu":
        bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
        if bool(bad.any()):
            raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")
    ok = _OK.get(target.device)
    if ok is None:
        ok = _OK[target.device] = torch.ones((), dtype=torch.int32, device=target.device)
    return ok


def assert_targets(ok: torch.Tensor) -> None:
    if ok.is_cuda:
        torch._assert_async(ok, "cross entropy: a target is out of bounds")


def forward_parts(logits, target, ignore_index: int, out_dtype: torch.dtype = torch.float32):
    """(mean loss in out_dtype, each row's log-sum-exp, the number of rows counted) of (N, C)
    logits: two launches, the rows' losses and their mean."""
    m, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    ok = check_targets(target, v, ignore_index)
    lse = logits.new_empty(m, dtype=torch.float32)
    loss = logits.new_empty(m, dtype=torch.float32)
    mean = logits.new_empty((), dtype=out_dtype)
    n_valid = target.new_empty(())
    if m:
        launch(
            ce_fwd_kernel,
            (m,),
            logits,
            target,
            lse,
            loss,
            ok,
            logits.stride(0),
            v,
            ignore_index,
            BLOCK=min(BLOCK, next_pow2(v)),
            num_warps=WARPS,
        )
        assert_targets(ok)
    launch(ce_mean_kernel, (1,), loss, target, mean, n_valid, m, ignore_index, BLOCK=MEAN_BLOCK)
    return mean, lse, n_valid


def backward_parts(logits, target, lse, n_valid, dloss, ignore_index: int) -> torch.Tensor:
    """d(mean loss)/d(logits) scaled by dloss, in the logits' dtype."""
    m, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    dlogits = logits.new_empty((m, v))
    if m:
        launch(
            ce_bwd_kernel,
            (m,),
            logits,
            target,
            lse,
            dlogits,
            dloss.contiguous(),
            n_valid,
            logits.stride(0),
            dlogits.stride(0),
            v,
            ignore_index,
            BLOCK=min(BLOCK, next_pow2(v)),
            num_warps=WARPS,
        )
    return dlogits


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, out_dtype=torch.float32):
        loss, lse, n_valid = forward_parts(logits, target, ignore_index, out_dtype)
        ctx.save_for_backward(logits, target, lse, n_valid)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse, n_valid = ctx.saved_tensors
        return backward_parts(logits, target, lse, n_valid, dloss, ctx.ignore_index), None, None, None


_PLANS: dict = {}  # (shape, row stride, dtype, ignore_index, loss dtype, device) -> the C++ plan, or None


def _row_stride(logits) -> int:
    """The row stride the C++ Function launches with: the logits' own where their rows are of
    unit stride and 16-byte aligned (else it copies them, as native.cpp's rows_of)."""
    if logits.stride(1) == 1 and logits.data_ptr() % 16 == 0:
        return logits.stride(0)
    return logits.shape[1]


def _make_plan(logits, ignore_index: int, out_dtype: torch.dtype, stride: int):
    """The three kernels compiled for this shape, row stride, ignore_index and loss dtype and
    handed to native.cpp; None where the C++ Function cannot run them (native.why_not says why)."""
    ext = native.extension("cross_entropy")
    m, v = logits.shape
    if ext is None or m == 0:
        return None

    def t(dtype):  # warmup compiles for a tensor's dtype and alignment: a small aligned one does
        return torch.empty(16, dtype=dtype, device=logits.device)

    lg, i64, f32, i32, out = t(logits.dtype), t(torch.int64), t(torch.float32), t(torch.int32), t(out_dtype)
    block = min(BLOCK, next_pow2(v))
    fwd = native.add_kernel(
        ext,
        ce_fwd_kernel,
        (m,),
        lg,
        i64,
        f32,
        f32,
        i32,
        stride,
        v,
        ignore_index,
        BLOCK=block,
        num_warps=WARPS,
    )
    mean = native.add_kernel(ext, ce_mean_kernel, (1,), f32, i64, out, i64, m, ignore_index, BLOCK=MEAN_BLOCK)
    bwd = native.add_kernel(
        ext,
        ce_bwd_kernel,
        (m,),
        lg,
        i64,
        f32,
        lg,
        out,
        i64,
        stride,
        v,
        v,
        ignore_index,
        BLOCK=block,
        num_warps=WARPS,
    )
    return native.plan_of("cross_entropy", ext, (fwd, mean, bwd))


def fused_cross_entropy(logits, target, ignore_index: int, out_dtype: torch.dtype):
    """The mean loss in out_dtype (float32 or the logits' dtype), through autograd where the
    logits want a gradient (the C++ Function where it runs, else the Python one), else the
    forward alone."""
    if needs_grad(logits):
        if logits.is_cuda and out_dtype in (torch.float32, logits.dtype):
            dev = logits.get_device()
            stride = _row_stride(logits)
            key = (logits.shape, stride, logits.dtype, ignore_index, out_dtype, dev)
            plan = native.plan_for(
                _PLANS, key, lambda: _make_plan(logits, ignore_index, out_dtype, stride), logits.device
            )
            if plan is not None:
                ok = check_targets(target, logits.shape[1], ignore_index)
                stream = torch._C._cuda_getCurrentRawStream(dev)
                return native.extension("cross_entropy").cross_entropy(
                    logits, target, ok, ignore_index, out_dtype == torch.float32, plan, stream
                )
        return CrossEntropyFunction.apply(logits, target, ignore_index, out_dtype)
    return forward_parts(logits, target, ignore_index, out_dtype)[0]


def supported(logits: torch.Tensor, target: torch.Tensor, **kwargs) -> str | None:
    """None if the kernels take this call, else why not."""
    if logits.ndim != 2 or target.ndim != 1 or target.shape[0] != logits.shape[0]:
        return (
            f"logits of shape {tuple(logits.shape)} with targets {tuple(target.shape)} (need (N, C) and (N,))"
        )
    if target.dtype != torch.int64:
        return f"targets of dtype {target.dtype} (class indices in int64 only)"
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"logits of dtype {logits.dtype} (the kernels compute in float32)"
    for k, default in (("weight", None), ("label_smoothing", 0.0), ("reduction", "mean")):
        if kwargs.get(k, default) != default:
            return f"{k}={kwargs[k]!r}"
    return None


def cross_entropy(logits, target, ignore_index: int = -100):
    check_tensor("logits", logits, ndim=2)
    why = supported(logits, target)
    if why:
        raise ValueError(f"logits, target: the fused cross entropy does not take {why}")
    return fused_cross_entropy(logits, target, ignore_index, logits.dtype)
