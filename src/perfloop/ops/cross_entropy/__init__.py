"""Cross entropy from logits, forward and backward: the mean over rows (ignore_index left out)
of logsumexp(row) - row[target].

Napkin math: the loss needs one read of the logits; its gradient one more read and one write
(softmax minus the one-hot, scaled): 3 passes. The usual `F.cross_entropy(logits.float(), t)`
under autocast makes ~8 (the fp32 copy, log-softmax forward and backward, the gradient's copy
back to bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded

IGNORE = -100


def reference(logits, target):
    return F.cross_entropy(logits.to("cpu", torch.float64), target.cpu(), ignore_index=IGNORE)


def make_targets(n: int, v: int, g: torch.Generator, device) -> torch.Tensor:
    """n class indices below v, one in 8 ignored (padding), never all of them."""
    target = torch.randint(0, v, (n,), generator=g, device=device)
    target[torch.rand(n, generator=g, device=device) < 0.125] = IGNORE
    if n and (target == IGNORE).all():
        target[0] = 0
    return target


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    g = seeded(device, seed)
    n, v = shape
    # logits of a trained model's range, with row offsets
    offsets = 20 * torch.rand((n, 1), generator=g, device=device)
    logits = 3 * torch.randn(shape, generator=g, device=device) + offsets
    return logits.to(dtype), make_targets(n, v, g, device)


def work(shape, dtype) -> Work:
    n, v = shape
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=n * v * size, flops=4 * n * v, dtype=str(dtype))


def validate(logits, target):
    check_tensor("logits", logits, ndim=2)
    if not isinstance(target, torch.Tensor) or target.shape != logits.shape[:1]:
        raise ValueError(f"target: need class indices of shape ({logits.shape[0]},)")


OP = Op(
    name="cross_entropy",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    shape_names=("N", "C"),
    test_shapes=[(1, 3), (7, 5), (5, 1000), (3, 4097), (33, 129)],
    bench_shape_gpu=(16384, 50304),
    bench_shape_cpu=(2048, 8192),
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 4e-3), torch.bfloat16: (5e-2, 1e-2)},
    grad_tolerances={torch.float32: (1e-5, 1e-3), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 3e-2)},
    out_shape=lambda shape: (),
    validate=validate,
)

OP.add(
    Variant(
        "naive", loader="perfloop.ops.cross_entropy.torch_impl:naive", doc="F.cross_entropy(logits.float())"
    )
)
OP.add(
    Variant(
        "builtin",
        loader="perfloop.ops.cross_entropy.torch_impl:builtin",
        doc="F.cross_entropy(logits)",
        # torch's CPU kernel sums the rows' bf16 losses in bf16: up to 1.7% off at 33 rows
        # (3000 seeds), 1.14x the op's line
        tolerances={torch.bfloat16: (5e-2, 3e-2)},
    )
)
OP.add(
    Variant("compiled", loader="perfloop.ops.cross_entropy.torch_impl:compiled", doc="torch.compile(naive)")
)
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.cross_entropy.triton_impl:cross_entropy",
        needs=("triton",),
        doc="forward: one read (online log-sum-exp); backward: one read, one write of dlogits",
    )
)
