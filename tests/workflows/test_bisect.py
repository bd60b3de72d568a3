"""Bisection (issue 26): a real repository of 16 commits, one of which makes a function 1.3x
slower; the commit is named from timings of the command at the commits in between, each in its
own worktree, and the user's checkout is left as it was."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perfloop.cli import main
from perfloop.workflows.bisect import BisectError, bisect

# sleep-based work: its time does not depend on how busy the machine's cores are
WORK = "import time\n\nDELAY_S = {delay}\n\n\ndef step():\n    time.sleep(DELAY_S)\n"
BENCH = """import time
import work

best = float("inf")
for _ in range(3):
    t0 = time.perf_counter()
    work.step()
    best = min(best, (time.perf_counter() - t0) * 1e3)
print("timing work.step")
print(best)
"""


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def git_env(monkeypatch):
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "perfloop test")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "test@perfloop.invalid")


def _repo(path, n=16, slow_at=9, delay=0.02, ratio=1.3):
    """n commits; from commit `slow_at` on, work.step sleeps `ratio` times longer."""
    path.mkdir()
    _git(path, "init", "-q", "-b", "main")
    commits = []
    for i in range(n):
        d = delay * (ratio if i >= slow_at else 1.0)
        (path / "work.py").write_text(WORK.format(delay=round(d, 6)))
        (path / "bench.py").write_text(BENCH)
        (path / "NOTES.txt").write_text(f"note {i}\n")
        _git(path, "add", "-A")
        subject = "make step slower" if i == slow_at else f"tidy {i}"
        _git(path, "commit", "-q", "-m", subject)
        commits.append(_git(path, "rev-parse", "HEAD").strip())
    return commits


def _state(repo):
    return (
        _git(repo, "rev-parse", "HEAD"),
        _git(repo, "status", "--porcelain"),
        _git(repo, "worktree", "list"),
    )


def test_the_commit_that_slowed_a_function_is_named_in_at_most_6_timed_commits(tmp_path, git_env):
    repo = tmp_path / "r"
    commits = _repo(repo)
    before = _state(repo)
    cmd = f"{sys.executable} bench.py"
    b = bisect(commits[0], commits[-1], cmd, repo=repo, metric="stdout", expect=1.3)  # the change point's
    assert b.culprit.commit == commits[9] and b.culprit.subject == "make step slower"
    assert b.culprit.ratio == pytest.approx(1.3, rel=0.1) and b.culprit.ci[0] > 1.1, b.culprit
    # the slow end (checked slow first), four probes of the 15 between, and the fast commit
    assert len(b.timed) + 1 <= 6, [t.commit[:7] for t in b.timed]
    assert all(t.slow == (commits.index(t.commit) >= 9) for t in b.timed)
    assert _state(repo) == before  # the checkout, its files and its worktrees as they were


@pytest.mark.slow
def test_without_the_steps_size_the_slow_end_is_timed_first_and_its_wall_time_used(tmp_path, git_env):
    repo = tmp_path / "r"
    commits = _repo(repo, n=5, slow_at=3, delay=0.06, ratio=1.5)
    b = bisect(commits[0], commits[-1], [sys.executable, "bench.py"], repo=repo)  # wall time, list form
    assert b.culprit.commit == commits[3]
    assert b.timed[0].commit == commits[-1] and b.timed[0].ratio > 1.2 and b.timed[0].slow  # the slow end
    assert b.threshold == pytest.approx(b.timed[0].ratio ** 0.5)


def test_the_cli_takes_good_bad_and_the_step_from_a_stored_change_point(tmp_path, git_env, capsys):
    """Nightly runs at the first and last of 8 commits step 1.3x; `--key` bisects between them."""
    import random

    from perfloop.harness.measurement import Measurement
    from perfloop.results.store import Store

    repo = tmp_path / "r"
    commits = _repo(repo, n=8, slow_at=3)
    store, rng = Store(tmp_path / "runs.db"), random.Random(1)
    for commit, level in [(commits[0], 1.0)] * 4 + [(commits[-1], 1.3)] * 4:
        samples = tuple(level * 20 * (1 + 0.01 * rng.gauss(0, 1)) for _ in range(15))
        m = Measurement(samples_ms=samples, env={"git": commit[:12]})
        store.add(store.new_run("night"), m, op="step", variant="v", shape=(1,), dtype="fp32")
    assert main(["history", "step", "--db", str(tmp_path / "runs.db")]) == 0
    assert "perfloop bisect --key step/v/1/fp32" in capsys.readouterr().out
    rc = main(
        [
            "bisect",
            "--key",
            "step",
            "--db",
            str(tmp_path / "runs.db"),
            "--repo",
            str(repo),
            "--metric",
            "stdout",
            "--json",
            "--",
            sys.executable,
            "bench.py",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["good"] == commits[0] and out["bad"] == commits[-1]
    assert out["threshold"] == pytest.approx(1.3**0.5, rel=0.02)  # the change point's size, halved in log
    assert out["culprit"]["commit"] == commits[3] and out["timed_commits"] <= 5


@pytest.mark.parametrize(
    "case, says",
    [
        ("dirty", "uncommitted changes: commit or stash them first"),
        ("unknown", "good: 'deadbeef1234' is not a commit"),
        ("reversed", "is not an ancestor of bad"),
        ("fails", "command: exited 3 at"),
        ("not-a-number", "--metric stdout: the command's last line at"),
        ("no-step", "it sees no step between"),
    ],
)
def test_bad_input_is_said_plainly_and_nothing_is_altered(tmp_path, git_env, case, says):
    repo = tmp_path / "r"
    commits = _repo(repo, n=4, slow_at=2, delay=0.005)
    good, bad, cmd, metric = commits[0], commits[-1], f"{sys.executable} bench.py", "stdout"
    if case == "dirty":
        (repo / "work.py").write_text("# mine\n")
    elif case == "unknown":
        good = "deadbeef1234"
    elif case == "reversed":
        good, bad = bad, good
    elif case == "fails":
        cmd = f"{sys.executable} -c 'import sys; sys.exit(3)'"
    elif case == "not-a-number":
        cmd = "echo done"
    elif case == "no-step":
        cmd, metric = f"{sys.executable} -c 'print(5.0)'", "stdout"
    before = _state(repo)
    with pytest.raises(BisectError, match=None) as e:
        bisect(good, bad, cmd, repo=repo, metric=metric)
    assert says in str(e.value), str(e.value)
    assert _state(repo) == before
    if case == "dirty":
        assert (repo / "work.py").read_text() == "# mine\n"


def test_outside_a_git_repository_the_cli_says_so_with_exit_2(tmp_path, capsys):
    rc = main(["bisect", "a", "b", "--repo", str(tmp_path), "--", "true"])
    assert rc == 2
    assert "is not in a git repository" in capsys.readouterr().err


def test_the_bisect_line_history_and_the_report_print_runs_as_printed(tmp_path, git_env, capsys, monkeypatch):
    """A pytest-plugin key has empty shape and dtype fields: the printed line must match it."""
    import html
    import random
    import re
    import shlex

    from perfloop.harness.measurement import Measurement
    from perfloop.results.store import Store

    repo = tmp_path / "r"
    commits = _repo(repo, n=6, slow_at=3)
    db = str(tmp_path / "runs.db")
    store, rng = Store(db), random.Random(2)
    for commit, level in [(commits[0], 1.0)] * 4 + [(commits[-1], 1.3)] * 4:
        samples = tuple(level * 20 * (1 + 0.01 * rng.gauss(0, 1)) for _ in range(15))
        m = Measurement(samples_ms=samples, env={"git": commit[:12], "device": {"name": "AMD EPYC 7B13"}})
        store.add(
            store.new_run("pytest --perfloop-db"),
            m,
            op="test:bench.py::test_step",
            variant="pytest",
            shape=(),
            dtype="",
        )
    monkeypatch.chdir(repo)
    assert main(["history", "test_step", "--db", db]) == 0
    [said] = re.findall(r"name the commit: (perfloop bisect .*? -- COMMAND)", capsys.readouterr().out)
    assert main(["report", "--db", db, "--html", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "index.html").read_text()
    [shown] = [html.unescape(x) for x in re.findall(r"<code>(perfloop bisect [^<]*)</code>", page)]
    assert shown == said and "'test:bench.py::test_step/pytest///AMD EPYC 7B13'" in said
    argv = shlex.split(said)[1:]
    argv = argv[: argv.index("--")] + [
        "--db",
        db,
        "--metric",
        "stdout",
        "--json",
        "--",
        sys.executable,
        "bench.py",
    ]
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["culprit"]["commit"] == commits[3]


def test_with_expect_the_bad_end_is_timed_and_a_range_without_the_step_is_refused(tmp_path, git_env):
    repo = tmp_path / "r"
    commits = _repo(repo, n=4, slow_at=99, delay=0.005)  # no commit is slow
    cmd = f"{sys.executable} -c 'print(5.0)'"
    with pytest.raises(BisectError) as e:
        bisect(commits[0], commits[-1], cmd, repo=repo, metric="stdout", expect=1.3)
    assert f"bad ({commits[-1][:12]}) is not slow under this command" in str(e.value)
    assert "ratio 1.000" in str(e.value)


@pytest.mark.slow
def test_a_command_too_noisy_to_tell_is_said_so_not_called_stepless(tmp_path, git_env):
    repo = tmp_path / "r"
    commits = _repo(repo, n=3, slow_at=99, delay=0.005)
    counter = tmp_path / "n"
    noisy = (
        f'{sys.executable} -c "import pathlib; p = pathlib.Path({str(counter)!r}); '
        "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
        'print([1.0, 3.0, 1.5, 2.5, 2.0][n % 5])"'
    )
    for expect in (1.3, None):
        with pytest.raises(BisectError) as e:
            bisect(commits[0], commits[-1], noisy, repo=repo, metric="stdout", expect=expect)
        assert "cannot tell" in str(e.value) and "sees no step" not in str(e.value), str(e.value)


def test_started_in_a_subfolder_the_command_runs_in_that_subfolder_and_no_temp_folder_is_left(
    tmp_path, git_env, monkeypatch
):
    import tempfile

    repo = tmp_path / "r"
    (repo / "tools").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    commits = []
    for i in range(5):  # tools/time_it.py prints the step's time: 10 ms, 13 ms from commit 3 on
        (repo / "tools" / "time_it.py").write_text(f"print({13.0 if i >= 3 else 10.0})\n")
        (repo / "NOTES.txt").write_text(f"note {i}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"change {i}")
        commits.append(_git(repo, "rev-parse", "HEAD").strip())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    b = bisect(commits[0], commits[-1], f"{sys.executable} time_it.py", repo=repo / "tools", metric="stdout")
    assert b.culprit.commit == commits[3] and b.culprit.ratio == pytest.approx(1.3)
    assert list(scratch.iterdir()) == []  # its worktrees and the folder that held them removed


def test_sigterm_cleans_up_the_worktrees_as_ctrl_c_does(tmp_path, git_env):
    import os
    import signal
    import time

    repo = tmp_path / "r"
    commits = _repo(repo, n=6, slow_at=3, delay=0.2)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=src)
    argv = [
        "bisect",
        commits[0],
        commits[-1],
        "--repo",
        str(repo),
        "--metric",
        "stdout",
        "--",
        sys.executable,
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "perfloop", *argv, "bench.py"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "perfloop-bisect" not in _git(repo, "worktree", "list"):
        time.sleep(0.1)
    assert "perfloop-bisect" in _git(repo, "worktree", "list")
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    assert "perfloop-bisect" not in _git(repo, "worktree", "list")
    assert list(scratch.iterdir()) == []
