"""The loss check judges a candidate against the spread the script has anyway."""

import math

from perfloop.workflows.tune.candidates import Numerics
from perfloop.workflows.tune.verify import judge

BASE = [2.30, 2.21, 2.12, 2.05, 1.99, 1.94, 1.90, 1.87, 1.85]
OTHER_SEED = [2.31, 2.25, 2.17, 2.08, 2.01, 1.97, 1.93, 1.91, 1.89]  # ends 0.04 apart


def _scaled(curve, rel):
    return [x * (1 + rel) for x in curve]


def test_a_change_in_the_last_bits_passes_and_says_its_tolerance():
    v = judge(_scaled(BASE, 3e-5), BASE, BASE, OTHER_SEED, float(Numerics.REORDERED))
    assert v.ok
    assert v.early_tol == float(Numerics.REORDERED)
    assert "tolerance" in v.reason and "another seed" in v.reason


def test_a_small_bias_in_the_first_steps_is_refused_though_the_end_is_within_the_seed_spread():
    cand = [BASE[0] * (1 + 2e-3), *BASE[1:]]  # 0.2% off at step 0, the same after
    v = judge(cand, BASE, BASE, OTHER_SEED, float(Numerics.REORDERED))
    assert not v.ok
    assert "step 0" in v.reason and v.early_err > v.early_tol


def test_tf32_may_move_what_fp32_reordering_may_not():
    cand = _scaled(BASE, 2e-3)
    assert not judge(cand, BASE, BASE, OTHER_SEED, float(Numerics.REORDERED)).ok
    assert judge(cand, BASE, BASE, OTHER_SEED, float(Numerics.TF32)).ok


def test_the_scripts_own_nondeterminism_widens_the_tolerance():
    noisy = _scaled(BASE, 4e-3)  # the baseline itself moves 0.4% run to run
    cand = _scaled(BASE, 6e-3)
    v = judge(cand, BASE, noisy, OTHER_SEED, float(Numerics.REORDERED))
    assert v.ok and math.isclose(v.early_tol, 3 * 4e-3, rel_tol=1e-3)


def test_an_end_beyond_the_seed_spread_is_refused():
    cand = [*BASE[:3], *(x + 0.2 for x in BASE[3:])]  # trains to a worse loss
    v = judge(cand, BASE, BASE, OTHER_SEED, float(Numerics.REORDERED))
    assert not v.ok and v.end_diff > v.end_tol


def test_a_nan_the_script_does_not_have_is_refused():
    cand = [*BASE[:5], float("nan"), *BASE[6:]]
    v = judge(cand, BASE, BASE, OTHER_SEED, float(Numerics.BF16))
    assert not v.ok and "step 5" in v.reason


def test_no_loss_seen_is_said_not_checked():
    v = judge([], [], None, None, float(Numerics.EXACT))
    assert not v.ok and not v.checked and "not checked" in v.reason  # never kept
    assert not judge([], BASE, None, None, float(Numerics.EXACT)).ok
