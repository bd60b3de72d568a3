"""The pytest plugin as a new user meets it (issue 37): one key per call, outputs checked before
the suite runs, baselines checked field by field, a table every session, skip/only/disable,
--perfloop-strict, and pytest-benchmark's JSON read and written."""

import json
import os

import pytest

from helpers import BUSY

TWO_UNNAMED = (
    BUSY
    + """
def test_step(perfloop):
    perfloop.bench(busy(FIRST), budget_s=0.3)
    perfloop.bench(busy(0.2), budget_s=0.3)
"""
)


@pytest.mark.slow
def test_two_unnamed_calls_in_one_test_get_two_keys_and_a_3x_slowdown_of_the_first_fails(pytester):
    pytester.makepyfile(test_user=TWO_UNNAMED.replace("FIRST", "0.3"))
    r = pytester.runpytest_subprocess("--perfloop-save", "base.json")
    r.assert_outcomes(passed=1)
    keys = set(json.loads((pytester.path / "base.json").read_text()))
    assert keys == {"test_user.py::test_step", "test_user.py::test_step#2"}
    r.stdout.fnmatch_lines(["*perfloop benchmarks*", "name *median*", "test_user.py::test_step *"])
    pytester.makepyfile(test_user=TWO_UNNAMED.replace("FIRST", "0.9"))
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json")
    out = r.stdout.str()
    if "cannot judge" not in out:  # a loaded machine may leave the gate unable to judge: said, not passed
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines(["*perfloop regression in test_user.py::test_step:*slower*"])


def test_the_same_name_given_twice_is_an_error_naming_it(pytester):
    pytester.makepyfile(
        test_user=BUSY
        + """
def test_a(perfloop):
    perfloop.bench(busy(0.1), name="k", budget_s=0.1)

def test_b(perfloop):
    perfloop.bench(busy(0.1), name="k", budget_s=0.1)
"""
    )
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*name: 'k' was already measured in this session (by test_user.py::test_a)*"])


def _targets(root):
    (root / "folder.db").mkdir()
    (root / "foreign.db").write_bytes(os.urandom(4096))
    (root / "list.json").write_text("[]")
    return [
        (("--perfloop-db", "folder.db"), "is a folder"),
        (("--perfloop-db", "foreign.db"), "--perfloop-db"),
        (("--perfloop-save", "list.json"), "holds a list, not a baseline to merge into"),
        (("--perfloop-save", "folder.db"), "is a folder"),
        (("--perfloop-benchmark-json", ""), "an empty path"),
    ]


@pytest.mark.slow
def test_bad_output_targets_are_usage_errors_before_any_test_runs(pytester):
    pytester.makepyfile(
        test_user=BUSY
        + """
def test_slow(perfloop):
    raise AssertionError("ran")
"""
    )
    for args, says in _targets(pytester.path):
        r = pytester.runpytest_subprocess(*args)
        assert r.ret == 4, (args, r.stdout.str()[-500:])
        assert "ran" not in r.stdout.str()
        r.stderr.fnmatch_lines([f"*{says}*"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_for_the_baseline_is_a_usage_error(pytester):
    pytester.makepyfile(test_user=BUSY + "\ndef test_x(perfloop):\n    pass\n")
    ro = pytester.mkdir("ro")
    ro.chmod(0o555)
    r = pytester.runpytest_subprocess("--perfloop-save", "ro/base.json")
    assert r.ret == 4
    r.stderr.fnmatch_lines(["*not writable*"])


GOOD = {"samples_ms": [1.0, 1.1, 0.9], "label": "x"}


@pytest.mark.parametrize(
    "entry, says",
    [
        (GOOD | {"work": {"bytes": -5}}, "Work.bytes: must be a finite number >= 0"),
        (GOOD | {"work": {"bytes": "many"}}, "Work.bytes: must be a finite number >= 0"),
        (GOOD | {"meta": [1, 2]}, "meta must be an object, got a list"),
        (GOOD | {"samples_ms": ["1.0", "2.0"]}, "finite positive"),
        (
            GOOD | {"meta": {"reference_samples_ms": [0.0, 0.0]}},
            "reference_samples_ms must be finite positive",
        ),
    ],
)
def test_a_baseline_is_checked_field_by_field(pytester, entry, says):
    pytester.makepyfile(test_user=BUSY + "\ndef test_x(perfloop):\n    perfloop.bench(busy(0.1), name='k')\n")
    (pytester.path / "bad.json").write_text(json.dumps({"k": entry}))
    r = pytester.runpytest_subprocess("--perfloop-compare", "bad.json")
    assert r.ret == 4
    r.stderr.fnmatch_lines([f"*key 'k'*{says}*"])


SPLIT = (
    BUSY
    + """
def test_fast(perfloop):
    assert perfloop.bench(busy(0.1), name="fast", budget_s=0.2) is RESULT

def test_plain():
    pass
"""
)


def test_skip_only_and_disable_choose_what_runs_and_what_is_timed(pytester):
    pytester.makepyfile(test_user=SPLIT.replace("RESULT", "not None"))
    pytester.runpytest_subprocess("--perfloop-skip").assert_outcomes(passed=1, skipped=1)
    r = pytester.runpytest_subprocess("--perfloop-only")
    r.assert_outcomes(passed=1, deselected=1)
    pytester.makepyfile(test_user=SPLIT.replace("RESULT", "None"))
    r = pytester.runpytest_subprocess("--perfloop-disable", "--perfloop-save", "b.json")
    r.assert_outcomes(passed=2)
    assert not (pytester.path / "b.json").exists()  # nothing timed, nothing saved


@pytest.mark.slow
def test_pytest_benchmark_json_written_then_read_back_as_a_baseline(pytester):
    pytester.makepyfile(
        test_user=BUSY
        + """
def test_k(perfloop):
    perfloop.bench(busy(0.2), budget_s=0.3)
"""
    )
    pytester.runpytest_subprocess("--perfloop-benchmark-json", "pb.json").assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "pb.json").read_text())
    [b] = doc["benchmarks"]
    assert b["fullname"] == "test_user.py::test_k" and "machine_info" in doc
    assert (
        1.9e-4 <= b["stats"]["median"] < 2e-2  # seconds (a 0.2 ms spin; ms would read 1000x)
        and len(b["stats"]["data"]) == b["stats"]["rounds"]
    )
    r = pytester.runpytest_subprocess("--perfloop-compare", "pb.json")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*perfloop comparison*", "test_user.py::test_k: *x, *"])
    del b["stats"]["data"]  # saved without --benchmark-save-data: no samples to judge
    (pytester.path / "nodata.json").write_text(json.dumps(doc))
    r = pytester.runpytest_subprocess("--perfloop-compare", "nodata.json")
    assert r.ret == 4
    r.stderr.fnmatch_lines(["*no raw timings (stats.data)*--benchmark-save-data*"])


