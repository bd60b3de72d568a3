"""RoPE in Triton: one kernel rotates each pair of a row by its position's angle, the angles read
from the (T, D/2) cos and sin tables; the backward is the same kernel rotating the gradient back
(the angle negated). The math in fp32, x's dtype in and out."""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops.base import cdiv, needs_grad
from perfloop.ops.launch import launch
from perfloop.ops.rope import validate
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)  # elements a program, warps (tuned.json)


@triton.jit
def rope_kernel(
    X,
    COS,
    SIN,
    Y,
    rows,
    T,
    HALF,
    SIGN: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < HALF)
    if INTERLEAVED:
        i1, i2 = 2 * c, 2 * c + 1
    else:
        i1, i2 = c, c + HALF
    row = X + r * (2 * HALF)
    x1 = tl.load(row + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + i2, mask=mask, other=0.0).to(tl.float32)
    at = (r % T) * HALF + c
    cs = tl.load(COS + at, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + at, mask=mask, other=0.0).to(tl.float32) * SIGN
    out = Y + r * (2 * HALF)
    tl.store(out + i1, (x1 * cs - x2 * sn).to(Y.dtype.element_ty), mask=mask)
    tl.store(out + i2, (x1 * sn + x2 * cs).to(Y.dtype.element_ty), mask=mask)


def rotate(x, cos, sin, interleaved: bool, sign: float = 1.0) -> torch.Tensor:
    """x (contiguous, (..., T, D)) with each pair rotated by sign times its angle."""
    y = torch.empty_like(x)
    half = x.shape[-1] // 2
    rows = x.numel() // (2 * half) if half else 0
    if rows:
        block = triton.next_power_of_2(half)
        per = max(1, min(TUNED["rows_max"], TUNED["elements"] // block))
        launch(
            rope_kernel,
            (cdiv(rows, per),),
            x,
            cos,
            sin,
            y,
            rows,
            x.shape[-2],
            half,
            SIGN=sign,
            INTERLEAVED=interleaved,
            ROWS=per,
            BLOCK=block,
            num_warps=TUNED["num_warps"],
        )
    return y


def _table_grads(x, dy, cos, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of cos and sin (where a model learns its angles): each pair's products
    summed over everything but the position and the frequency."""
    h = x.shape[-1] // 2
    xf, df = x.float(), dy.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :h], xf[..., h:])
    d1, d2 = (df[..., 0::2], df[..., 1::2]) if interleaved else (df[..., :h], df[..., h:])
    lead = tuple(range(x.dim() - 2))
    dcos, dsin = (d1 * x1 + d2 * x2).sum(lead), (d2 * x1 - d1 * x2).sum(lead)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        tables = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(cos, sin, *((x,) if tables else ()))
        ctx.interleaved = interleaved
        return rotate(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dy):
        cos, sin, *x = ctx.saved_tensors
        dy = dy.contiguous()
        dx = rotate(dy, cos, sin, ctx.interleaved, sign=-1.0) if ctx.needs_input_grad[0] else None
        dcos = dsin = None
        if x:
            dcos, dsin = _table_grads(x[0], dy, cos, ctx.interleaved)
        return dx, dcos, dsin, None


def rope(x, cos, sin, interleaved: bool = False):
    validate(x, cos, sin, interleaved)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    if needs_grad(x, cos, sin):
        return RopeFunction.apply(x, cos, sin, interleaved)
    return rotate(x, cos, sin, interleaved)
