"""GeGLU, the gated MLP activation of GLU-variant transformers: y = gelu(a) * b (GELU in its tanh
form), forward and backward.

Napkin math: as SwiGLU -- forward reads a and b and writes y (3 passes), backward reads a, b and
dy and writes da and db (5 passes). The Triton kernels are SwiGLU's with the activation switched
(perfloop/ops/swiglu/triton_impl.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.ops.base import Op, Variant
from perfloop.ops.swiglu import OP as SWIGLU
from perfloop.ops.swiglu import make_inputs, validate, work


def reference(a, b):
    a, b = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    return F.gelu(a, approximate="tanh") * b


OP = Op(
    name="geglu",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    test_shapes=SWIGLU.test_shapes,
    bench_shape_gpu=SWIGLU.bench_shape_gpu,
    bench_shape_cpu=SWIGLU.bench_shape_cpu,
    # the naive formula's 1 + tanh(u) cancels for negative a: in 16 bits it loses a few ulps of 1
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 4e-3), torch.bfloat16: (8e-2, 1.6e-2)},
    # the naive variant's slope is 0 where 1 + tanh(u) rounds to 0 (a < -3 or so in bf16): a few
    # hundredths of the largest gradient
    grad_tolerances={
        torch.float32: (1e-5, 1e-4),
        torch.float16: (1e-2, 4e-3),
        torch.bfloat16: (4e-2, 3e-2),
    },
    out_shape=SWIGLU.out_shape,
    validate=validate,
)

OP.add(
    Variant(
        "naive",
        loader="perfloop.ops.geglu.torch_impl:naive",
        doc="the tanh formula in ops, times b",
        # its bf16 gradient reached 0.98 of the op's line over 2000 seeds
        grad_tolerances={torch.bfloat16: (8e-2, 3e-2)},
    )
)
OP.add(Variant("builtin", loader="perfloop.ops.geglu.torch_impl:builtin", doc='F.gelu(a, "tanh") * b'))
OP.add(Variant("compiled", loader="perfloop.ops.geglu.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.swiglu.triton_impl:geglu",
        needs=("triton",),
        doc="one elementwise kernel forward, one backward (the GELU and its slope recomputed)",
    )
)