@pytest.mark.slow
def test_strict_makes_cannot_judge_a_failure_with_the_reason(pytester):
    pytester.makepyfile(
        test_user=BUSY + "\ndef test_k(perfloop):\n    perfloop.bench(busy(0.2), name='k', budget_s=0.3)\n"
    )
    pytester.runpytest_subprocess("--perfloop-save", "base.json").assert_outcomes(passed=1)
    base = json.loads((pytester.path / "base.json").read_text())
    ref = base["k"]["meta"]["reference_samples_ms"]
    # another machine's pace: its reference 100x faster, the code 2x faster (both moved one way,
    # by a margin a loaded machine's own 10x swings in the reference cannot undo)
    base["k"]["meta"]["reference_samples_ms"] = [x / 100 for x in ref]
    base["k"]["samples_ms"] = [x / 2 for x in base["k"]["samples_ms"]]
    (pytester.path / "base.json").write_text(json.dumps(base))
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json")
    r.assert_outcomes(passed=1, warnings=1)
    r = pytester.runpytest_subprocess("--perfloop-compare", "base.json", "--perfloop-strict")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*perfloop: k: cannot judge*(--perfloop-strict)*"])


@pytest.mark.slow
def test_the_projects_tool_perfloop_table_names_the_baseline_the_plugin_compares_against(pytester):
    pytester.makepyprojecttoml("[project]\nname = 'user'\n\n[tool.perfloop]\nreference = 'perf/base.json'\n")
    pytester.makepyfile(
        test_user=BUSY + "\ndef test_k(perfloop):\n    perfloop.bench(busy(0.2), name='k', budget_s=0.3)\n"
    )
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*reference *base.json does not exist yet: nothing was compared*"])
    pytester.runpytest_subprocess("--perfloop-save", "perf/base.json").assert_outcomes(passed=1)
    r = pytester.runpytest_subprocess()  # no flag: the table's baseline is compared against
    r.stdout.fnmatch_lines(["*perfloop comparison*", "k: *x, *"])


def test_a_failing_tests_timing_is_not_saved_as_a_baseline(pytester):
    """issue 52: a test that measured, then failed its own assert, had its timing saved as the
    baseline the next run compares against."""
    pytester.makepyfile(
        test_user="""
import time
def _work():
    t = time.perf_counter()
    while time.perf_counter() - t < 0.0005:
        pass
def test_good(perfloop):
    perfloop.bench(_work, name="good", budget_s=0.2)
def test_bad(perfloop):
    perfloop.bench(_work, name="bad", budget_s=0.2)
    assert False, "the result was wrong"
"""
    )
    r = pytester.runpytest_subprocess("--perfloop-save", "base.json")
    r.assert_outcomes(passed=1, failed=1)
    saved = json.loads((pytester.path / "base.json").read_text())
    assert "good" in saved and "bad" not in saved
    r.stdout.fnmatch_lines(["*perfloop: not saved: bad (its test failed*"])
