"""RoPE (issue 40): the fused op against float64 in both pair layouts, against the forms model
code writes (Hugging Face's rotate_half with doubled tables, Meta's complex product), and its
refusals. The Triton kernels run under TRITON_INTERPRET=1 on a CPU."""

import pytest
import torch

import perfloop as pl
from perfloop.ops.rope import angles, reference

OP = pl.ops.get("rope")


def _triton():
    v = OP.variant("triton")
    if v.why_unavailable("cpu"):
        pytest.skip(v.why_unavailable("cpu"))
    return v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 7, 10), (2, 3, 33, 64)])
def test_neighbouring_pairs_forward_and_backward_match_float64(shape, dtype):
    rope = _triton()
    x, cos, sin = OP.make_inputs(shape, dtype=dtype, seed=11)
    x, cos, sin = (t.clone().requires_grad_() for t in (x, cos, sin))
    y = rope(x, cos, sin, interleaved=True)
    ref_in = [t.detach().double().requires_grad_() for t in (x, cos, sin)]
    ref = reference(*ref_in, interleaved=True)
    atol, rtol = OP.tolerances[dtype]
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)
    dy = torch.randn(shape, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, cos, sin), dy.to(dtype))
    want = torch.autograd.grad(ref, ref_in, dy)
    gatol, grtol = OP.grad_tolerances[dtype]
    for name, g, w in zip(("x", "cos", "sin"), got, want, strict=True):
        scale = w.abs().max().item() or 1.0
        torch.testing.assert_close(g.double(), w, atol=gatol * scale, rtol=grtol, msg=name)


def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def test_it_computes_what_hugging_faces_llama_and_metas_llama_write_out():
    rope = _triton()
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16)
    cos, sin = angles(9, 16)
    # Hugging Face: the tables doubled to D, q * cos + rotate_half(q) * sin
    emb_cos, emb_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    hf = q * emb_cos + _hf_rotate_half(q) * emb_sin
    torch.testing.assert_close(rope(q, cos, sin), hf, atol=1e-5, rtol=1e-5)
    # Meta: pairs as complex numbers times freqs_cis = polar(1, angle)
    freqs_cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    meta = torch.view_as_real(torch.view_as_complex(q.reshape(2, 4, 9, 8, 2)) * freqs_cis).flatten(-2)
    torch.testing.assert_close(rope(q, cos, sin, interleaved=True), meta, atol=1e-5, rtol=1e-5)


def test_tables_that_need_no_gradient_get_none_and_x_is_not_kept():
    rope = _triton()
    x, cos, sin = OP.make_inputs((1, 2, 5, 8), seed=3)
    x.requires_grad_()
    y = rope(x, cos, sin)
    assert len(y.grad_fn.saved_tensors) == 2  # cos and sin only: x is needed for the tables' gradients
    (dx,) = torch.autograd.grad(y, (x,), torch.ones_like(y))
    # rotating back by the angle: the gradient of a rotation is its inverse
    torch.testing.assert_close(dx, rope(torch.ones_like(y), cos, -sin), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "args, said",
    [
        ((torch.randn(1, 2, 3, 5), *angles(3, 4)), "x: needs .* D even"),
        ((torch.randn(1, 2, 3, 8), *angles(4, 8)), r"cos: needs \(T, D/2\) = \(3, 4\)"),
    ],
)
def test_bad_shapes_are_refused_naming_the_argument(args, said):
    rope = _triton()
    with pytest.raises(ValueError, match=said):
        rope(*args)
    with pytest.raises(ValueError, match="interleaved: "):
        rope(torch.randn(1, 1, 3, 8), *angles(3, 8), interleaved="yes")


@pytest.mark.parametrize("interleaved", [True, False])
def test_positions_before_the_heads_and_an_fp32_output_from_bf16(interleaved):
    """x as (B, T, H, D) (Meta's Llama rotates before the heads move forward): position_dim=-3
    gives the rotation of the transposed layout, and out_dtype=fp32 writes what x * fp32 tables
    promote to; the gradient comes back in x's dtype."""
    if OP.variant("triton").why_unavailable("cpu"):
        pytest.skip(OP.variant("triton").why_unavailable("cpu"))
    from perfloop.ops.rope.triton_impl import rope

    x = torch.randn(2, 9, 3, 16, generator=torch.Generator().manual_seed(5)).bfloat16().requires_grad_()
    cos, sin = angles(9, 16)
    y = rope(x, cos, sin, interleaved, position_dim=-3, out_dtype=torch.float32)
    want = reference(x.detach().transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6))
    y.backward(dy)
    back = reference(dy.transpose(1, 2), cos, -sin, interleaved).transpose(1, 2)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), back, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="position_dim"):
        rope(x, cos, sin, interleaved, position_dim=-1)
