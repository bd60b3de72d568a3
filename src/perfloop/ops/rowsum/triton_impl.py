"""Row sum in Triton: one program per row, the row walked in tiles.

Each lane keeps a fp32 partial sum across tiles and the block reduces once at
the end: one read of x, no atomics. BLOCK = 4096 fp32 at 8 warps is 16
elements (four 16-byte loads) per lane per tile.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops.base import as_rows, check_tensor, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)  # block and warps (tuning.py)


@triton.jit
def rowsum_kernel(x_ptr, y_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + row, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty))


def rowsum(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    check_tensor("x", x)
    x2 = as_rows(x)
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape[:-1] or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: need a contiguous {x.dtype} tensor of shape {tuple(x.shape[:-1])}")
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return out
    if n_cols == 0:
        return out.zero_()
    block = min(block or TUNED["block"], next_pow2(n_cols))
    num_warps = num_warps or (TUNED["num_warps"] if block >= 2048 else 4)
    launch(rowsum_kernel, (n_rows,), x2, out, n_cols, x2.stride(0), BLOCK=block, num_warps=num_warps)
    return out
