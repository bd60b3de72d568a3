"""Triton matmul + ReLU: under TF32 the B operand reaches the kernel K-major."""

import pytest
import torch

import perfloop as pl
from helpers import tf32_matmuls


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
def test_tf32_matmul_reads_b_k_major(tf32, monkeypatch):
    """With TF32 on, the Triton matmul gets B K-major (a copy: wgmma's 32-bit operands are
    K-major only); exact fp32 keeps the caller's B. Both give the right answer."""
    pytest.importorskip("triton")
    from perfloop.ops.matmul_relu import triton_impl

    seen = []
    kernel = triton_impl.matmul_relu_kernel
    spy = type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **kw: seen.append(a[8:10])
                           or kernel[grid](*a, **kw)})()  # fmt: skip
    monkeypatch.setattr(triton_impl, "matmul_relu_kernel", spy)
    op = pl.ops.get("matmul_relu")
    a, b = op.make_inputs((40, 24, 56), seed=8)  # M, N, K: b is (56, 24), row-major
    with tf32_matmuls(tf32):
        y = triton_impl.matmul_relu(a, b)
    assert seen == [(1, 56) if tf32 else (24, 1)]  # (stride_bk, stride_bn) at launch
    torch.testing.assert_close(y.double(), op.reference(a, b), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (300, 520, 260), (1, 777, 33)])
def test_tf32_tiles_on_the_gpu_stay_within_tf32s_error(shape):
    """The TF32 tile list (its own, K steps of 32) checked against fp64 at tile-sized and ragged
    shapes, with TF32 allowed as a user turns it on."""
    from perfloop.ops.matmul_relu import triton_impl

    op = pl.ops.get("matmul_relu")
    a, b = op.make_inputs(shape, device="cuda", seed=3)
    with tf32_matmuls(True):
        y = triton_impl.matmul_relu(a, b)
    atol, rtol = op.tolerance(torch.float32, shape)
    torch.testing.assert_close(y.double().cpu(), op.reference(a, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (67, 130), (64, 64), (3, 200)])
def test_the_tiled_transpose_gives_b_k_major_and_unchanged(shape):
    """k_major: the same matrix, its K dim contiguous, for ragged and tile-sized shapes and for a
    strided view; a B already K-major comes back as it is."""
    pytest.importorskip("triton")
    from perfloop.ops.matmul_relu import triton_impl

    g = torch.Generator().manual_seed(sum(shape))
    b = torch.randn(shape, generator=g)
    y = triton_impl.k_major(b, block=32)
    assert torch.equal(y, b) and (y.stride(0) == 1 or shape[0] == 1)
    view = torch.randn(shape[0], shape[1] + 3, generator=g)[:, 1:-2]  # rows strided past its width
    assert torch.equal(triton_impl.k_major(view, block=32), view)
    assert triton_impl.k_major(y) is y
