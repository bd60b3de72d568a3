"""`perfloop demo` end to end on the CPU, and its HTML report opened in real Chromium."""

import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import perfloop as pl
from perfloop.cli import main
from perfloop.results.report import render_html
from perfloop.results.store import Store

ARTIFACTS = Path(__file__).resolve().parents[1] / "build" / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


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


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: `make test` should have installed it")
        pytest.skip("chromium not installed (make test installs Debian's package)")
    return exe


def test_report_renders_in_headless_chromium(demo, tmp_path):
    exe = _chromium()
    page = demo[3] / "index.html"
    dom = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'u1'}",
                          "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'(data-[\w-]+)="(\d+)"', body[1]))
    assert int(attrs["data-tables"]) >= 3
    assert int(attrs["data-images"]) >= 2
    assert attrs["data-images-ok"] == attrs["data-images"]  # every plot decoded and drawn
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report.png"
    subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'u2'}",
                    f"--screenshot={shot}", "--window-size=1200,1800", page.as_uri()],
                   capture_output=True, timeout=120)  # fmt: skip
    assert shot.exists() and shot.stat().st_size > 20_000
