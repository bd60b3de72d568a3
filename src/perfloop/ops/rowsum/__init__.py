"""Row sum: y[i] = sum_j x[i, j], accumulated in fp32 for half inputs.

Napkin math: read x once (rows x cols x size), write one value per row; a
flop per element. 16384^2 fp32 reads 1.07 GB: ~0.26 ms at ~4.2 TB/s. A row
longer than one block is walked in tiles, each lane keeping a partial sum.
"""

from __future__ import annotations

import math

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded


def reference(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64).sum(dim=-1)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    x = torch.randn(shape, generator=seeded(device, seed), device=device) + 0.25
    return (x.to(dtype),)


def work(shape, dtype) -> Work:
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    rows = n // shape[-1] if shape[-1] else 0
    return Work(bytes=(n + rows) * size, flops=n, dtype=str(dtype))


def validate(x):
    check_tensor("x", x)


class _RowSumOp(Op):
    def tolerance(self, dtype, shape=None):
        # fp32 accumulation: error grows with the row length; halves round the result.
        cols = shape[-1] if shape else 1
        atol = 4 * 2**-23 * cols * 4  # |x| ~ 4 at most, fp32 partial sums
        rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        return atol + (1e-3 if dtype != torch.float32 else 0), rtol


OP = _RowSumOp(
    name="rowsum",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    # rows longer than a block (tail tile partial), 1 column, primes
    test_shapes=[(1, 1), (7, 3), (3, 1000), (5, 4099), (2, 10007), (4, 3, 257)],
    bench_shape_gpu=(16384, 16384),
    bench_shape_cpu=(2048, 2048),
    tolerances={},
    out_shape=lambda shape: shape[:-1],
    validate=validate,
    baseline="builtin",
)

OP.add(Variant("builtin", loader="perfloop.ops.rowsum.torch_impl:builtin", doc="x.sum(dim=-1)"))
OP.add(Variant("compiled", loader="perfloop.ops.rowsum.torch_impl:compiled", doc="torch.compile(x.sum(-1))"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.rowsum.triton_impl:rowsum",
        needs=("triton",),
        doc="one program per row, tiles of BLOCK, fp32 partial sums per lane",
    )
)
