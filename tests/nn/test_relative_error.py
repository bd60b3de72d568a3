"""nn.verify.relative_error, the measure every swap is checked by: float64 on the reference's
device (no host copies: 58 of pl.patch's 92 s sat in them on a Llama, run42), the inputs left as
they were, NaN kept as a failure."""

import math

import torch

from perfloop.nn.verify import relative_error


def test_the_error_is_the_largest_difference_over_the_largest_reference_value():
    g = torch.Generator().manual_seed(3)
    want = torch.randn(64, 33, generator=g, dtype=torch.float64)
    got = (want + 1e-2 * torch.randn(64, 33, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    expect = (got.double() - want).abs().max() / want.abs().max()
    assert math.isclose(relative_error(got, want), float(expect), rel_tol=1e-12)
    assert math.isclose(relative_error(got.t(), want.t()), float(expect), rel_tol=1e-12)  # strided


def test_neither_input_is_changed_even_where_both_are_float64_already():
    g = torch.Generator().manual_seed(4)
    want = torch.randn(100, generator=g, dtype=torch.float64)
    got = want * 1.5
    kept_got, kept_want = got.clone(), want.clone()
    assert math.isclose(relative_error(got, want), float((0.5 * want).abs().max() / want.abs().max()))
    assert torch.equal(got, kept_got) and torch.equal(want, kept_want)


def test_a_nan_or_an_inf_in_the_output_is_an_error_no_tolerance_passes():
    want = torch.linspace(-2, 3, 50, dtype=torch.float64)
    got = want.float().clone()
    got[7] = float("nan")
    assert not relative_error(got, want) <= 1.0  # NaN: every comparison with a tolerance fails
    got[7] = float("inf")
    assert relative_error(got, want) == float("inf")
    assert relative_error(want.clone(), want) == 0.0
