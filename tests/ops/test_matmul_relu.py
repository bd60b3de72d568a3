"""Triton matmul + ReLU: under TF32 the B operand reaches the kernel K-major."""

import pytest
import torch

import perfloop as pl
from helpers import tf32_matmuls


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
def test_tf32_matmul_takes_b_as_it_lies_in_the_transposed_product(tf32, monkeypatch):
    """With TF32 on, the product runs as C^T = B^T A^T (B^T through registers: no copy of B;
    before, B was copied K-major on every call); exact fp32 keeps the plain kernel. Both give the
    right answer."""
    pytest.importorskip("triton")
    from perfloop.ops.matmul_relu import triton_impl

    seen = []
    for name in ("matmul_relu_kernel", "matmul_relu_tf32_kernel"):
        kernel = getattr(triton_impl, name)

        def launch(grid, name=name, kernel=kernel):
            return lambda *a, **kw: seen.append((name, a[1].data_ptr(), a[8:10])) or kernel[grid](*a, **kw)

        spy = type("Spy", (), {"__getitem__": lambda self, grid, launch=launch: launch(grid)})()
        monkeypatch.setattr(triton_impl, name, spy)
    op = pl.ops.get("matmul_relu")
    a, b = op.make_inputs((40, 24, 56), seed=8)  # M, N, K: b is (56, 24), row-major
    with tf32_matmuls(tf32):
        y = triton_impl.matmul_relu(a, b)
    kernel = "matmul_relu_tf32_kernel" if tf32 else "matmul_relu_kernel"
    assert seen == [(kernel, b.data_ptr(), (24, 1))]  # b itself, its own (stride_bk, stride_bn)
    torch.testing.assert_close(y.double(), op.reference(a, b), atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_the_tf32_kernel_reads_b_through_registers_and_copies_16_bytes_at_a_time():
    """The TF32 kernel as it launches at 256^3, compiled for the H200: wgmma takes B^T from
    registers and every async copy into shared memory is 16 bytes. Without the rounding in
    registers B^T was a shared-memory operand of the wrong layout, gathered 4 bytes at a time
    (0.38x cuBLAS, run25; this form 0.93x at 4096)."""
    import re

    pytest.importorskip("triton")
    from helpers import sm90_ptx
    from perfloop.analysis.asm import vector_widths
    from perfloop.ops.matmul_relu import triton_impl

    a, b, c = (torch.randn(256, 256) for _ in range(3))
    args = (a, b, c, 256, 256, 256, *a.stride(), *b.stride(), *c.stride())
    cfg = triton_impl.TF32_CONFIGS[0]
    meta = {**cfg.kwargs, "ROUND": True, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    ptx = sm90_ptx(triton_impl.matmul_relu_tf32_kernel, args, meta)
    copies = {k: n for k, n in vector_widths(ptx).items() if k.startswith("cp.async")}
    assert list(copies) == ["cp.async 16B"], copies
    wgmma = re.findall(r"wgmma\.mma_async\S*tf32\S*\s+\{[^}]*\},\s*(\{|%rd)", ptx)
    assert wgmma and set(wgmma) == {"{"}, wgmma  # the first operand a register list, not a descriptor


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
