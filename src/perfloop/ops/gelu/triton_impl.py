"""GELU in Triton: one pass, one read and one write per element.

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

from perfloop.ops.base import check_tensor
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)["triton"]  # [block, warps] per element size (tuning.py)


SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_CUBIC = tl.constexpr(0.044715)  # the tanh approximation's cubic term


@triton.jit
def gelu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
    y = x / (1.0 + tl.exp(-2.0 * u))  # = 0.5 x (1 + tanh(u))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def gelu(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    check_tensor("x", x)
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: need a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    n = x.numel()
    if n == 0:
        return out
    # 8 fp32 or 16 half elements per lane at 4 warps: two 16-byte accesses each.
    tuned_block, tuned_warps = TUNED["fp32" if x.element_size() == 4 else "16bit"]
    block, num_warps = block or tuned_block, num_warps or tuned_warps
    gelu_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=num_warps)
    return out
