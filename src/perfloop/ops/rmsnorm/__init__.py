"""RMSNorm over the last dim, forward and backward: y = x / sqrt(mean(x^2) + eps) * w.

Napkin math as LayerNorm's: 2 passes forward, 3 backward; no mean, no bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.ops.base import Op, Variant, check_tensor
from perfloop.ops.layernorm import GRAD_TOLERANCES, TEST_SHAPES, TOLERANCES, work
from perfloop.ops.layernorm import make_inputs as _ln_inputs

EPS = 1e-6


def reference(x, weight):
    x, weight = x.to("cpu", torch.float64), weight.to("cpu", torch.float64)
    return F.rms_norm(x, x.shape[-1:], weight, EPS)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    x, w, _ = _ln_inputs(shape, dtype, device, seed)
    return x, w


def validate(x, weight):
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: need {x.shape[-1]} elements (x's last dim), got {weight.shape[0]}")


OP = Op(
    name="rmsnorm",
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

OP.add(Variant("naive", loader="perfloop.ops.rmsnorm.torch_impl:naive", doc="square, mean, rsqrt, scale"))
OP.add(Variant("builtin", loader="perfloop.ops.rmsnorm.torch_impl:builtin", doc="F.rms_norm"))
OP.add(Variant("compiled", loader="perfloop.ops.rmsnorm.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.rmsnorm.triton_impl:rms_norm",
        needs=("triton",),
        doc="one kernel forward, one backward (LayerNorm's kernels without mean and bias)",
    )
)
