"""Naming the commit that made a step: time the commits between a fast one and a slow one with
the user's command, each in its own `git worktree` (the user's checkout is never touched), and
binary-search for the first slow one.

Every timed commit runs interleaved with the fast commit, round by round in a fresh order, so
the machine's drift hits both alike; its ratio and 95% CI are paired statistics over those
rounds. A commit counts as slow when its ratio lies past the geometric middle of the step (the
step's size from the change point, `expect`, or else from timing the slow end first), and
rounds are added while the CI still straddles that middle.
"""

from __future__ import annotations

import contextlib
import math
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from perfloop.harness import stats

MIN_ROUNDS = 5
MAX_ROUNDS = 15
END_ROUNDS = 40  # the slow end, which says whether there is a step at all, may be sampled longer
NO_STEP = 0.03  # an end whose ratio's CI lies within 3% of 1: no step this command sees


class BisectError(ValueError):
    """What stops a bisection, said for the user: the argument or commit, and what to do."""


@dataclass(frozen=True)
class Timed:
    commit: str
    subject: str
    ratio: float  # this commit's time / the fast commit's (>1: slower)
    ci: tuple[float, float]
    p_value: float
    rounds: int
    slow: bool


@dataclass
class Bisection:
    good: str
    bad: str
    command: str
    candidates: list[str]  # the commits after good, up to and including bad, oldest first
    threshold: float  # a ratio past this counts as slow
    culprit: Timed | None = None
    timed: list[Timed] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "good": self.good,
            "bad": self.bad,
            "command": self.command,
            "candidates": self.candidates,
            "threshold": self.threshold,
            "culprit": self.culprit.__dict__ if self.culprit else None,
            "timed": [t.__dict__ for t in self.timed],
            "timed_commits": len(self.timed) + 1,
            "notes": self.notes,
        }


def _git(repo: Path, *args: str, check: bool = True) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def _resolve(repo: Path, name: str, what: str) -> str:
    rev = name.removesuffix("-dirty")
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0 or not rev:
        raise BisectError(
            f"{what}: {name!r} is not a commit of {repo} (a stored run's commit that was "
            "rebased away or never pushed here?); give one `git log` shows"
        )
    return out.stdout.strip()


def _repo(folder: str | Path) -> Path:
    here = Path(folder).resolve()
    out = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise BisectError(
            f"repo: {here} is not in a git repository; run bisect inside the repository "
            "whose commits made the step"
        )
    return Path(out.stdout.strip())


