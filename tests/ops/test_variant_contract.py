"""Variants keep the contract of the functions they wrap (issue 15, 7, 11)."""

import warnings

import pytest
import torch

import perfloop as pl
from perfloop.ops import CheckFailed
from perfloop.ops.base import Variant, interpreting


def test_variants_take_the_keywords_of_the_functions_they_wrap():
    op = pl.ops.get("attention")
    q, k, v, _ = op.make_inputs((1, 2, 8, 8, 16, True), seed=1)
    out = op.variant("builtin")(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)


def test_check_refuses_an_output_in_another_dtype():
    op = pl.ops.get("gelu")
    op.add(Variant("upcasts", fn=lambda x: torch.nn.functional.gelu(x.double(), approximate="tanh")))
    try:
        with pytest.raises(CheckFailed, match="gives torch.float64"):
            op.check("upcasts", dtypes=[torch.float32], shapes=[(7,)], seeds=1)
    finally:
        del op.variants["upcasts"]


def test_check_refuses_a_variant_that_takes_out_and_ignores_it():
    op = pl.ops.get("gelu")
    ignores = lambda x, out=None: torch.nn.functional.gelu(x, approximate="tanh")
    with pl.ops.temporary_variant(op, "ignores", ignores) as name:
        said = "returned a new tensor where `out=` was given"
        with pytest.raises(CheckFailed, match=said):
            op.check(name, dtypes=[torch.float32], shapes=[(7,)], seeds=1)


@pytest.mark.parametrize("op_name", pl.ops.names())
def test_every_variant_writes_the_out_tensor_it_is_handed(op_name):
    """`out=` was accepted and ignored by 27 functions over seven ops: now each writes it or
    takes no `out` and its Variant copies the result in."""
    op = pl.ops.get(op_name)
    shape = op.test_shapes[0]
    inputs = op.make_inputs(shape, dtype=torch.float32, device="cpu", seed=3)
    for name, v in op.variants.items():
        if v.why_unavailable("cpu"):
            continue
        out = torch.full(op.out_shape(shape), float("nan"))
        got = v(*inputs, out=out)
        assert got is out, name
        torch.testing.assert_close(out, v(*inputs), msg=f"{op_name}/{name}")


def test_availability_is_resolved_once_per_device_not_on_every_call(monkeypatch):
    op = pl.ops.get("gelu")
    v = op.variant("builtin")
    v._ready.clear()
    asked = []
    real = Variant.why_unavailable
    monkeypatch.setattr(Variant, "why_unavailable", lambda self, d="": asked.append(d) or real(self, d))
    x = torch.randn(64)
    for _ in range(5):
        v(x)
    assert asked == ["cpu"]
    monkeypatch.setenv("TRITON_INTERPRET", "0" if interpreting() else "1")
    v(x)  # under another interpreter setting, asked again
    assert len(asked) == 2


def test_a_variant_without_backward_says_so_when_gradients_are_wanted():
    op = pl.ops.get("gelu")
    x = torch.randn(33, requires_grad=True)

    def forward_only(x, out=None):  # as a kernel launched without an autograd Function
        return torch.nn.functional.gelu(x.detach(), approximate="tanh")

    with pl.ops.temporary_variant(op, "forward_only", forward_only) as name:
        with pytest.warns(RuntimeWarning, match="no backward"):
            y = op.variant(name)(x)
        assert y.grad_fn is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            op.variant("builtin")(x)  # has a backward: no word
            with torch.no_grad():
                op.variant(name)(torch.randn(8, requires_grad=True))  # no gradient wanted: no word


@pytest.mark.parametrize(
    "op_name, shape, match",
    [
        ("matmul_relu", (64, 64), "takes 3 sizes"),
        ("attention", (1, 2, 64, 64), "takes 6 sizes"),
        ("gelu", (10**7, 10**7), "GiB"),
    ],
)
def test_a_shape_the_op_cannot_take_is_refused_before_allocating(op_name, shape, match):
    with pytest.raises(ValueError, match=f"shape: .*{match}"):
        pl.ops.get(op_name).check_shape(shape)
