"""Softmax over the last dim: y = exp(x - max) / sum(exp(x - max)).

Napkin math: the fewest bytes are one read and one write of x. The naive
version (max, sub, exp, sum, div) reads x 4 times, writes 3 intermediates and
the output: ~7-8 passes. A row that fits in one block needs one pass (read once,
write once); a row too long for one block needs a second read (online softmax:
running max and sum in pass 1, normalize in pass 2) -- or a split of the row
across programs that share their chunks' stats (one read, see triton_impl).
"""

from __future__ import annotations

import math

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.detach().to("cpu", torch.float64), dim=-1)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    g = seeded(device, seed)
    x = torch.randn(shape, generator=g, device=device) * 4
    # Row offsets up to +-100: exp() of these overflows fp32 (e^88.7), so a softmax
    # that skips the max subtraction fails here, as it would on real logits.
    offset = (torch.rand((*shape[:-1], 1), generator=g, device=device) - 0.5) * 200
    return ((x + offset).to(dtype),)


def work(shape, dtype) -> Work:
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=2 * n * size, flops=5 * n, dtype=str(dtype))


def validate(x):
    check_tensor("x", x)


OP = Op(
    name="softmax",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    # columns: 1, primes, non-powers of two, one past a block; one row longer
    # than the one-block kernel's limit exercises the long-row (split) path
    test_shapes=[(1, 1), (3, 7), (5, 1000), (2, 1025), (17, 97), (3, 4, 129), (2, 20011)],
    bench_shape_gpu=(16384, 4096),
    bench_shape_cpu=(2048, 1024),
    tolerances={
        torch.float32: (1e-6, 1e-5),
        torch.float16: (1e-5, 4e-3),
        torch.bfloat16: (1e-5, 3e-2),
    },
    out_shape=lambda shape: shape,
    validate=validate,
)

OP.add(
    Variant(
        "naive",
        loader="perfloop.ops.softmax.torch_impl:naive",
        doc="max, sub, exp, sum, div as separate ops",
    )
)
OP.add(Variant("builtin", loader="perfloop.ops.softmax.torch_impl:builtin", doc="torch.softmax"))
OP.add(Variant("compiled", loader="perfloop.ops.softmax.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.softmax.triton_impl:softmax",
        needs=("triton",),
        doc="one row per program, the whole row in registers (long rows: split)",
    )
)
OP.add(
    Variant(
        "triton_online",
        loader="perfloop.ops.softmax.triton_impl:softmax_online",
        needs=("triton",),
        doc="rows of any length: online max/sum pass, then a normalize pass (2 reads)",
    )
)
OP.add(
    Variant(
        "triton_split",
        loader="perfloop.ops.softmax.triton_impl:softmax_split",
        needs=("triton",),
        doc="long rows in one read: chunks held in registers by programs that share row stats",
    )
)