class _Runner:
    """The command, run in a worktree per commit; one time per run (wall clock, or the number
    the command prints last, in ms)."""

    def __init__(self, repo: Path, command: str, metric: str, timeout_s: float, subdir: Path = Path()):
        self.repo, self.command, self.metric, self.timeout_s = repo, command, metric, timeout_s
        self.subdir = subdir  # where in the repository the user started: the command runs there
        self.root = Path(tempfile.mkdtemp(prefix="perfloop-bisect-"))
        self.trees: dict[str, Path] = {}

    def tree(self, commit: str) -> Path:
        if commit not in self.trees:
            path = self.root / commit[:12]
            _git(self.repo, "worktree", "add", "--detach", "--quiet", str(path), commit)
            self.trees[commit] = path
        return self.trees[commit]

    def once(self, commit: str) -> float:
        where = self.tree(commit) / self.subdir
        if not where.is_dir():
            raise BisectError(
                f"command: {self.subdir} (where bisect was started) is not in {commit[:12]}; "
                "start it from a folder every commit in the range has"
            )
        t0 = time.perf_counter()
        try:
            out = subprocess.run(
                self.command, shell=True, cwd=where, capture_output=True, text=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise BisectError(
                f"command: ran past {self.timeout_s:g} s at {commit[:12]}; raise --timeout or "
                "time a shorter command"
            ) from None
        wall_ms = (time.perf_counter() - t0) * 1e3
        if out.returncode != 0:
            tail = (out.stderr.strip() or out.stdout.strip()).splitlines()[-3:]
            raise BisectError(
                f"command: exited {out.returncode} at {commit[:12]}: {' | '.join(tail)}; "
                "a command that fails at some commits cannot time them"
            )
        if self.metric == "wall":
            return wall_ms
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else ""
        try:
            value = float(last.removesuffix("ms").strip())
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise BisectError(
                f"--metric stdout: the command's last line at {commit[:12]} was "
                f"{last[:60]!r}, not a time in ms > 0; print one, or time the whole "
                "command (--metric wall)"
            )
        return value

    def close(self) -> None:
        for path in self.trees.values():
            _git(self.repo, "worktree", "remove", "--force", str(path), check=False)
        self.trees.clear()
        # a worktree being added when an interrupt came is registered but not yet known here:
        # with its folder gone, prune drops it
        shutil.rmtree(self.root, ignore_errors=True)
        _git(self.repo, "worktree", "prune", check=False)


def _sample(
    run: _Runner, good: str, commit: str, rng: random.Random, decided, most: int
) -> tuple[float, tuple[float, float], float, int]:
    """`commit` against `good`, interleaved round by round in a fresh order: MIN_ROUNDS rounds,
    then more until `decided(ci)` or `most` rounds; (ratio, its 95% CI, p, rounds)."""
    base, cand = [], []
    while True:
        for _ in range(MIN_ROUNDS if not base else 2):
            pair = [(good, base), (commit, cand)]
            rng.shuffle(pair)
            for c, into in pair:
                into.append(run.once(c))
        s = stats.paired_speedup(base, cand)
        ratio, ci = 1 / s["speedup"], (1 / s["ci"][1], 1 / s["ci"][0])
        if decided(ci) or len(base) >= most:
            return ratio, ci, s["p_value"], len(base)


def _time(
    run: _Runner, good: str, commit: str, threshold: float | None, rng: random.Random, slower: bool = True
) -> Timed:
    """`commit` against `good`: more rounds (to MAX_ROUNDS) while the CI straddles the
    threshold; slow when past it the way the step goes (`slower`)."""
    decided = lambda ci: threshold is None or not ci[0] <= threshold <= ci[1]
    ratio, ci, p, rounds = _sample(run, good, commit, rng, decided, MAX_ROUNDS)
    subject = _git(run.repo, "log", "-1", "--format=%s", commit)
    slow = threshold is not None and (ratio > threshold) == slower
    return Timed(commit, subject, ratio, ci, p, rounds, slow)


def _time_end(run: _Runner, good: str, bad: str, expect: float | None, rng: random.Random) -> Timed:
    """The slow end against good, sampled until it decides: with `expect`, until the CI leaves
    the step's middle; without, until it leaves 1 or lies within NO_STEP of it; END_ROUNDS at
    most."""

    def decided(ci) -> bool:
        if expect is not None:
            return not ci[0] <= math.sqrt(expect) <= ci[1]
        return not ci[0] <= 1.0 <= ci[1] or (ci[0] >= 1 - NO_STEP and ci[1] <= 1 + NO_STEP)

    ratio, ci, p, rounds = _sample(run, good, bad, rng, decided, END_ROUNDS)
    return Timed(bad, _git(run.repo, "log", "-1", "--format=%s", bad), ratio, ci, p, rounds, True)


def _check_end(end: Timed, good: str, expect: float | None) -> float:
    """The step's size to bisect for, from the slow end's timing; BisectError where that end is
    not slow, or where its timing cannot tell."""
    span = f"ratio {end.ratio:.3f} [{end.ci[0]:.3f}, {end.ci[1]:.3f}] over {end.rounds} rounds"
    g, b = good[:12], end.commit[:12]
    if expect is None:
        if not end.ci[0] <= 1.0 <= end.ci[1]:
            return end.ratio
        if end.ci[0] >= 1 - NO_STEP and end.ci[1] <= 1 + NO_STEP:
            raise BisectError(
                f"command: it sees no step between {g} and {b} ({span}); nothing to bisect: "
                "time what the change point measured"
            )
        raise BisectError(
            f"command: cannot tell whether it sees a step between {g} and {b} ({span}): its "
            "noise is wider than a step; time a steadier command (--metric stdout with a "
            "number it prints), or give --expect"
        )
    middle = math.sqrt(expect)
    if end.ci[0] <= middle <= end.ci[1]:
        raise BisectError(
            f"command: cannot tell whether bad ({b}) is slow under this command ({span}, the "
            f"step is {expect:.3f}x): its noise is wider than the step; time a steadier "
            "command"
        )
    if (end.ratio > middle) != (expect > 1):
        raise BisectError(
            f"command: bad ({b}) is not {'slow' if expect > 1 else 'fast'} under this command "
            f"({span} against good {g}, where the step is {expect:.3f}x): this command does "
            "not time what the change point measured; nothing to bisect"
        )
    return expect


def bisect(
    good: str,
    bad: str,
    command: str | list[str],
    *,
    repo: str | Path = ".",
    metric: str = "wall",
    expect: float | None = None,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> Bisection:
    """The first commit after `good`, up to `bad`, whose time under `command` is slow.

    >>> b = bisect("v1.0", "HEAD", "python bench.py", metric="stdout", expect=1.3)  # doctest: +SKIP
    >>> b.culprit.commit, b.culprit.ratio  # doctest: +SKIP
    """
    if metric not in ("wall", "stdout"):
        raise BisectError(
            f"metric: 'wall' (the command's wall time) or 'stdout' (the number in ms it prints "
            f"last), got {metric!r}"
        )
    if expect is not None and not (math.isfinite(expect) and expect > 0 and abs(math.log(expect)) > 0.01):
        raise BisectError(
            f"expect: the step's ratio (slow/fast, e.g. 1.3), at least 1% away from 1; got {expect}"
        )
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise BisectError(f"timeout: seconds > 0 per run of the command, got {timeout_s}")
    cmd = command if isinstance(command, str) else (command[0] if len(command) == 1 else shlex.join(command))
    if not cmd.strip():
        raise BisectError("command: empty; give the command that times the code, after `--`")
    where = _repo(repo)
    subdir = Path(repo).resolve().relative_to(where.resolve())
    if _git(where, "status", "--porcelain", "--untracked-files=no"):
        raise BisectError(
            f"{where} has uncommitted changes: commit or stash them first (bisect "
            "times commits, and changes in no commit cannot be among them); nothing was "
            "changed"
        )
    g, b = _resolve(where, good, "good"), _resolve(where, bad, "bad")
    if g == b:
        raise BisectError(f"good and bad: both are {g[:12]}; give the commits either side of the step")
    if subprocess.run(["git", "-C", str(where), "merge-base", "--is-ancestor", g, b], timeout=60).returncode:
        raise BisectError(f"good: {good} is not an ancestor of bad ({bad}); give the older commit as good")
    candidates = _git(where, "rev-list", "--first-parent", "--reverse", f"{g}..{b}").split()
    out = Bisection(g, b, cmd, candidates, threshold=math.nan)
    rng = random.Random(seed)
    run = _Runner(where, cmd, metric, timeout_s, subdir)
    try:
        with _terminated_as_interrupt():
            _search(run, out, g, candidates, expect, rng)
    finally:
        run.close()
    return out


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM (what `timeout` and CI runners send) ends the bisection as Ctrl-C does: through
    the cleanup of its worktrees."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _search(
    run: _Runner, out: Bisection, g: str, candidates: list[str], expect: float | None, rng: random.Random
) -> None:
    """The slow end timed first (is there a step, and how large), then binary search."""
    end = _time_end(run, g, out.bad, expect, rng)
    out.timed.append(end)
    expect = _check_end(end, g, expect)
    out.threshold = math.sqrt(expect)
    slower = expect > 1
    known = {t.commit: t for t in out.timed}
    lo, hi = -1, len(candidates) - 1  # candidates[hi] is slow; lo = -1 stands for good
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = _time(run, g, candidates[mid], out.threshold, rng, slower)
        out.timed.append(t)
        known[t.commit] = t
        lo, hi = (lo, mid) if t.slow else (mid, hi)
    culprit = known.get(candidates[hi]) or _time(run, g, candidates[hi], out.threshold, rng, slower)
    if culprit.commit not in {t.commit for t in out.timed}:
        out.timed.append(culprit)
    out.culprit = culprit
    if culprit.ci[0] <= 1.0 <= culprit.ci[1]:
        out.notes.append(
            f"{culprit.commit[:12]}'s ratio CI holds 1: the step may be spread over several "
            "commits, or smaller than this command's noise"
        )
