"""Linear + cross entropy, forward and backward: the mean loss of softmax(h @ W^T) at the targets
(ignore_index left out), for a language model's output projection.

Napkin math: the logits (N x V) are the big tensor: GPT-2 small at 16384 tokens holds 1.6 GB of
them in bf16, 3.3 GB in fp32, and as much again for their gradient. Chunked over tokens, only one
chunk of logits lives at a time; the FLOPs stay 3 matmuls' worth (logits, dh, dW).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded
from perfloop.ops.cross_entropy import IGNORE, make_targets


def reference(h, weight, target):
    h, weight = h.to("cpu", torch.float64), weight.to("cpu", torch.float64)
    return F.cross_entropy(h @ weight.t(), target.cpu(), ignore_index=IGNORE)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    """shape: (N tokens, D hidden, V classes)."""
    g = seeded(device, seed)
    n, d, v = shape
    h = torch.randn(n, d, generator=g, device=device)
    w = torch.randn(v, d, generator=g, device=device) * (2 / d**0.5)
    return h.to(dtype), w.to(dtype), make_targets(n, v, g, device)


def work(shape, dtype) -> Work:
    n, d, v = shape
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=(n * d + v * d) * size, flops=2 * n * d * v, dtype=str(dtype))


def validate(h, weight, target):
    check_tensor("h", h, ndim=2)
    check_tensor("weight", weight, ndim=2)


OP = Op(
    name="linear_cross_entropy",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    shape_names=("N", "D", "V"),
    test_shapes=[(1, 3, 5), (7, 16, 33), (37, 24, 1000), (9, 8, 4097)],  # the last: rows of two tiles
    bench_shape_gpu=(16384, 768, 50304),
    bench_shape_cpu=(1024, 256, 8192),
    tolerances={torch.float32: (1e-5, 1e-4), torch.float16: (1e-2, 4e-3), torch.bfloat16: (5e-2, 2e-2)},
    grad_tolerances={torch.float32: (1e-5, 1e-3), torch.float16: (4e-3, 2e-2), torch.bfloat16: (2e-2, 5e-2)},
    out_shape=lambda shape: (),
    validate=validate,
)

OP.add(
    Variant(
        "naive", loader="perfloop.ops.linear_cross_entropy.torch_impl:naive", doc="F.linear, .float(), CE"
    )
)
OP.add(Variant("builtin", loader="perfloop.ops.linear_cross_entropy.torch_impl:builtin", doc="F.linear, CE"))
OP.add(
    Variant(
        "compiled", loader="perfloop.ops.linear_cross_entropy.torch_impl:compiled", doc="torch.compile(naive)"
    )
)
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.linear_cross_entropy.triton_impl:linear_cross_entropy",
        needs=("triton",),
        doc="chunked over tokens: a chunk's logits, loss and gradient in place, then dh and dW",
    )
)
