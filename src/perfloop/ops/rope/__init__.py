"""Rotary position embeddings (RoPE) applied to a query or key tensor, forward and backward:
each pair of x's last dimension rotated by its position's angle, out = (x1 cos - x2 sin,
x1 sin + x2 cos). The pairs are the two halves (`rotate_half`, GPT-NeoX and Llama in Hugging
Face's code) or neighbours (`interleaved=True`: the complex form, `view_as_complex` in Meta's
Llama, GPT-J). cos and sin: (T, D/2), one angle per position and frequency.

Napkin math: forward reads x and writes out (2 passes over x; cos and sin are T x D/2, read
from cache); backward the same on the gradient. Written out in eager, the real form makes ~7
kernels forward (two slices, neg, cat, two muls, add) in x's dtype, more in fp32.
"""

from __future__ import annotations

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import (
    ELEMENTWISE_GRAD_TOLERANCES,
    ELEMENTWISE_TOLERANCES,
    Op,
    Variant,
    check_tensor,
    seeded,
)


def _pairs(x, interleaved: bool):
    h = x.shape[-1] // 2
    return (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :h], x[..., h:])


def _join(a, b, interleaved: bool):
    return torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)


def reference(x, cos, sin, interleaved: bool = False):
    x, cos, sin = (t.to("cpu", torch.float64) for t in (x, cos, sin))
    x1, x2 = _pairs(x, interleaved)
    return _join(x1 * cos - x2 * sin, x1 * sin + x2 * cos, interleaved)


def angles(t: int, d: int, base: float = 10000.0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (t, d/2) in fp32, of the standard frequencies base^(-2i/d)."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    return freqs.cos(), freqs.sin()


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    b, h, t, d = shape
    x = torch.randn(shape, generator=seeded(device, seed), device=device).to(dtype)
    cos, sin = angles(t, d, device=device)
    return x, cos.to(dtype), sin.to(dtype)


def work(shape, dtype) -> Work:
    b, h, t, d = shape
    size = torch.empty((), dtype=dtype).element_size()
    return Work(bytes=(2 * b * h * t * d + t * d) * size, flops=3 * b * h * t * d, dtype=str(dtype))


def validate(x, cos, sin, interleaved: bool = False, position_dim: int = -2):
    check_tensor("x", x)
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x: needs (..., T, D) with D even, got {tuple(x.shape)}")
    if not isinstance(position_dim, int) or not -x.dim() <= position_dim <= -2:
        raise ValueError(
            f"position_dim: a dim before the last of x {tuple(x.shape)}, counted from the end "
            f"(-2 for (B, H, T, D), -3 for (B, T, H, D)); got {position_dim!r}"
        )
    want = (x.shape[position_dim], x.shape[-1] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name}: needs (T, D/2) = {want} for x of {tuple(x.shape)}, got {tuple(t.shape)}"
            )
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved: True (neighbouring pairs) or False (halves), got {interleaved!r}")


OP = Op(
    name="rope",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    test_shapes=[(1, 1, 1, 2), (1, 3, 7, 10), (2, 2, 5, 128), (1, 2, 33, 6), (3, 1, 17, 66)],
    bench_shape_gpu=(4, 32, 4096, 128),
    bench_shape_cpu=(2, 8, 512, 64),
    tolerances=ELEMENTWISE_TOLERANCES,
    grad_tolerances=ELEMENTWISE_GRAD_TOLERANCES,
    out_shape=lambda shape: shape,
    validate=validate,
    shape_names=("B", "H", "T", "D"),
)

OP.add(
    Variant("naive", loader="perfloop.ops.rope.torch_impl:naive", doc="rotate_half written out, x's dtype")
)
OP.add(Variant("fp32", loader="perfloop.ops.rope.torch_impl:fp32", doc="written out in fp32, cast back"))
OP.add(Variant("compiled", loader="perfloop.ops.rope.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.rope.triton_impl:rope",
        needs=("triton",),
        doc="one kernel forward, one backward: fp32 math, x's dtype in and out",
    )
)
