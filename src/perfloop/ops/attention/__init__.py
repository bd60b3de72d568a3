"""Attention: O = softmax(Q K^T * scale [+ causal mask]) V, scale = 1/sqrt(head_dim).

Inputs q (B, H, Sq, D), k and v (B, H, Sk, D), and `causal` (top-left aligned,
as torch's is_causal: query i sees keys j <= i). Shapes are (B, H, Sq, Sk, D, causal).

Napkin math: forward 4*B*H*Sq*Sk*D flops (two matmuls), halved when causal; the
fewest bytes read q, k, v and write o. At B=4, H=16, S=4096, D=128 in bf16 that is
550 GFLOP over 0.27 GB: intensity ~2000 flop/byte, compute-bound -- if the S x S
scores never touch memory. The naive version writes them (4*16*4096^2*2 B = 2.1 GB
per matrix, several times): memory-bound and O(S^2) in memory. FlashAttention
tiles K/V and keeps a running (online) softmax so the scores stay on chip.
"""

from __future__ import annotations

import math

import torch

from perfloop.harness.measurement import Work
from perfloop.ops.base import Op, Variant, check_tensor, seeded

MAX_HEAD_DIM = 128


def reference(q, k, v, causal=False):
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def reference_lse(q, k, causal=False):
    """log-sum-exp of each row of the scaled (masked) scores, in float64."""
    q, k = (t.detach().to("cpu", torch.float64) for t in (q, k))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def make_inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    b, h, sq, sk, d, causal = shape
    g = seeded(device, seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device=device).to(dtype) for s in (sq, sk, sk))
    return q, k, v, bool(causal)


def work(shape, dtype) -> Work:
    b, h, sq, sk, d, causal = shape
    size = torch.empty((), dtype=dtype).element_size()
    flops = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return Work(bytes=(2 * b * h * sq * d + 2 * b * h * sk * d) * size, flops=flops, dtype=str(dtype))


def validate(q, k, v, causal=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v: need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: need one device, got {q.device}, {k.device}, {v.device}")
    (b, h, _, d), (kb, kh, _, kd) = q.shape, k.shape
    if b != kb or h != kh or d != kd or k.shape != v.shape:
        raise ValueError(
            f"q, k, v: shapes must be q (B, H, Sq, D), k and v (B, H, Sk, D); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {q.shape[-1]} is over the supported maximum of {MAX_HEAD_DIM}")


class _AttentionOp(Op):
    def tolerance(self, dtype, shape=None):
        # fp32 may use TF32 tensor cores when allowed (as cuBLAS does): allow for it.
        return {torch.float32: (2e-3, 2e-3), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]


OP = _AttentionOp(
    name="attention",
    doc=__doc__.splitlines()[0],
    reference=reference,
    make_inputs=make_inputs,
    work=work,
    # (B, H, Sq, Sk, D, causal): seq 1, primes, non-multiples of every tile, Sq != Sk
    test_shapes=[
        (1, 1, 1, 1, 16, False),
        (1, 2, 17, 17, 16, True),
        (2, 1, 100, 100, 40, False),
        (1, 1, 33, 70, 32, True),
        (1, 1, 70, 33, 64, False),
    ],
    bench_shape_gpu=(4, 16, 4096, 4096, 128, False),
    bench_shape_cpu=(1, 2, 256, 256, 64, False),
    shape_names=("B", "H", "Sq", "Sk", "D", "causal"),
    tolerances={},
    out_shape=lambda shape: (shape[0], shape[1], shape[2], shape[4]),
    validate=validate,
)

OP.add(
    Variant(
        "naive",
        loader="perfloop.ops.attention.torch_impl:naive",
        doc="scores materialized (B, H, Sq, Sk), softmax, matmul",
    )
)
OP.add(
    Variant(
        "builtin", loader="perfloop.ops.attention.torch_impl:builtin", doc="F.scaled_dot_product_attention"
    )
)
OP.add(Variant("compiled", loader="perfloop.ops.attention.torch_impl:compiled", doc="torch.compile(naive)"))
OP.add(
    Variant(
        "flash_torch",
        loader="perfloop.ops.attention.torch_impl:flash_torch",
        doc="FlashAttention-2 tiled in plain PyTorch, for reading",
    )
)
OP.add(
    Variant(
        "triton",
        loader="perfloop.ops.attention.triton_impl:attention",
        needs=("triton",),
        doc="FlashAttention-2 in Triton: online softmax, LSE saved, backward in Triton",
    )
)
