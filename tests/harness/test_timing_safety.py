"""No silent wrong number from the harness (issue 15, 2, 6-8, 10)."""

import math
import subprocess
import sys
import warnings

import pytest
import torch

import perfloop as pl
from helpers import busy
from perfloop.harness.stats import fit_power_floor


@pytest.mark.parametrize(
    "sizes, size_of, why",
    [
        ([0, 1000, 2000, 4000], None, "not a positive number"),
        ([(10, 10), (20, 20), (40, 40)], None, "not a number"),
        ([1000, 1000, 1000], None, "3 distinct sizes"),
    ],
)
def test_a_sweep_keeps_its_points_when_the_fit_cannot_be_made(sizes, size_of, why):
    s = pl.sweep(lambda n: busy(0.05), sizes, size_of=size_of, budget_s=0.05)
    assert len(s.points) == len(sizes)
    assert all(p.measurement is not None for p in s.points)
    assert s.fit is None and why in s.fit_error and why in str(s)


def test_a_noisy_sweep_fit_raises_no_scipy_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_power_floor([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0])


def test_cpu_contention_is_detected_and_said():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        x = torch.randn(256, 256)
        # a CI no run reaches: the samples span the budget (a window under 50 ms reads no load at all)
        m = pl.bench(torch.nn.functional.gelu, x, budget_s=0.3, target_ci=1e-9)
    finally:
        for h in hogs:
            h.kill()
    assert m.meta["other_cpu_cores"] > 0.3
    assert any(w.startswith("contended") for w in m.warnings)


def test_an_input_zeroed_in_place_during_timing_is_said():
    x = torch.randn(1000)
    m = pl.bench(lambda: x.mul_(0.0), budget_s=0.05)  # the first call already zeroes it
    assert any("became all zeros" in w for w in m.warnings)
    y = torch.randn(1000).abs() + 2
    m = pl.bench(lambda: y.mul_(1e30), budget_s=0.05)  # overflows to inf after a few calls
    assert any("became inf/NaN" in w for w in m.warnings)


def test_a_rate_above_the_ceiling_is_flagged_with_its_likely_cause():
    ceil = {"copy_gbps": 10.0, "matmul_fp32_tflops": 0.001, "matmul_bf16_tflops": 0.01}
    m = pl.bench(busy(0.1), work=pl.Work(flops=6.4e8), ceilings=ceil, budget_s=0.05)  # 6.4 TFLOP/s vs 0.001
    assert m.sol > 1.05
    w = [w for w in m.warnings if w.startswith("suspect")]
    assert w and "Work.dtype is not given" in w[0] and "suspect" in str(m)


def test_compare_refuses_candidates_that_compute_different_things():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match=r"fns\['b'\].*differs"):
        pl.compare({"a": lambda: x.sum(0), "b": lambda: x.sum()}, budget_s=0.05)
    with pytest.raises(ValueError, match="dtype|differs"):
        pl.compare({"a": lambda: x * 2, "b": lambda: (x * 2).double()}, budget_s=0.05)
    with pytest.raises(ValueError, match="by up to"):
        pl.compare({"a": lambda: x * 2, "b": lambda: x * 3}, budget_s=0.05, check_values=True)


@pytest.mark.parametrize("warmup", [math.inf, math.nan, -1.0])
def test_warmup_must_be_finite(warmup):
    with pytest.raises(ValueError, match="warmup_s"):
        pl.bench(busy(0.01), warmup_s=warmup)


def test_budget_must_be_finite():
    with pytest.raises(ValueError, match="budget_s"):
        pl.bench(busy(0.01), budget_s=math.inf)
