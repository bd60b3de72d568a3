import numpy as np
import pytest

from perfloop.harness import stats


def test_median_ci_covers_true_median_about_95_percent():
    rng = np.random.default_rng(1)
    true_median = np.log(2)  # exponential(1): skewed like timing samples
    hits = 0
    trials = 2000
    for _ in range(trials):
        lo, hi = stats.median_ci(rng.exponential(1.0, size=31))
        hits += lo <= true_median <= hi
    assert 0.93 <= hits / trials <= 0.995


def test_median_ci_small_n_is_full_range_and_empty_raises():
    assert stats.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError, match="samples"):
        stats.median_ci([])


def test_fit_power_floor_recovers_floor_and_exponent():
    n = np.array([2.0**i for i in range(4, 15)])
    t = 0.01 + 2e-9 * n**3
    f = stats.fit_power_floor(n, t)
    assert f["exponent"] == pytest.approx(3.0, abs=0.05)
    assert f["floor"] == pytest.approx(0.01, rel=0.05)
    assert f["knee"] == pytest.approx((0.01 / 2e-9) ** (1 / 3), rel=0.1)


def test_fit_rejects_too_few_or_nonpositive():
    with pytest.raises(ValueError, match="at least 3"):
        stats.fit_power_floor([1, 2], [1, 2])
    with pytest.raises(ValueError, match="positive"):
        stats.fit_power_floor([1, 2, 3], [1, 0, 2])


def test_paired_speedup_detects_a_real_2x_and_not_noise():
    rng = np.random.default_rng(0)
    base = 2.0 + rng.normal(0, 0.02, 60)
    fast = 1.0 + rng.normal(0, 0.01, 60)
    s = stats.paired_speedup(base, fast)
    assert s["speedup"] == pytest.approx(2.0, rel=0.02)
    assert s["ci"][0] > 1.9 and s["p_value"] < 1e-6
    same = stats.paired_speedup(base, base + rng.normal(0, 0.001, 60))
    assert same["ci"][0] <= 1.0 <= same["ci"][1]


def test_a_ratio_over_runs_is_as_uncertain_as_its_runs_differ():
    from perfloop.harness.stats import independent_ratio, runs_ratio

    rng = np.random.default_rng(0)

    def runs(*levels):
        return [list(lv * rng.lognormal(0, 0.01, 15)) for lv in levels]

    # the same programs; the candidate's two processes ran at 0.6 and 1.05 of the step
    base, cand = runs(1.0, 1.0), runs(0.6, 1.05)
    r = runs_ratio(base, cand)
    assert r["ci"][0] < 1.0 < r["ci"][1] and r["p_value"] > 0.05 and r["runs"] == (2, 2)
    # ten consistent runs at 0.8: tight, and told apart
    r = runs_ratio(runs(*[1.0] * 10), runs(*[0.8] * 10))
    assert 0.78 < r["ci"][0] < r["ratio"] < r["ci"][1] < 0.82 and r["p_value"] < 0.01
    # one run each: the steps are all it has, as independent_ratio reads them
    one = runs_ratio(runs(1.0), runs(0.9))
    assert (
        one["ci"][1] < 1.0
        and abs(one["ratio"] - independent_ratio(*[x[0] for x in (runs(1.0), runs(0.9))])["ratio"]) < 0.02
    )
    with pytest.raises(ValueError, match="a_runs/b_runs"):
        runs_ratio([], cand)
