"""SwiGLU, the gated MLP activation of Llama-style models: y = silu(a) * b, forward and backward.

Napkin math: forward reads a and b and writes y (3 passes); backward reads a, b and dy and
writes da and db (5 passes). Eager makes ~4 kernels forward (silu, mul) and ~6 backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from perfloop.harness.measurement import Work
from perfloop.ops.base import (
    ELEMENTWISE_GRAD_TOLERANCES,
    ELEMENTWISE_TOLERANCES,
    Op,
    Variant,
    check_tensor,
    seeded,
)


def reference(a, b):
    a, b = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    return F.silu(a) * b


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    g = seeded(device, seed)
    a = 3 * torch.randn(shape, generator=g, device=device)
    b = torch.randn(shape, generator=g, device=device)
    return a.to(dtype), b.to(dtype)


def work(shape, dtype) -> Work:
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=3 * n * size, flops=6 * n, dtype=str(dtype))


def validate(a, b):
    check_tensor("a", a)
    check_tensor("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a, b: need the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


OP = Op(
    name="swiglu",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    test_shapes=[(1,), (7,), (3, 1000), (2049,), (5, 4, 129)],
    bench_shape_gpu=(8192, 11008),
    bench_shape_cpu=(1024, 4096),
    tolerances=ELEMENTWISE_TOLERANCES,
    grad_tolerances=ELEMENTWISE_GRAD_TOLERANCES,
    out_shape=lambda shape: shape,
    validate=validate,
)

OP.add(Variant("naive", loader="perfloop.ops.swiglu.torch_impl:naive", doc="a * sigmoid(a) * b"))
OP.add(Variant("builtin", loader="perfloop.ops.swiglu.torch_impl:builtin", doc="F.silu(a) * b"))
OP.add(Variant("compiled", loader="perfloop.ops.swiglu.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.swiglu.triton_impl:swiglu",
        needs=("triton",),
        doc="one elementwise kernel forward, one backward (the sigmoid recomputed)",
    )
)
