"""GELU, tanh form: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

Napkin math: one read and one write per element, ~10 flops -- memory-bound on any GPU (backward: x
and dy read, dx written). 16384^2 fp32 moves 2 x 1.07 GB; at the H200's ~4.2 TB/s copy rate that is
~0.51 ms. The naive version makes 8 passes (6 distinct kernels, 8 launches), each reading and
writing the whole tensor: ~8x the bytes, so fusing should give ~8x. Variants: naive -> builtin ->
compiled -> triton -> cuda.
"""

from __future__ import annotations

import math

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def reference(x: torch.Tensor) -> torch.Tensor:
    x = x.to("cpu", torch.float64)
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    # N(0, 2): covers the curved region and both tails; never zeros.
    x = torch.randn(shape, generator=seeded(device, seed), device=device, dtype=torch.float32) * 2
    return (x.to(dtype),)


def work(shape, dtype) -> Work:
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=2 * n * size, flops=10 * n, dtype=str(dtype))


def validate(x):
    check_tensor("x", x)


OP = Op(
    name="gelu",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    # 1, primes, odd sizes, non-multiples of every block size (1024/2048/256x4)
    test_shapes=[(1,), (7,), (1023,), (1025,), (3, 331), (5, 7, 97), (4099,)],
    bench_shape_gpu=(16384, 16384),
    bench_shape_cpu=(2048, 2048),
    tolerances={
        torch.float32: (1e-5, 1e-5),
        torch.float16: (2e-3, 4e-3),
        torch.bfloat16: (1.6e-2, 3e-2),
    },
    # 16-bit gradients 1.5x the forward's atol: the naive variant's backward (eight ops' autograd in
    # the input dtype) misses by up to 1.1x the forward's allowance where tanh saturates (3000
    # seeds; torch's F.gelu 0.07x), which failed the contract test in 1 run of 100
    grad_tolerances={
        torch.float32: (1e-5, 1e-5),
        torch.float16: (3e-3, 4e-3),
        torch.bfloat16: (2.4e-2, 3e-2),
    },
    out_shape=lambda shape: shape,
    validate=validate,
)

OP.add(
    Variant(
        "naive",
        loader="perfloop.ops.gelu.torch_impl:naive",
        doc="the formula in separate PyTorch ops (8 launches)",
        # its autograd in fp16 cancels where the slope crosses 0 (x near -0.75): up to 1.25x
        # the op's gradient line over 2000 seeds
        grad_tolerances={torch.float16: (6e-3, 4e-3), torch.bfloat16: (4.8e-2, 3e-2)},
    )
)
OP.add(Variant("builtin", loader="perfloop.ops.gelu.torch_impl:builtin", doc='F.gelu(approximate="tanh")'))
OP.add(
    Variant(
        "compiled",
        loader="perfloop.ops.gelu.torch_impl:compiled",
        doc="torch.compile(naive): one fused kernel",
    )
)
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.gelu.triton_impl:gelu",
        needs=("triton",),
        doc="one element per lane, fp32 math, 16-byte accesses; backward one kernel too",
    )
)
OP.add(
    Variant(
        "cuda",
        loader="perfloop.ops.gelu.cuda_impl:gelu",
        needs=("cuda", "nvcc"),
        backward=False,
        doc="CUDA C++: 16-byte vector loads, fp32 math, exp-based tanh (forward only)",
    )
)
