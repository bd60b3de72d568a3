"""What starting perfloop costs where it is not used (issue 52): the pytest plugin in a session
that takes no measurement, and the verbs that only read the history, import neither torch nor
scipy (each 1-2 s to import). Checked by what was imported, not by a time: the verdict does not
hang on the machine's load."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
HEAVY = ("torch", "scipy", "perfloop.pytest_plugin")


def _imported(code: str, cwd: Path, db: Path) -> dict:
    probe = code + f"\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    env = dict(os.environ, PYTHONPATH=str(SRC), PERFLOOP_DB=str(db))
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[Path, list[str]]:
    """A history of two runs of one measurement, written by another process."""
    d = tmp_path_factory.mktemp("history")
    code = textwrap.dedent(
        """
        import json, perfloop as pl
        from perfloop.results.store import Store
        s, runs = Store(DB), []
        for k in range(2):
            runs.append(s.new_run("x"))
            m = pl.Measurement(samples_ms=(1.0 + k / 10, 1.1, 1.2, 1.05, 0.98))
            s.add(runs[-1], m, op="gelu", variant="naive", shape=(4,), dtype="fp32")
        print(json.dumps(runs))
        """
    ).replace("DB", repr(str(d / "h.db")))
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
    )
    assert r.returncode == 0, r.stderr
    return d / "h.db", json.loads(r.stdout)


def test_a_pytest_session_that_takes_no_measurement_imports_neither_torch_nor_scipy(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_sum():\n    assert sum([1, 2]) == 3\n")
    code = "import pytest\nassert pytest.main(['-q', '-p', 'no:cacheprovider', 'test_plain.py']) == 0"
    got = _imported(code, tmp_path, tmp_path / "none.db")
    assert got == {"torch": False, "scipy": False, "perfloop.pytest_plugin": True}  # loaded, and light


@pytest.mark.parametrize("verb", [["runs"], ["history", "gelu"], ["report", "--html", "REPORT"]])
def test_the_verbs_that_read_the_history_import_neither_torch_nor_scipy(history, verb, tmp_path):
    db, _ = history
    args = [a.replace("REPORT", str(tmp_path / "report")) for a in verb]
    code = f"from perfloop.cli import main\nassert main({args!r}) in (0, None)"
    got = _imported(code, tmp_path, db)
    assert (got["torch"], got["scipy"]) == (False, False)


def test_compare_imports_no_torch(history, tmp_path):
    """compare judges with scipy's rank test (imported when it judges), never with torch."""
    db, (a, b) = history
    code = f"from perfloop.cli import main\nmain(['compare', {a!r}, {b!r}])"
    assert _imported(code, tmp_path, db)["torch"] is False


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`perfloop runs --json | head -c 1`: the pipe closes under perfloop's output (here 800
    runs); it stops quietly, as cat does, with nothing on stderr (issue 52)."""
    from perfloop.harness.measurement import Measurement
    from perfloop.results.store import Store

    s, m = Store(tmp_path / "many.db"), Measurement(samples_ms=(1.0, 1.1, 0.9))
    for _ in range(800):
        run = s.new_run("a command line long enough to make the listing far larger than a pipe's buffer")
        s.add(run, m, op="gelu", variant="naive", shape=(4,), dtype="fp32")
    env = dict(os.environ, PYTHONPATH=str(SRC), PERFLOOP_DB=str(tmp_path / "many.db"))
    cmd = f"{sys.executable} -m perfloop runs --json --last 800 | head -c 1 >/dev/null"
    r = subprocess.run(
        ["bash", "-c", cmd + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True, env=env
    )
    assert r.stderr == "" and r.returncode == 0, r.stderr[-2000:]
