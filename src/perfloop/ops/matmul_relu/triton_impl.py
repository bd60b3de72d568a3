"""Matmul + ReLU in Triton: tiled, autotuned, grouped tile order, ReLU fused.

fp32 inputs follow torch.backends.cuda.matmul.allow_tf32, as cuBLAS does: TF32
tensor cores when it is on, exact fp32 ("ieee") when off (the default). Under TF32 the
product is taken as its transpose, C^T = B^T A^T (`matmul_relu_tf32_kernel`): Hopper's
wgmma reads a 32-bit operand from shared memory K-major only, and A^T is K-major as A
lies; B^T, whatever its layout, is the first operand and goes through registers (rounded
to TF32 there), which wgmma reads in any layout. No copy of either.

Each program computes a BLOCK_M x BLOCK_N tile of C, walking K in BLOCK_K steps
with tl.dot (tensor cores: wgmma on Hopper). Programs are ordered in groups of
GROUP_M tile-rows so that tiles running at the same time share rows of A and
columns of B in L2. The ReLU is applied to the fp32 accumulator before the one
store: the unfused version's extra read + write of C disappears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from perfloop.ops.base import cdiv, check_tensor, dot_precision, interpreting


@triton.jit
def _grouped_tile(pid, n_rows, n_cols, GROUP: tl.constexpr):
    """(row, column) of program pid's output tile in grouped order: GROUP tile-rows sweep the
    columns together, so tiles running at once share their operands' rows and columns in L2."""
    per_group = GROUP * n_cols
    first = pid // per_group * GROUP
    group_rows = min(n_rows - first, GROUP)
    return first + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def matmul_relu_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr = False, PRECISION: tl.constexpr = "tf32",
):  # fmt: skip
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # interpreter only: its bf16 dot is wrong; bf16 products are exact in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = tl.maximum(acc, 0.0)  # the fused epilogue
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_relu_tf32_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    ROUND: tl.constexpr = True,
):  # fmt: skip
    """relu(A B) in fp32 on TF32 tensor cores, as its transpose: a program's (BLOCK_N, BLOCK_M)
    tile of C^T = B^T A^T. ROUND: B^T rounded to TF32 in registers (cvt.rna), which keeps it the
    dot's register operand (the interpreter has no inline assembly: False there)."""
    pid_n, pid_m = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    bt_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    at_ptrs = a_ptr + offs_k[:, None] * stride_ak + offs_m[None, :] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        bt = tl.load(bt_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        if ROUND:
            bt = tl.inline_asm_elementwise(
                "cvt.rna.tf32.f32 $0, $1;", "=r,f", [bt], dtype=tl.int32, is_pure=True, pack=1
            ).to(tl.float32, bitcast=True)
        at = tl.load(at_ptrs, mask=(offs_k[:, None] < k_left) & (offs_m[None, :] < M), other=0.0)
        acc = tl.dot(bt, at, acc, input_precision="tf32")
        bt_ptrs += BLOCK_K * stride_bk
        at_ptrs += BLOCK_K * stride_ak
    acc = tl.maximum(acc, 0.0)
    c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


def _config(bm, bn, bk, group, stages, warps):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
        num_stages=stages,
        num_warps=warps,
    )


# Candidates for Hopper-class GPUs (large tiles feed wgmma; 3-4 stages of smem).
CONFIGS = [
    _config(128, 256, 64, 8, 3, 8),
    _config(256, 128, 64, 8, 3, 8),
    _config(128, 256, 64, 8, 4, 8),
    _config(128, 128, 64, 8, 4, 4),
    _config(128, 128, 64, 8, 3, 8),
    _config(128, 128, 32, 8, 4, 4),
    _config(64, 128, 64, 8, 4, 4),
    _config(128, 64, 32, 8, 4, 4),
]


def _tf32_config(bn, bm, bk, group, stages, warps):
    return triton.Config(
        {"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "GROUP_N": group}, num_stages=stages, num_warps=warps
    )


# TF32 (C^T's tiles, BLOCK_N x BLOCK_M): a stage of 32-bit operands takes twice a 16-bit one's
# shared memory, so K steps of 32 (benchmarks/tuning/tf32_tune.py --swap, run25)
TF32_CONFIGS = [
    _tf32_config(128, 256, 32, 8, 4, 8),
    _tf32_config(128, 256, 32, 8, 3, 8),
    _tf32_config(128, 128, 32, 8, 4, 4),
]

_tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K"])(matmul_relu_kernel)
_tuned_tf32 = triton.autotune(configs=TF32_CONFIGS, key=["M", "N", "K"])(matmul_relu_tf32_kernel)


def matmul_relu(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a, b: dtypes differ ({a.dtype}, {b.dtype}); cast one")
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device) if out is None else out
    if out.shape != (m, n) or out.dtype != a.dtype:
        raise ValueError(f"out: need a {a.dtype} tensor of shape {(m, n)}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()  # relu(0) = 0
    precision = dot_precision(a.dtype)
    args = (
        a,
        b,
        out,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
    )
    if precision == "tf32" and a.dtype == torch.float32:
        if interpreting():
            grid = (cdiv(n, 32) * cdiv(m, 32),)
            matmul_relu_tf32_kernel[grid](*args, BLOCK_N=32, BLOCK_M=32, BLOCK_K=32, GROUP_N=4, ROUND=False)
        else:
            _tuned_tf32[lambda meta: (cdiv(n, meta["BLOCK_N"]) * cdiv(m, meta["BLOCK_M"]),)](*args)
        return out
    if interpreting():
        # The interpreter is for correctness: one small config, no autotuning.
        grid = (cdiv(m, 32) * cdiv(n, 32),)
        matmul_relu_kernel[grid](
            *args,
            BLOCK_M=32,
            BLOCK_N=32,
            BLOCK_K=32,
            GROUP_M=4,
            UPCAST=a.dtype == torch.bfloat16,
            PRECISION=precision,
        )
    else:

        def grid(meta):
            return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

        _tuned[grid](*args, PRECISION=precision)
    return out
