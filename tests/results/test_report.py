"""`perfloop demo` end to end on the CPU, and its HTML report opened in real Chromium."""

import html
import re

import pytest

import perfloop as pl
from helpers import ARTIFACTS, open_in_chromium
from perfloop.cli import main
from perfloop.results.report import render_html
from perfloop.results.store import Store


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    db, out = d / "demo.db", d / "report"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["demo", "--db", str(db), "--out", str(out)])
    return rc, buf.getvalue(), db, out


def test_demo_runs_the_whole_loop_and_keeps_it(demo):
    rc, text, db, out = demo
    assert rc == 0
    for step in ("2. locate", "3. fix", "measure again", "5. kept"):
        assert step in text
    assert "memory-bound" in text  # the diagnosis of the naive GELU
    m = re.search(r"(\w+) is ([\d.]+)x faster than naive \(95% CI ([\d.]+)-([\d.]+)\)", text)
    assert m, text[-2000:]
    assert float(m[3]) <= float(m[2]) <= float(m[4])
    s = Store(db)
    variants = {r["variant"] for r in s.rows()}
    assert {"naive", "builtin", "compiled"} <= variants
    assert {a["variant"] for a in s.artifacts(kind="profile")} >= {"naive"}
    assert (out / "index.html").exists()


def test_report_escapes_names_from_outside(tmp_path):
    s = Store(tmp_path / "x.db")
    run = s.new_run("x")
    evil = "<script>alert(1)</script>"
    s.add(run, pl.Measurement(samples_ms=(1.0, 1.2, 1.1)), op=evil, variant="v&v", shape=(4,), dtype="fp32")
    page = render_html(s, tmp_path / "rep").read_text()
    assert evil not in page and html.escape(evil) in page and "v&amp;v" in page


def test_report_renders_in_headless_chromium(demo, tmp_path):
    shot = ARTIFACTS / "report.png"
    attrs = open_in_chromium(demo[3] / "index.html", tmp_path, shot)
    assert attrs["data-tables"] >= 3
    assert attrs["data-images"] >= 2
    assert attrs["data-images-ok"] == attrs["data-images"]  # every plot decoded and drawn
    assert shot.exists() and shot.stat().st_size > 20_000
    assert attrs["data-toc"] >= 3 and attrs["data-toc-ok"] == attrs["data-toc"]  # every entry lands
    assert list((demo[3]).glob("*_samples.png"))  # each op's stored samples, as a distribution
    narrow = open_in_chromium(
        demo[3] / "index.html", tmp_path / "narrow", ARTIFACTS / "report-narrow.png", 420
    )
    assert narrow["data-overflow"] == 0  # a phone's width: tables scroll inside, the page does not


def test_a_profile_whose_diagnosis_is_a_steps_renders(tmp_path):
    """Under load the demo's naive GELU once got a step's diagnosis (no op recorded: a note, no
    evidence) and the report died on KeyError 'advice'."""
    from perfloop.analysis.findings import Diagnosis

    s = Store(tmp_path / "x.db")
    run = s.new_run("x")
    s.add(
        run, pl.Measurement(samples_ms=(1.0, 1.2, 1.1)), op="gelu", variant="naive", shape=(4,), dtype="fp32"
    )
    d = Diagnosis([], 1.0, 0.0, 0.0, note="the calls ran no torch op the profiler recorded")
    s.add_artifact(run, "profile", {"kernels": [], "diagnosis": d.to_dict()}, op="gelu", variant="naive")
    page = render_html(s, tmp_path / "rep").read_text()
    assert "the calls ran no torch op the profiler recorded" in page


def test_the_page_says_what_the_terminal_says_in_columns_with_warnings_runs_and_commit(tmp_path):
    """The op table in columns rounded as the CLI rounds them, each stored warning beside the time
    it qualifies, the runs the numbers came from, and no `git None` (issue 37)."""
    from perfloop.harness.measurement import Work

    s = Store(tmp_path / "x.db")
    contended = "contended: other processes used ~1.9 of 2 CPU cores while this was timed"
    run = s.new_run("perfloop bench gelu", {"git": "", "device": {"name": "AMD EPYC"}})
    env = {"git": None, "device": {"name": "AMD EPYC"}}
    samples = (0.44266, 0.45, 0.44, 0.46, 0.443)  # median 0.443 ms
    m = pl.Measurement(samples_ms=samples, work=Work(bytes=2.2e6), extra_warnings=(contended,), env=env)
    s.add(run, m, op="gelu", variant="triton", shape=(1024, 1024), dtype="fp32")
    page = render_html(s, tmp_path / "rep").read_text()
    row = re.search(r"<tr><td>triton</td><td>fp32</td><td>1024x1024</td>(.*?)</tr>", page, re.S)
    assert row, page[-3000:]
    cells = re.findall(r"<td>(.*?)</td>", row[1], re.S)
    assert cells[0].startswith("443.00 us") and "contended" in cells[0]  # the caveat beside the time
    assert cells[2] == "5"  # GB/s as the CLI rounds it, in its own column
    assert "1 result(s), the newest of each op, variant, shape and dtype, from 1 run(s)" in page
    assert "perfloop bench gelu" in page and run in page  # the runs list
    assert "None" not in page and "no commit recorded" in page


def test_slow_rates_and_a_diagnosis_evidence_read_as_people_read_them(tmp_path):
    """issue 52: a CPU's rate printed as "0 GB/s"; the diagnosis' evidence as a raw dict of
    16-digit floats."""
    s = Store(tmp_path / "x.db")
    run = s.new_run("x")
    m = pl.Measurement(samples_ms=(2.0, 2.2, 2.1), work=pl.Work(bytes=900_000, flops=0))
    s.add(run, m, op="gelu", variant="naive", shape=(4,), dtype="fp32")
    d = {"bound": "memory", "advice": "fuse it", "evidence": {"gbps": 0.428571428571428571, "launches": 3}}
    s.add_artifact(run, "profile", {"kernels": [], "diagnosis": d}, op="gelu", variant="naive")
    page = render_html(s, tmp_path / "rep").read_text()
    assert f"{m.gbps:.2g}" in page and m.gbps < 1  # 0.43, not 0
    assert "0.4286" in page and "0.428571428" not in page
    assert "<td>launches</td>" in page.replace(" ", "")


def test_log_axes_spanning_less_than_a_decade_are_labelled_in_plain_numbers(tmp_path, monkeypatch):
    """issue 52: times of 11-19 ms on a log axis were labelled "1.1x10^1" ... in mathtext."""
    import matplotlib.pyplot as plt

    from perfloop.results.plots import plot_lines

    drawn = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (drawn.append(fig), close(fig)))
    plot_lines(tmp_path / "t.png", "t", "n", "ms", {"a": ([1e3, 1e4, 1e5], [11.0, 14.0, 19.0])})
    fig = drawn[0]
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].yaxis.get_ticklabels(which="both") if t.get_text()]
    assert labels and not any("times" in x or "^" in x for x in labels), labels
    assert {"12", "15"} & set(labels), labels
