"""RoPE in Triton: one kernel rotates each pair of a row by its position's angle, the angles read
from the (T, D/2) cos and sin tables; the backward is the same kernel rotating the gradient back
(the angle negated). The math in fp32, x's dtype in and out."""

from __future__ import annotations

import math
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
    HEADS,
    HALF,
    SIGN: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < HALF)
    at = ((r // HEADS) % T) * HALF + c
    cs = tl.load(COS + at, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + at, mask=mask, other=0.0).to(tl.float32) * SIGN
    if INTERLEAVED:  # the row read whole, its neighbours split apart in registers
        w = tl.arange(0, 2 * BLOCK)[None, :]
        wmask = (r < rows) & (w < 2 * HALF)
        xy = tl.load(X + r * (2 * HALF) + w, mask=wmask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(xy, (ROWS, BLOCK, 2)))
        y = tl.reshape(tl.join(x1 * cs - x2 * sn, x1 * sn + x2 * cs), (ROWS, 2 * BLOCK))
        tl.store(Y + r * (2 * HALF) + w, y.to(Y.dtype.element_ty), mask=wmask)
    else:
        row = X + r * (2 * HALF)
        x1 = tl.load(row + c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + c + HALF, mask=mask, other=0.0).to(tl.float32)
        out = Y + r * (2 * HALF)
        tl.store(out + c, (x1 * cs - x2 * sn).to(Y.dtype.element_ty), mask=mask)
        tl.store(out + c + HALF, (x1 * sn + x2 * cs).to(Y.dtype.element_ty), mask=mask)


def rotate(x, cos, sin, interleaved: bool, sign: float = 1.0, heads: int = 1, out_dtype=None) -> torch.Tensor:
    """x (contiguous, (..., T, heads..., D): `heads` rows a position) with each pair rotated by
    sign times its angle, written in out_dtype (x's by default)."""
    y = torch.empty_like(x, dtype=out_dtype)
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
            cos.shape[0],
            heads,
            half,
            SIGN=sign,
            INTERLEAVED=interleaved,
            ROWS=per,
            BLOCK=block,
            num_warps=TUNED["num_warps"],
        )
    return y


def _table_grads(x, dy, cos, interleaved: bool, position_dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of cos and sin (where a model learns its angles, or a check asks): each
    pair's products summed over everything but the position and the frequency."""
    h = x.shape[-1] // 2
    xf, df = x.float(), dy.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :h], xf[..., h:])
    d1, d2 = (df[..., 0::2], df[..., 1::2]) if interleaved else (df[..., :h], df[..., h:])
    t = x.shape[position_dim]

    def per_position(v):
        return v.movedim(position_dim, -2).reshape(-1, t, h).sum(0)

    dcos, dsin = per_position(d1 * x1 + d2 * x2), per_position(d2 * x1 - d1 * x2)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, position_dim=-2, out_dtype=None):
        tables = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(cos, sin, *((x,) if tables else ()))
        heads = math.prod(x.shape[position_dim + 1 : -1])
        ctx.interleaved, ctx.heads, ctx.position_dim, ctx.x_dtype = interleaved, heads, position_dim, x.dtype
        return rotate(x, cos, sin, interleaved, heads=heads, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dy):
        cos, sin, *x = ctx.saved_tensors
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = rotate(dy, cos, sin, ctx.interleaved, sign=-1.0, heads=ctx.heads, out_dtype=ctx.x_dtype)
        dcos = dsin = None
        if x:
            dcos, dsin = _table_grads(x[0], dy, cos, ctx.interleaved, ctx.position_dim)
        return dx, dcos, dsin, None, None, None


def rope(x, cos, sin, interleaved: bool = False, *, position_dim: int = -2, out_dtype=None):
    """x with each pair of its last dim rotated by its position's angle; the positions on
    `position_dim` ((B, H, T, D): -2, the default; (B, T, H, D): -3); written in out_dtype (x's
    by default: fp32 where the code it replaces promotes to the tables' fp32)."""
    validate(x, cos, sin, interleaved, position_dim)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    if needs_grad(x, cos, sin):
        return RopeFunction.apply(x, cos, sin, interleaved, position_dim, out_dtype)
    heads = math.prod(x.shape[position_dim + 1 : -1])
    return rotate(x, cos, sin, interleaved, heads=heads, out_dtype=out_dtype)
