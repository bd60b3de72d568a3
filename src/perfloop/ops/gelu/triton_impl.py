"""GELU in Triton: one pass, one read and one write per element; the backward one more pass
(read x and dy, write dx), the derivative recomputed from x.

Each program takes BLOCK contiguous elements; with 4 warps a lane holds
BLOCK/128 of them, so fp32 at BLOCK=1024 gives 8 per lane = two 16-byte loads.
Math in fp32 whatever the storage type; tanh via the identity
0.5 x (1 + tanh u) = x / (1 + exp(-2u)) -- one exp, no branchy tanh.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops.base import cdiv, check_tensor, needs_grad
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)["triton"]  # [block, warps] per element size (tuning.py)


SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_CUBIC = tl.constexpr(0.044715)  # the tanh approximation's cubic term


@triton.jit
def gelu_tanh(x):
    """0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), in fp32."""
    u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def gelu_tanh_grad(x):
    """d/dx of gelu_tanh: s + 2 x s (1 - s) du/dx, s = sigmoid(2u) (so 1 + tanh u = 2s)."""
    u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
    s = 1.0 / (1.0 + tl.exp(-2.0 * u))
    return s + 2.0 * x * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x)


INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def gelu_erf(x):
    """The exact form, 0.5 x (1 + erf(x / sqrt 2)), in fp32."""
    return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT_2))


@triton.jit
def gelu_erf_grad(x):
    """d/dx of gelu_erf: Phi(x) + x phi(x)."""
    return 0.5 * (1.0 + tl.math.erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def gelu_kernel(x_ptr, y_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = gelu_erf(x) if EXACT else gelu_tanh(x)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask).to(tl.float32)
    slope = gelu_erf_grad(x) if EXACT else gelu_tanh_grad(x)
    tl.store(dx_ptr + offs, (dy * slope).to(dx_ptr.dtype.element_ty), mask=mask)


def _config(x: torch.Tensor, block: int | None, num_warps: int | None) -> tuple[int, int]:
    # 8 fp32 or 16 half elements per lane at 4 warps: two 16-byte accesses each.
    tuned_block, tuned_warps = TUNED["fp32" if x.element_size() == 4 else "16bit"]
    return block or tuned_block, num_warps or tuned_warps


def _forward(x: torch.Tensor, out: torch.Tensor, block: int | None, num_warps: int | None, exact: bool = False
             ) -> torch.Tensor:  # fmt: skip
    n = x.numel()
    if n:
        block, num_warps = _config(x, block, num_warps)
        launch(gelu_kernel, (cdiv(n, block),), x, out, n, EXACT=exact, BLOCK=block, num_warps=num_warps)
    return out


class GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block, num_warps, exact=False, out_dtype=None):
        ctx.save_for_backward(x)
        ctx.config, ctx.exact = (block, num_warps), exact
        return _forward(x, torch.empty_like(x, dtype=out_dtype), block, num_warps, exact)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        n = x.numel()
        if n:
            block, num_warps = _config(x, *ctx.config)
            launch(
                gelu_bwd_kernel,
                (cdiv(n, block),),
                x,
                dy,
                dx,
                n,
                EXACT=ctx.exact,
                BLOCK=block,
                num_warps=num_warps,
            )
        return dx, None, None, None, None


def gelu(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    approximate: str = "tanh",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """GELU of x: the tanh form (GPT-2's, the default) or approximate="none", the exact erf form;
    written in `out_dtype` (default x's: fp32 from bf16 x where the code it replaces gives fp32)."""
    check_tensor("x", x)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: {approximate!r} is neither 'tanh' nor 'none' (torch's two forms)")
    exact = approximate == "none"
    x = x.contiguous()
    dtype = out_dtype or x.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype: {dtype} is not a float dtype the kernel writes (fp32, fp16, bf16)")
    if out is not None and (out.shape != x.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out: need a contiguous {dtype} tensor of shape {tuple(x.shape)}")
    if needs_grad(x):
        y = GeluFunction.apply(x, block, num_warps, exact, dtype)
        return y if out is None else out.copy_(y)
    return _forward(x, torch.empty_like(x, dtype=dtype) if out is None else out, block, num_warps, exact)
