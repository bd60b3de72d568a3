import dataclasses
import time

import pytest
import torch

import perfloop as pl
from helpers import busy
from perfloop.measurement import Measurement


def test_busy_wait_of_2ms_measures_within_5_percent():
    m = pl.bench(busy(2.0), budget_s=1.0)
    assert m.median_ms == pytest.approx(2.0, rel=0.05)
    assert m.meta["timer"] == "perf_counter"
    assert m.meta["stop_reason"] in ("converged", "budget", "max_samples")
    assert m.ci95_ms[0] <= m.median_ms <= m.ci95_ms[1]


def test_short_functions_are_batched_so_the_timer_cost_is_negligible():
    m = pl.bench(busy(0.02), budget_s=0.5)
    assert m.meta["calls_per_sample"] >= 20  # a sample lasts >= 1 ms
    assert m.median_ms == pytest.approx(0.02, rel=0.25)


def test_identical_functions_compare_as_not_significant():
    f = busy(0.3)
    c = pl.compare({"a": f, "b": f}, baseline="a", budget_s=1.5)
    s = c.speedups["b"]
    assert not s.significant, s
    assert s.ci[0] <= 1.0 <= s.ci[1]


def test_a_real_2x_difference_is_significant():
    c = pl.compare({"slow": busy(1.0), "fast": busy(0.5)}, baseline="slow", budget_s=1.5)
    s = c.speedups["fast"]
    assert s.significant
    assert s.speedup == pytest.approx(2.0, rel=0.1)


def test_sweep_of_linear_cost_fits_exponent_near_one():
    s = pl.sweep(lambda n: busy(n / 1000), sizes=[200, 400, 800, 1600, 3200], budget_s=0.3)
    assert 0.85 <= s.fit["exponent"] <= 1.15
    assert len(s.measurements) == 5


def test_sweep_keeps_other_sizes_when_one_fails():
    def factory(n):
        if n == 2:
            raise RuntimeError("boom at 2")
        return busy(0.05 * n)

    s = pl.sweep(factory, sizes=[1, 2, 3], budget_s=0.2)
    assert [p.error is None for p in s.points] == [True, False, True]
    assert "boom at 2" in s.points[1].error


def test_measurement_is_immutable_and_round_trips():
    x = torch.randn(1 << 14)
    m = pl.bench(torch.nn.functional.gelu, x, work=pl.Work(bytes=2 * x.nbytes), budget_s=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.samples_ms = (1.0,)
    d = m.to_dict()
    m2 = Measurement.from_dict(d)
    assert m2.samples_ms == m.samples_ms and m2.median_ms == m.median_ms
    assert m2.gbps == pytest.approx(m.gbps) and m.gbps > 0
    assert m.sol is not None and m.sol > 0  # against the measured copy ceiling
    assert m.env["torch"] == torch.__version__ and "precision" in m.env


def test_statistics_come_from_the_samples():
    m = Measurement(samples_ms=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100))
    assert m.median_ms == 6 and m.min_ms == 1
    assert m.p20_ms < m.median_ms < m.p80_ms
    assert any("noisy" in w for w in m.warnings)


def test_warns_on_all_zero_inputs_and_few_samples():
    z = torch.zeros(1000)
    m = pl.bench(torch.exp, z, budget_s=0.2)
    assert any("all zeros" in w for w in m.warnings)
    closure = pl.bench(lambda: torch.exp(z), budget_s=0.2)
    assert any("all zeros" in w for w in closure.warnings)
    assert any("few samples" in w for w in Measurement(samples_ms=(1.0, 2.0)).warnings)


def test_ceilings_are_measured_and_cached():
    c1 = pl.ceilings()
    assert c1["copy_gbps"] > 0 and c1["matmul_fp32_tflops"] > 0
    t = time.perf_counter()
    assert pl.ceilings() == c1
    assert time.perf_counter() - t < 0.5  # from the cache


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget_s": 0}, "budget_s"),
        ({"budget_s": -1}, "budget_s"),
        ({"target_ci": 0}, "target_ci"),
        ({"min_samples": 0}, "min_samples"),
        ({"min_samples": 10, "max_samples": 5}, "max_samples"),
        ({"warmup_s": -1}, "warmup_s"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pl.bench(busy(0.01), **kwargs)


def test_not_callable_and_raising_functions():
    with pytest.raises(TypeError, match="fn: must be callable"):
        pl.bench(42)

    def boom():
        raise ZeroDivisionError("the original error")

    with pytest.raises(pl.BenchError, match="the original error") as e:
        pl.bench(boom)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_graph_on_cpu_and_empty_sizes_are_clear_errors():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.raises(ValueError, match="graph=True.*CUDA"):
        pl.bench(busy(0.01), graph=True)
    with pytest.raises(ValueError, match="sizes"):
        pl.sweep(lambda n: busy(0.01), sizes=[])
    with pytest.raises(ValueError, match="baseline"):
        pl.compare({"a": busy(0.01)}, baseline="zzz")
    with pytest.raises(ValueError, match="min_rounds"):
        pl.compare({"a": busy(0.01)}, min_rounds=0)


@pytest.mark.parametrize("launches, advice", [(8, "fusing them into fewer kernels"),
                                              (1, "give each call more work")])  # fmt: skip
def test_graph_gap_warning_fits_the_number_of_kernels(monkeypatch, launches, advice):
    """The replay's excess over its kernels' CUPTI time: between many dependent kernels, fuse
    them; with one kernel a call there is nothing to fuse -- the advice must say so."""
    import types

    import perfloop.profiling
    from perfloop import timing

    reps = 4
    fake = types.SimpleNamespace(
        kind="cuda", device_ms_per_call=reps * 0.002, launches_per_call=reps * launches
    )
    monkeypatch.setattr(perfloop.profiling, "profile", lambda fn, calls, warmup: fake)
    sampler = types.SimpleNamespace(graph=types.SimpleNamespace(replay=lambda: None), calls_per_sample=reps)
    meta, warnings = timing._graph_gaps(sampler, [0.004, 0.0041, 0.0039])
    assert meta == {"graph_kernel_ms": 0.002, "graph_kernels_per_call": launches}
    assert len(warnings) == 1 and "2.00x the kernels' own time" in warnings[0] and advice in warnings[0]
    gap = (0.004 - 0.002) * 1e3 / launches
    assert f"~{gap:.2f} us" in warnings[0]
    meta, warnings = timing._graph_gaps(sampler, [0.0021])  # within 15%: no warning
    assert warnings == []
