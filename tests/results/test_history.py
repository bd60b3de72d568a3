"""Trends and change points (issue 26): a store of 1000 runs over 50 commits, with steps planted
on a GPU's noise scale (3%, 5%, 10%, 30%) and a CPU's (15%, 30%) and keys left unchanged; every
step of 5% or more found between the right commits, none on the unchanged keys."""

import json
import math
import random

import pytest

from perfloop.cli import main
from perfloop.harness.measurement import Measurement
from perfloop.results.history import change_points, trends
from perfloop.results.store import Store

COMMITS = [f"{i:04d}abcd{i:04d}" for i in range(50)]
# key -> (run-to-run noise, within-run noise, step ratio, first commit with the step)
PLANTED = {
    "gpu-3pct": (0.005, 0.004, 1.03, 20),
    "gpu-5pct": (0.005, 0.004, 1.05, 31),
    "gpu-10pct": (0.005, 0.004, 1.10, 12),
    "gpu-30pct": (0.005, 0.004, 0.70, 40),  # an improvement
    "cpu-15pct": (0.03, 0.05, 1.15, 25),
    "cpu-30pct": (0.03, 0.05, 1.30, 9),
    "gpu-flat": (0.005, 0.004, 1.0, None),
    "cpu-flat": (0.03, 0.05, 1.0, None),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = random.Random(7)
    s = Store(tmp_path_factory.mktemp("h") / "history.db")
    runs = 1000 // len(PLANTED)  # 125 runs a key, 2-3 a commit
    for name, (between, within, step, at) in PLANTED.items():
        device = "NVIDIA H200" if name.startswith("gpu") else "cpu"
        for r in range(runs):
            c = r * len(COMMITS) // runs
            level = 1.0 * (step if at is not None and c >= at else 1.0) * math.exp(rng.gauss(0, between))
            samples = tuple(level * math.exp(rng.gauss(0, within)) for _ in range(15))
            m = Measurement(samples_ms=samples, env={"git": COMMITS[c], "device": {"name": device}})
            run = s.new_run("test")
            s.add(run, m, op=name, variant="v", shape=(1024,), dtype="fp32")
    return s


def _index(commit: str) -> int:
    return COMMITS.index(commit)


def test_every_planted_step_of_5_percent_or_more_is_found_between_the_right_commits(store):
    by_op = {t.key[0]: t for t in trends(store)}
    assert len(by_op) == len(PLANTED)
    for name, (_, _, step, at) in PLANTED.items():
        t = by_op[name]
        if at is None:
            assert t.changes == [], (name, [str(c) for c in t.changes])
            assert not any("the latest" in n for n in t.notes), t.notes  # no late step claimed either
            continue
        if abs(math.log(step)) < math.log(1.05):
            continue  # 3%: found or not, it is not a target
        assert len(t.changes) == 1, (name, [str(c) for c in t.changes])
        c = t.changes[0]
        assert _index(c.before) < at <= _index(c.after), (name, str(c))
        assert c.ratio == pytest.approx(step, rel=0.03), (name, str(c))
        assert c.p_value < 0.001


def test_a_line_too_short_or_without_commits_is_said_not_guessed(tmp_path):
    s = Store(tmp_path / "short.db")
    for ms in (1.0, 1.01, 0.99):
        s.add(
            s.new_run("t"),
            Measurement(samples_ms=(ms, ms * 1.01, ms * 0.99)),
            op="x",
            variant="v",
            shape=(8,),
            dtype="fp32",
        )
    [t] = trends(s)
    assert t.changes == []
    assert any("a change point needs 6" in n for n in t.notes)
    assert any("recorded no commit" in n for n in t.notes)


def test_a_step_at_the_edge_of_the_line_is_not_claimed_but_said(tmp_path):
    from perfloop.results.history import Point

    pts = [Point(str(i), "", f"c{i}", 1.0 if i < 19 else 2.0, (0.99, 1.01)) for i in range(20)]
    assert change_points(pts) == []  # one run after it: a step needs three on each side
    s = Store(tmp_path / "edge.db")
    for p in pts:
        m = Measurement(
            samples_ms=(p.median_ms, p.median_ms * 1.01, p.median_ms * 0.99), env={"git": p.commit}
        )
        s.add(s.new_run("t"), m, op="x", variant="v", shape=(8,), dtype="fp32")
    [t] = trends(s)
    assert t.changes == [] and any(
        "the latest 1 run(s) read 2.000x the line before them" in n for n in t.notes
    )


def test_commits_the_repository_no_longer_holds_are_counted(tmp_path):
    import subprocess

    from perfloop.results.history import Point, missing_commits

    repo = tmp_path / "r"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "one"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    pts = [
        Point(str(i), "", c, 1.0, (0.9, 1.1)) for i, c in enumerate([head, head + "-dirty", "0123456789ab"])
    ]
    assert len(missing_commits(pts, str(repo))) == 1  # the rebased-away one; -dirty is its commit's
    assert missing_commits(pts[2:], str(repo)) == set()  # none held: not this line's repository


def test_history_verb_prints_the_line_and_its_step_and_json(store, capsys):
    assert main(["history", "gpu-10pct", "--db", store.path]) == 0
    out = capsys.readouterr().out
    assert "gpu-10pct/v/1024/fp32/NVIDIA H200: 125 run(s)" in out
    assert "step: 1." in out and "x (slower) between 0011abcd0011 and 0012abcd0012" in out
    assert main(["history", "flat", "--db", store.path, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert {t["key"]["op"] for t in payload["trends"]} == {"gpu-flat", "cpu-flat"}
    assert all(t["changes"] == [] for t in payload["trends"])
    assert main(["history", "nothing-like-it", "--db", store.path]) == 2
    assert "no stored benchmark matches 'nothing-like-it'" in capsys.readouterr().err


def test_the_report_lists_the_steps_first_and_every_keys_line_and_opens_fast_in_chromium(store, tmp_path):
    """The page people open: at 1000 runs, one file, the changes table before the sparklines,
    rendered by real Chromium in under 2 s; its screenshot kept under tests/build/test-artifacts."""
    from helpers import ARTIFACTS, open_in_chromium
    from perfloop.results.report import render_html

    page = render_html(store, tmp_path / "report")
    text = page.read_text()
    assert text.index("id='changes'") < text.index("class='trend'")
    first = text[text.index("class='change'") :][:400]
    assert "cpu-30pct" in first and "slower" in first  # the largest regression leads
    assert len(text) < 1_500_000, len(text)
    shot = ARTIFACTS / "history-report.png"
    attrs = open_in_chromium(page, tmp_path, shot)
    assert attrs["data-sparklines"] == len(PLANTED)
    planted = sum(1 for _, _, step, at in PLANTED.values() if at is not None and abs(math.log(step)) >= 0.045)
    assert attrs["data-changes"] >= planted
    assert attrs["data-load-ms"] < 2000, attrs
    from PIL import Image

    img = Image.open(shot).convert("RGB").resize((120, 180))
    colors = {img.getpixel((x, y)) for x in range(120) for y in range(180)}
    assert len(colors) > 20  # drawn, not a blank page


def test_the_reference_workloads_rows_are_no_trend_of_their_own(tmp_path, capsys):
    """A run keeps the reference workload beside its benchmarks (the gate divides the machine's
    drift out with it): history said it as a benchmark named '_reference' (issue 52)."""
    from perfloop.harness.gate import REFERENCE_OP

    s = Store(tmp_path / "h.db")
    for k in range(3):
        run = s.new_run("test")
        s.add(
            run,
            Measurement(samples_ms=(1.0 + k / 100, 1.01, 0.99)),
            op="gelu",
            variant="v",
            shape=(4,),
            dtype="fp32",
        )
        s.add(
            run, Measurement(samples_ms=(2.0, 2.01, 1.99)), op=REFERENCE_OP, variant="ref", shape=(), dtype=""
        )
    [t] = trends(s)
    assert t.key[0] == "gelu" and all(p.reference_ms == pytest.approx(2.0) for p in t.points)
    assert main(["history", "--db", str(tmp_path / "h.db"), "--json"]) == 0
    ops = [tr["key"]["op"] for tr in json.loads(capsys.readouterr().out)["trends"]]
    assert ops == ["gelu"]
