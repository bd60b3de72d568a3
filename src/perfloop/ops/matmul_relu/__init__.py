"""Matmul + ReLU: C = max(A @ B, 0), A (M, K), B (K, N). Shapes are given as (M, N, K).

Napkin math: 2MNK flops over (MK + KN + MN) x size bytes -- at 8192^3 bf16
that is 1.1 TFLOP over 0.4 GB, intensity ~2700 flop/byte: far past the H200's
ridge point (~200), so compute-bound. Unfused, the ReLU is one more read and
write of C (2 x 134 MB, ~0.06 ms, ~4% of a ~1.4 ms matmul); fused, the ReLU is
free in the epilogue while the tile is still in registers.

fp32: cuBLAS honours torch.backends.cuda.matmul.allow_tf32 (off by default) and
Triton's tl.dot uses TF32 for fp32 inputs; results record which was in force.
"""

from __future__ import annotations

import math

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a.detach().to("cpu", torch.float64) @ b.detach().to("cpu", torch.float64))


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    m, n, k = shape
    g = seeded(device, seed)
    a = torch.randn(m, k, generator=g, device=device)
    b = torch.randn(k, n, generator=g, device=device) / math.sqrt(k)  # C entries ~ N(0, 1)
    return a.to(dtype), b.to(dtype)


def work(shape, dtype) -> Work:
    m, n, k = shape
    size = torch.empty((), dtype=dtype).element_size()
    # fp32 with TF32 allowed runs on tensor cores: its ceiling is the TF32 one.
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return Work(
        bytes=(m * k + k * n + m * n) * size, flops=2 * m * n * k, dtype="tf32" if tf32 else str(dtype)
    )


def validate(a, b):
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a, b: inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}; need a (M, K), b (K, N)"
        )
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"a, b: need one dtype and device, got {a.dtype}/{a.device} and {b.dtype}/{b.device}"
        )


class _MatmulReluOp(Op):
    def tolerance(self, dtype, shape=None):
        k = shape[2] if shape else 1
        # fp32 may run as TF32 on a GPU (10-bit mantissa): error ~ sqrt(K) * 2^-11 for
        # N(0,1) outputs; halves: fp32 accumulate, one rounding of the output.
        if dtype == torch.float32:
            return 4e-3 * math.sqrt(k / 64) + 1e-5, 4e-3
        return 2e-3 * math.sqrt(k / 64) + 2e-3, {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}[dtype]


OP = _MatmulReluOp(
    name="matmul_relu",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    # (M, N, K): ones, primes, non-multiples of every tile (16..256)
    test_shapes=[(1, 1, 1), (17, 33, 65), (127, 129, 63), (5, 300, 17), (70, 3, 200)],
    bench_shape_gpu=(8192, 8192, 8192),
    bench_shape_cpu=(512, 512, 512),
    shape_names=("M", "N", "K"),
    tolerances={},
    out_shape=lambda shape: (shape[0], shape[1]),
    validate=validate,
)

OP.add(
    Variant(
        "naive",
        loader="perfloop.ops.matmul_relu.torch_impl:naive",
        doc="torch.relu(a @ b): cuBLAS, then a ReLU kernel",
    )
)
OP.add(
    Variant(
        "compiled",
        loader="perfloop.ops.matmul_relu.torch_impl:compiled",
        doc="torch.compile(naive)",
    )
)
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.matmul_relu.triton_impl:matmul_relu",
        needs=("triton",),
        doc="tiled, autotuned, grouped order, ReLU in the epilogue",
    )
)
