"""The pytest plugin: record timings in a user's suite, fail on a regression."""

import json

import pytest

from helpers import BUSY

SUITE = (
    BUSY
    + """
def test_kernel_speed(perfloop):
    m = perfloop.bench(busy(MS), name="kernel", budget_s=0.4)
    assert m.median_ms > 0
"""
)


# One torch thread: this file tests the plugin's flow (save, compare, fail). With torch's two
# threads beside a busy core, twice the work read raw 1.10x and 1.23x in two loaded runs (one of
# the threads waits on the busy core, unevenly from run to run): what the gate then says is
# tests/harness/test_gate.py's and benchmarks/experiments/gate_noise.py's subject.
SCALING = """
import torch

torch.set_num_threads(1)
x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))

def test_kernel_speed(perfloop):
    def kernel():  # work that scales with the machine, like real code
        for _ in range(REPS):
            torch.sin(x)
    m = perfloop.bench(kernel, name="kernel", budget_s=0.5)
    assert m.median_ms > 0
"""


@pytest.mark.slow
def test_baseline_then_regression_then_noise(pytester):
    pytester.makepyfile(test_user=SCALING.replace("REPS", "4"))
    r = pytester.runpytest_subprocess("--perfloop-save", "base.json")
    r.assert_outcomes(passed=1)
    assert (pytester.path / "base.json").exists()

    pytester.makepyfile(test_user=SCALING.replace("REPS", "8"))  # twice the work
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json", "--perfloop-fail-above", "10")
    out = r.stdout.str()
    r.stdout.fnmatch_lines(["*perfloop comparison*", "kernel: *x, * (raw *x; fast tails (p10)*"])
    if "cannot judge" in out:  # under load the machine's pace moved, or the reference disagreed: said
        r.assert_outcomes(passed=1, warnings=1)
    else:
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines(["*perfloop regression in kernel*slower*reference workload*"])

    pytester.makepyfile(test_user=SCALING.replace("REPS", "4"))  # the same again
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json")
    r.assert_outcomes(passed=1)


def test_unreadable_baseline_is_a_usage_error(pytester):
    pytester.makepyfile(test_user=SUITE.replace("MS", "0.1"))
    (pytester.path / "bad.json").write_text("{not json")
    r = pytester.runpytest_subprocess("--perfloop-compare", "bad.json")
    assert r.ret == 4  # pytest's usage-error exit code
    r.stderr.fnmatch_lines(["*--perfloop-compare: cannot read baseline*"])


UNNAMED = SUITE.replace('name="kernel", ', "")  # keyed by the test itself


@pytest.mark.slow
def test_keys_do_not_depend_on_the_folder_pytest_starts_in(pytester):
    """Saved from the project root, compared from inside tests/: the same key, so a 3x
    slowdown is caught (it used to pass: every node id differed)."""
    pytester.makepyprojecttoml("[project]\nname = 'user'\n")
    tests = pytester.mkdir("tests")
    (tests / "test_user.py").write_text(UNNAMED.replace("MS", "0.5"))
    r = pytester.runpytest_subprocess("tests", "--perfloop-save", "base.json")
    r.assert_outcomes(passed=1)
    keys = set(__import__("json").loads((pytester.path / "base.json").read_text()))
    assert "tests/test_user.py::test_kernel_speed" in keys
    (tests / "test_user.py").write_text(UNNAMED.replace("MS", "1.5"))
    import os

    os.chdir(tests)
    r = pytester.runpytest_subprocess(
        "--rootdir", str(tests), "--perfloop-compare", str(pytester.path / "base.json")
    )
    if "cannot judge: the machine ran" in r.stdout.str():  # under load: said for the same key, not passed
        r.assert_outcomes(passed=1, warnings=1)
        r.stdout.fnmatch_lines(["*perfloop: tests/test_user.py::test_kernel_speed: cannot judge*"])
    else:
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines(["*perfloop regression in tests/test_user.py::test_kernel_speed*"])


def test_a_baseline_with_no_matching_key_fails_loudly(pytester):
    pytester.makepyfile(test_user=SUITE.replace("MS", "0.2"))
    (pytester.path / "other.json").write_text(
        '{"someone_else": {"samples_ms": [1.0, 1.1, 0.9], "label": "x"}}'
    )
    r = pytester.runpytest_subprocess("--perfloop-compare", "other.json")
    assert r.ret == 1
    r.stdout.fnmatch_lines(["*none matched*nothing was compared*"])


@pytest.mark.slow
def test_saving_a_subset_merges_into_the_baseline_and_creates_its_folder(pytester):
    two = (
        SUITE.replace("MS", "0.2")
        + """
def test_other_speed(perfloop):
    perfloop.bench(busy(0.2), name="other", budget_s=0.2)
"""
    )
    pytester.makepyfile(test_user=two)
    r = pytester.runpytest_subprocess("--perfloop-save", "out/deep/base.json")
    r.assert_outcomes(passed=2)
    r = pytester.runpytest_subprocess("-k", "other", "--perfloop-save", "out/deep/base.json")
    r.assert_outcomes(passed=1, deselected=1)
    keys = set(__import__("json").loads((pytester.path / "out/deep/base.json").read_text()))
    assert {"kernel", "other"} <= keys  # -k replaced only its own key


@pytest.mark.parametrize(
    "content, says",
    [
        ("[1, 2, 3]", "holds a list"),
        ('{"kernel": {"label": "x"}}', "no samples_ms"),
        ('{"kernel": {"samples_ms": [1.0, NaN]}}', "finite positive"),
    ],
)
def test_a_malformed_baseline_is_a_usage_error(pytester, content, says):
    pytester.makepyfile(test_user=SUITE.replace("MS", "0.1"))
    (pytester.path / "bad.json").write_text(content)
    r = pytester.runpytest_subprocess("--perfloop-compare", "bad.json")
    assert r.ret == 4
    r.stderr.fnmatch_lines([f"*{says}*"])


@pytest.mark.slow
def test_each_session_is_kept_in_the_store_as_a_line_of_the_history(pytester):
    import contextlib
    import io

    from perfloop.cli import main

    pytester.makepyfile(test_user=SUITE.replace("MS", "0.3"))
    db = str(pytester.path / "runs.db")
    for _ in range(2):
        pytester.runpytest_subprocess("--perfloop-db", db).assert_outcomes(passed=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["history", "kernel", "--db", db, "--json"]) == 0
    [trend] = json.loads(out.getvalue())["trends"]
    assert trend["key"]["op"] == "test:kernel" and len(trend["points"]) == 2
    # a 0.3 ms spin is never faster than 0.3 ms; slower only where the machine is loaded
    assert all(p["median_ms"] >= 0.29 for p in trend["points"]), trend["points"]
