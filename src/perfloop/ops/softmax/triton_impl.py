"""Softmax in Triton: a row in one block, and an online version for long rows.

`softmax_row_kernel`: one program per row, the row held in registers -- one
read, one write, the ideal. Works up to MAX_ROW_BLOCK columns.

`softmax_online_kernel`: any row length. Pass 1 streams the row keeping a
running max m and a running sum l of exp(x - m) (rescaled when m grows);
pass 2 writes exp(x - m) / l: 2 reads + 1 write, where torch.softmax's
kernel makes about 4 passes at 1024 x 262144. Pass 2 can walk the row
backwards so the tiles pass 1 read last might still be in L2; measured on the
H200 that buys nothing (0.8095 vs 0.8128 ms forwards, inside the noise), with
about 8 programs per SM in flight either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from perfloop.ops.base import check_tensor

MAX_ROW_BLOCK = 16384  # columns kept in registers by one program (64 KiB of fp32)


@triton.jit
def softmax_row_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    e = tl.exp(z)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_online_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK: tl.constexpr,
    REVERSE: tl.constexpr = True,
):  # fmt: skip
    # Persistent: the grid is sized to the GPU and each program walks rows
    # pid, pid + grid, ... Fewer rows in flight means each row's share of L2 is
    # larger, so more of pass 2's (reversed) reads hit L2 instead of HBM.
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        x_row = x_ptr + row * stride_x
        y_row = y_ptr + row * stride_y
        m = tl.full([BLOCK], -float("inf"), tl.float32)  # per-lane running max
        l = tl.zeros([BLOCK], tl.float32)  # per-lane running sum of exp(x - m)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # lanes that have seen only padding keep m = -inf: guard the inf - inf
            alpha = tl.where(m == -float("inf"), 0.0, tl.exp(m - m_new))
            p = tl.where(mask, tl.exp(x - m_new), 0.0)
            l = l * alpha + p
            m = m_new
        m_row = tl.max(m, axis=0)
        l_row = tl.sum(tl.where(m == -float("inf"), 0.0, l * tl.exp(m - m_row)), axis=0)
        inv = 1.0 / l_row
        n_tiles = tl.cdiv(n_cols, BLOCK)
        for i in range(0, n_tiles):
            tile = (n_tiles - 1 - i) if REVERSE else i  # backwards: the last tiles read may be in L2
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.exp(x - m_row) * inv
            tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _prepare(x: torch.Tensor, out: torch.Tensor | None):
    check_tensor("x", x)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2) if out is None else out
    if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"out: need a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    return x2, y.view(-1, x.shape[-1])


def softmax(
    x: torch.Tensor, out: torch.Tensor | None = None, *, num_warps: int | None = None
) -> torch.Tensor:
    x2, y2 = _prepare(x, out)
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return y2.view(x.shape)
    if n_cols > MAX_ROW_BLOCK:
        return softmax_online(x, out=y2.view(x.shape))
    block = triton.next_power_of_2(n_cols)
    # enough warps that a lane holds <= 16 elements (no spills), at least 4
    warps = num_warps or min(32, max(4, block // (32 * 16)))
    softmax_row_kernel[(n_rows,)](x2, y2, n_cols, x2.stride(0), y2.stride(0), BLOCK=block, num_warps=warps)
    return y2.view(x.shape)


def softmax_online(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int = 4096,
    num_warps: int = 8,
    programs_per_sm: int = 8,
    reverse: bool = True,
) -> torch.Tensor:
    x2, y2 = _prepare(x, out)
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return y2.view(x.shape)
    block = min(block, triton.next_power_of_2(n_cols))
    grid = min(n_rows, _num_sms(x2.device) * programs_per_sm)
    softmax_online_kernel[(grid,)](
        x2, y2, n_rows, n_cols, x2.stride(0), y2.stride(0), BLOCK=block, REVERSE=reverse,
        num_warps=num_warps if block >= 1024 else 4,
    )  # fmt: skip
    return y2.view(x.shape)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so the persistent loop is exercised


def asm_specs(ty: str) -> list[dict]:
    """The launches `perfloop asm` compiles: 4096-column rows, and the online kernel."""
    sig = {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "n_cols": "i32", "stride_x": "i32",
           "stride_y": "i32"}  # fmt: skip
    return [
        {
            "kernel": softmax_row_kernel,
            "signature": sig,
            "constexprs": {"BLOCK": 4096},
            "aligned": [0, 1, 2, 3, 4],
            "num_warps": 8,
            "elements_per_thread": 4096 // 256,
        },
        {
            "kernel": softmax_online_kernel,
            "signature": {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "n_rows": "i32", **{
                k: v for k, v in sig.items() if k not in ("x_ptr", "y_ptr")}},
            "constexprs": {"BLOCK": 4096, "REVERSE": True},
            "aligned": [0, 1, 3, 4, 5],
            "num_warps": 8,
            "elements_per_thread": 4096 // 256,
        },
    ]  # fmt: skip
