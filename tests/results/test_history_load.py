"""The history on a loaded machine (issue 37): runs the harness flagged as contended are left out
of the fit and said, steps are sized by medians, and a reference workload that followed the
machine's drift divides it out. The lines are the ones a user hit."""

import math
import random

import pytest

from perfloop.cli import main
from perfloop.harness.measurement import Measurement
from perfloop.results.history import trends
from perfloop.results.store import Store

CONTENDED = "contended: other processes used ~1.9 of 2 CPU cores while this was timed"


def _add(store, op, commit, level, rng, *, spread=0.02, contended=False, reference=None, device="AMD EPYC"):
    samples = tuple(level * math.exp(rng.gauss(0, spread)) for _ in range(25))
    meta = {"other_cpu_cores": 1.9 if contended else 0.05}
    if reference is not None:
        meta["reference_samples_ms"] = [reference * math.exp(rng.gauss(0, spread)) for _ in range(25)]
    m = Measurement(
        samples_ms=samples,
        env={"git": commit, "device": {"name": device}},
        meta=meta,
        extra_warnings=(CONTENDED,) if contended else (),
    )
    store.add(store.new_run("pytest --perfloop-db"), m, op=op, variant="pytest", shape=(), dtype="")


def test_two_contended_runs_no_longer_turn_a_1_8x_slowdown_into_a_speedup(tmp_path, capsys):
    rng = random.Random(3)
    s = Store(tmp_path / "h.db")
    first, second = "a1b2c3d4e5f6", "0f9e8d7c6b5a"
    for op, slow in (("test:step", 1.8), ("test:same", 1.0)):
        for _ in range(2):  # taken while the machine was busy, each flagged when it was taken
            _add(s, op, first, 23.7, rng, contended=True)
        for i in range(4):
            _add(s, op, first, 0.12 + 0.01 * (i % 2), rng)
        for i in range(4):
            _add(s, op, second, (0.12 + 0.01 * (i % 2)) * slow, rng)
    by_op = {t.key[0]: t for t in trends(s)}
    [c] = by_op["test:step"].changes
    assert c.ratio == pytest.approx(1.8, rel=0.05) and (c.before, c.after) == (first, second)
    assert str(c).startswith("1.8") and "slower" in str(c)
    assert by_op["test:same"].changes == []
    for t in by_op.values():
        assert t.left_out == [0, 1] and any(
            "2 of 10 run(s) left out" in n and "contended" in n for n in t.notes
        )
    assert main(["history", "test:step", "--db", str(tmp_path / "h.db")]) == 0
    out = capsys.readouterr().out
    assert "(slower)" in out and "left out: contended" in out and "2 of 10 run(s) left out" in out
    assert main(["report", "--db", str(tmp_path / "h.db"), "--html", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "index.html").read_text()
    assert page.count("10 (2 contended, left out)") == 2 and "1.8" in page


def _line(rng, n_commits, runs_each, noise, steps, contend_share, contend_range):
    """(commit, level, contended) for each run: `steps` maps a commit index to the ratio from it on."""
    out, level = [], 1.0
    for c in range(n_commits):
        level *= steps.get(c, 1.0)
        for _ in range(runs_each):
            hog = rng.random() < contend_share
            slow = rng.uniform(*contend_range) if hog else 1.0
            out.append((f"{c:05d}{'c' * 7}", level * slow * math.exp(rng.gauss(0, noise)), hog))
    return out


@pytest.mark.parametrize(
    "machine, noise, planted, contend_range",
    [
        ("cpu", 0.04, {60: 1.10, 120: 0.80, 170: 1.5}, (5.0, 100.0)),
        ("gpu", 0.005, {40: 1.10, 100: 0.90, 150: 1.25}, (1.05, 3.0)),
    ],
)
def test_a_thousand_runs_a_tenth_contended_find_every_planted_step_its_true_way_and_none_on_flat_keys(
    tmp_path, machine, noise, planted, contend_range
):
    rng = random.Random(11)
    s = Store(tmp_path / "h.db")
    commits = 200
    for op, steps in ((f"{machine}-steps", planted), (f"{machine}-flat", {})):
        for commit, level, hog in _line(
            rng, commits, 5 if op.endswith("flat") else 5, noise, steps, 0.10, contend_range
        ):
            _add(s, op, commit, level, rng, spread=noise / 2, contended=hog)
    by_op = {t.key[0]: t for t in trends(s)}
    flat = by_op[f"{machine}-flat"]
    assert flat.changes == [], [str(c) for c in flat.changes]
    assert 60 <= len(flat.left_out) <= 140  # about a tenth of the 1000 runs, each said
    found = by_op[f"{machine}-steps"].changes
    assert len(found) == len(planted), [str(c) for c in found]
    for c, (at, ratio) in zip(found, sorted(planted.items()), strict=True):
        assert int(c.before[:5]) == at - 1 and int(c.after[:5]) == at, str(c)
        assert (c.ratio > 1) == (ratio > 1) and c.ratio == pytest.approx(ratio, rel=0.05), str(c)


def test_a_reference_that_followed_the_machines_drift_divides_it_out(tmp_path):
    rng = random.Random(5)
    s = Store(tmp_path / "h.db")
    for c in range(30):
        machine = 1.4 if c >= 10 else 1.0  # the CI moved to a slower runner at commit 10
        code = 1.15 if c >= 20 else 1.0  # the code's own step
        for _ in range(2):
            drift = machine * math.exp(rng.gauss(0, 0.03))
            _add(s, "test:k", f"{c:05d}ccccccc", drift * code, rng, spread=0.01, reference=0.5 * drift)
    [t] = trends(s)
    assert t.divided and any("reference workload" in n for n in t.notes)
    [c] = t.changes
    assert (c.before[:5], c.after[:5]) == ("00019", "00020") and c.ratio == pytest.approx(1.15, rel=0.04)


def test_a_zero_or_negative_stored_median_is_skipped_and_said_not_a_crash(tmp_path, capsys):
    rng = random.Random(1)
    s = Store(tmp_path / "h.db")
    for i in range(7):
        _add(s, "test:z", f"{i:05d}ccccccc", 1.0, rng)
    s.conn.execute("UPDATE measurements SET median_ms = 0 WHERE id = 3")
    [t] = trends(s)
    assert len(t.points) == 6 and any("median 0" in w for w in s.skipped)
    assert main(["history", "test:z", "--db", str(tmp_path / "h.db")]) == 0
    assert main(["report", "--db", str(tmp_path / "h.db"), "--html", str(tmp_path / "page")]) == 0
