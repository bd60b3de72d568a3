"""Variants keep the contract of the functions they wrap (issue 15, 7, 11)."""

import warnings

import pytest
import torch

import perfloop as pl
from perfloop.ops import CheckFailed
from perfloop.ops.base import Variant


def test_variants_take_the_keywords_of_the_functions_they_wrap():
    op = pl.ops.get("attention")
    q, k, v, _ = op.make_inputs((1, 2, 8, 8, 16, True), seed=1)
    out = op.variant("builtin")(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)


def test_check_refuses_an_output_in_another_dtype():
    op = pl.ops.get("gelu")
    op.add(
        Variant("upcasts", fn=lambda x, out=None: torch.nn.functional.gelu(x.double(), approximate="tanh"))
    )
    try:
        with pytest.raises(CheckFailed, match="output dtype torch.float64"):
            op.check("upcasts", dtypes=[torch.float32], shapes=[(7,)], seeds=1)
    finally:
        del op.variants["upcasts"]


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


@pytest.mark.parametrize("op_name, shape, match", [
    ("matmul_relu", (64, 64), "takes 3 sizes"),
    ("attention", (1, 2, 64, 64), "takes 6 sizes"),
    ("gelu", (10**7, 10**7), "GiB"),
])  # fmt: skip
def test_a_shape_the_op_cannot_take_is_refused_before_allocating(op_name, shape, match):
    with pytest.raises(ValueError, match=f"shape: .*{match}"):
        pl.ops.get(op_name).check_shape(shape)
