"""The pytest plugin: record timings in a user's suite, fail on a regression."""

SUITE = """
import time

def busy(ms):
    def f():
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass
    return f

def test_kernel_speed(perfloop):
    m = perfloop.bench(busy(MS), name="kernel", budget_s=0.4)
    assert m.median_ms > 0
"""


def test_baseline_then_regression_then_noise(pytester):
    pytester.makepyfile(test_user=SUITE.replace("MS", "1.0"))
    r = pytester.runpytest_subprocess("--perfloop-save", "base.json")
    r.assert_outcomes(passed=1)
    assert (pytester.path / "base.json").exists()

    pytester.makepyfile(test_user=SUITE.replace("MS", "1.5"))  # 50% slower
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json", "--perfloop-fail-above", "10")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*perfloop regression in kernel*slower*"])

    pytester.makepyfile(test_user=SUITE.replace("MS", "1.0"))  # the same again
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json")
    r.assert_outcomes(passed=1)


def test_unreadable_baseline_is_a_usage_error(pytester):
    pytester.makepyfile(test_user=SUITE.replace("MS", "0.1"))
    (pytester.path / "bad.json").write_text("{not json")
    r = pytester.runpytest_subprocess("--perfloop-compare", "bad.json")
    assert r.ret == 4  # pytest's usage-error exit code
    r.stderr.fnmatch_lines(["*--perfloop-compare: cannot read baseline*"])
