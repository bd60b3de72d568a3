"""FlashAttention-2: forward, log-sum-exp and all three gradients against float64."""

import pytest
import torch

import perfloop as pl
from perfloop.ops.attention import reference, reference_lse

triton_impl = pytest.importorskip("perfloop.ops.attention.triton_impl")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (B, H, Sq, Sk, D, causal): seq 1, primes, Sq != Sk, head dims 16 and 40
    (1, 1, 1, 1, 16, False),
    (1, 2, 17, 17, 16, True),
    (1, 1, 33, 70, 40, True),
    (2, 1, 100, 37, 32, False),
]
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


def _ref_grads(q, k, v, causal, g):
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o = _ref_autograd(q64, k64, v64, causal)
    (o * g.double().cpu()).sum().backward()
    return o.detach(), q64.grad, k64.grad, v64.grad


def _ref_autograd(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _close(got, want, tol, what):
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= tol * max(1.0, scale), f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_lse_and_gradients_match_float64(shape, dtype):
    q, k, v, causal = pl.ops.get("attention").make_inputs(shape, dtype=dtype, device=DEV, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = triton_impl.flash_attention(q, k, v, causal)
    g = torch.randn_like(o)
    (o * g).sum().backward()
    o_ref, dq, dk, dv = _ref_grads(q, k, v, causal, g)
    tol = TOL[dtype]
    _close(o.detach(), o_ref, tol, "out")
    _close(lse, reference_lse(q, k, causal), tol, "lse")
    _close(q.grad, dq, 2 * tol, "dq")
    _close(k.grad, dk, 2 * tol, "dk")
    _close(v.grad, dv, 2 * tol, "dv")


def test_non_contiguous_inputs_are_handled():
    q, k, v, _ = pl.ops.get("attention").make_inputs((1, 3, 20, 20, 16, False), device=DEV, seed=1)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, S, H, D) memory order
    assert not qt.is_contiguous()
    o, _ = triton_impl.flash_attention(qt, k, v)
    _close(o, reference(q, k, v), 2e-3, "out")


def test_bad_inputs_are_clear_errors():
    f = triton_impl.flash_attention
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="shapes must be"):
        f(q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32))
    with pytest.raises(ValueError, match="one dtype"):
        f(q, q.half(), q)
    with pytest.raises(ValueError, match="maximum of 128"):
        big = torch.randn(1, 1, 4, 256)
        f(big, big, big)
    with pytest.raises(ValueError, match="expected 4 dims"):
        f(q[0], q[0], q[0])


def test_flash_torch_never_builds_a_seq_by_seq_tensor():
    # the teaching version's largest intermediate is Sq x block_n, not Sq x Sk
    op = pl.ops.get("attention")
    q, k, v, c = op.make_inputs((1, 1, 64, 512, 16, False), seed=3)
    seen = []
    orig = torch.Tensor.__matmul__

    def spy(a, b):
        r = orig(a, b)
        seen.append(tuple(r.shape))
        return r

    torch.Tensor.__matmul__ = spy
    try:
        out = op.variant("flash_torch")(q, k, v, c)
    finally:
        torch.Tensor.__matmul__ = orig
    assert max(s[-1] * s[-2] for s in seen) <= 64 * 64
    _close(out, reference(q, k, v), 2e-5, "flash_torch")
