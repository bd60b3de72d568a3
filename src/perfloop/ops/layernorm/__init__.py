"""LayerNorm over the last dim, forward and backward: y = (x - mean) / sqrt(var + eps) * w + b.

Napkin math: forward reads x and writes y (2 passes); backward reads x and dy and writes dx
(3 passes), plus the weight and bias gradients, reduced over the rows. The naive version
(mean, sub, square, mean, rsqrt, mul, mul, add) makes ~8 passes forward and more backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded

EPS = 1e-5
MAX_N = 65536  # a row must fit in one Triton program's registers
# shared with rmsnorm: one column is left out (x - mean is then rounding noise)
# rows of 5, not 3: torch's own fp16 LayerNorm backward on the CPU misses by up to 25% of the
# largest gradient on rows of 3 (0.3% on rows of 5; 300 seeds)
TEST_SHAPES = [(1, 5), (3, 7), (5, 1000), (2, 1025), (17, 97), (3, 4, 129)]
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2)}
GRAD_TOLERANCES = {torch.float32: (1e-4, 1e-3), torch.float16: (1e-2, 2e-2), torch.bfloat16: (5e-2, 8e-2)}


def reference(x, weight, bias):
    """float64, differentiable (check() compares the gradients too)."""
    x, weight, bias = (t.to("cpu", torch.float64) for t in (x, weight, bias))
    return F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    g = seeded(device, seed)
    n = shape[-1]
    # rows with their own offset and scale, as activations have; weights away from 1 and 0. Each
    # row's spread is set exactly (standardized, then scaled 1-4x) and its offset kept within 10:
    # an offset of 20 row deviations (a short row's spread is a lottery) made torch's own bf16
    # backward on the CPU miss by 40% -- 1 seed in 400 at rows of 5, a check that failed at random
    z = torch.randn(shape, generator=g, device=device)
    if n > 1:
        z = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True, unbiased=False)
    scale = 1 + 3 * torch.rand((*shape[:-1], 1), generator=g, device=device)
    x = z * scale + 5 * torch.randn((*shape[:-1], 1), generator=g, device=device).clamp(-2, 2)
    w = 1 + 0.5 * torch.randn(n, generator=g, device=device)
    b = 0.5 * torch.randn(n, generator=g, device=device)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def work(shape, dtype) -> Work:
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=2 * n * size, flops=8 * n, dtype=str(dtype))


def validate(x, weight, bias):
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    check_tensor("bias", bias, ndim=1)
    if weight.shape[0] != x.shape[-1] or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight, bias: need {x.shape[-1]} elements each (x's last dim), "
            f"got {weight.shape[0]} and {bias.shape[0]}"
        )


OP = Op(
    name="layernorm",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    test_shapes=TEST_SHAPES,
    bench_shape_gpu=(8192, 4096),
    bench_shape_cpu=(2048, 1024),
    tolerances=TOLERANCES,
    grad_tolerances=GRAD_TOLERANCES,
    out_shape=lambda shape: shape,
    validate=validate,
)

OP.add(Variant("naive", loader="perfloop.ops.layernorm.torch_impl:naive", doc="mean, var, normalize, scale"))
OP.add(Variant("builtin", loader="perfloop.ops.layernorm.torch_impl:builtin", doc="F.layer_norm"))
OP.add(Variant("compiled", loader="perfloop.ops.layernorm.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.layernorm.triton_impl:layer_norm",
        needs=("triton",),
        doc="one kernel forward, one backward (x-hat recomputed, dw/db reduced per band of rows)",
    )
)
