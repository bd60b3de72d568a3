"""A benchmark's history: its median over the runs, in the order they were taken, grouped by the
commit each ran at, and the steps in that line (change points) with their size, confidence and
the commits they fall between.

The change points come from binary segmentation on log medians: the best split of a segment is
the one, between two commits, whose sides differ most in units of their standard error, where
each run's own noise (its 95% CI) and the noise between runs (from successive differences,
robust to the steps themselves) both count. A split is kept when that z exceeds a bound that
grows with the number of splits tried (Bonferroni at alpha = 0.001) and the runs right next to
it agree (their medians step too: one wild run moves a mean, not a median); each side is then
split again. No fixed percentage: a 3% step stands out on a GPU's 0.5% noise and a 10% one
drowns in a loaded CPU's 15%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist, median

ALPHA = 0.001
MIN_SIDE = 3  # runs on each side of a change point


@dataclass(frozen=True)
class Point:
    run_id: str
    created: str
    commit: str  # "" when the run recorded none
    median_ms: float
    ci_ms: tuple[float, float]


@dataclass(frozen=True)
class Change:
    at: int  # index of the first point after the step
    ratio: float  # after / before (>1: slower)
    z: float  # the step in standard errors
    p_value: float  # Bonferroni-adjusted
    before: str  # the last commit before the step
    after: str  # the first commit after it

    def __str__(self) -> str:
        word = "slower" if self.ratio > 1 else "faster"
        p = f"p {fmt_p(self.p_value)}"
        return (f"{self.ratio:.3f}x ({word}) between {self.before or '?'} and {self.after or '?'}: "
                f"{self.z:.1f} standard errors, {p}")  # fmt: skip


def fmt_p(p: float) -> str:
    """A p-value to one digit; under 1e-6 said so (one digit would read 0)."""
    return f"{p:.1g}" if p >= 1e-6 else "< 1e-6"


@dataclass
class Trend:
    key: tuple  # (op, variant, shape, dtype, device)
    points: list[Point]
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"key": dict(zip(KEY_FIELDS, self.key, strict=True)),
                "points": [p.__dict__ | {"ci_ms": list(p.ci_ms)} for p in self.points],
                "changes": [c.__dict__ for c in self.changes], "notes": self.notes}  # fmt: skip


KEY_FIELDS = ("op", "variant", "shape", "dtype", "device")


def key_of(row: dict) -> tuple:
    return tuple(row.get(k) or "" for k in KEY_FIELDS)


def _sigma(p: Point) -> float:
    """A run's own noise on the log scale, from its 95% CI."""
    lo, hi = p.ci_ms
    if not (lo and hi and lo > 0 and hi >= lo):
        return 0.0
    return (math.log(hi) - math.log(lo)) / (2 * 1.96)


def _between(logs: list[float]) -> float:
    """The run-to-run noise (log scale) from successive differences: a step moves one of them."""
    if len(logs) < 3:
        return 0.0
    diffs = [abs(b - a) for a, b in zip(logs, logs[1:], strict=False)]
    return median(diffs) / (0.6745 * math.sqrt(2))  # MAD of a difference of two: sigma * sqrt(2)


def _persists(logs: list[float], lo: int, k: int, hi: int, d: float) -> bool:
    """Whether the runs next to a step agree with it: the median of the runs just after it
    differs from that of the runs just before by half the step or more, the same way (one wild
    run moves a mean, not a median)."""
    w = 2 * MIN_SIDE
    near = median(logs[k : min(hi, k + w)]) - median(logs[max(lo, k - w) : k])
    return near * d > 0 and abs(near) >= abs(d) / 2


def change_points(points: list[Point], alpha: float = ALPHA) -> list[Change]:
    """The steps in a line of runs (binary segmentation; see the module's docstring)."""
    logs = [math.log(p.median_ms) for p in points]
    own = [_sigma(p) for p in points]
    tau = _between(logs)
    found: list[tuple[int, float, float]] = []
    tried = max(len(points) - 2 * MIN_SIDE + 1, 1)
    bound = NormalDist().inv_cdf(1 - alpha / (2 * tried))

    # runs at one commit measure one code: a step can only fall between commits (where known)
    known = all(p.commit for p in points)
    between = {k for k in range(1, len(points)) if not known or points[k].commit != points[k - 1].commit}

    def split(lo: int, hi: int) -> None:
        best = None
        for k in range(lo + MIN_SIDE, hi - MIN_SIDE + 1):
            if k not in between:
                continue
            left, right = logs[lo:k], logs[k:hi]
            var = [tau**2 + s**2 for s in own[lo:hi]]
            se = math.sqrt(sum(var[: k - lo]) / len(left) ** 2 + sum(var[k - lo :]) / len(right) ** 2)
            if se <= 0:
                continue
            d = sum(right) / len(right) - sum(left) / len(left)
            z = abs(d) / se
            if best is None or z > best[1]:
                best = (k, z, d)
        if best and best[1] > bound and _persists(logs, lo, best[0], hi, best[2]):
            found.append(best)
            split(lo, best[0])
            split(best[0], hi)

    split(0, len(points))
    out = []
    for k, z, d in sorted(found):
        p = min(1.0, 2 * (1 - NormalDist().cdf(z)) * tried)
        out.append(Change(k, math.exp(d), z, p, points[k - 1].commit, points[k].commit))
    return out


def latest_off_line(points: list[Point], changes: list[Change], alpha: float = ALPHA) -> str | None:
    """A note when the newest run or two sit off the line before them by more than noise: a
    step too new to call (it needs MIN_SIDE runs after it)."""
    start = changes[-1].at if changes else 0
    logs = [math.log(p.median_ms) for p in points[start:]]
    own = [_sigma(p) for p in points[start:]]
    tau = _between([math.log(p.median_ms) for p in points])
    bound = NormalDist().inv_cdf(1 - alpha / 2)
    for k in range(MIN_SIDE - 1, 0, -1):
        body, tail = logs[:-k], logs[-k:]
        if len(body) < MIN_SIDE:
            continue
        var = [tau**2 + s**2 for s in own]
        se = math.sqrt(sum(var[:-k]) / len(body) ** 2 + sum(var[-k:]) / k**2)
        d = sum(tail) / k - sum(body) / len(body)
        same_way = all((x - sum(body) / len(body)) * d > 0 for x in tail)
        if se > 0 and abs(d) / se > bound and same_way:
            return (f"the latest {k} run(s) read {math.exp(d):.3f}x the line before them "
                    f"({abs(d) / se:.1f} standard errors): a step there is called once {MIN_SIDE} runs "
                    "follow it; run again")  # fmt: skip
    return None


def missing_commits(points: list[Point], repo: str | None) -> int:
    """How many distinct commits of the line `repo` does not hold (rebased away, another
    clone); 0 when it holds none of them (then it is not this line's repository)."""
    import subprocess

    commits = {p.commit.removesuffix("-dirty") for p in points if p.commit}
    if not repo or not commits:
        return 0
    held = set()
    for c in commits:
        out = subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{c}^{{commit}}"], capture_output=True,
                             timeout=30)  # fmt: skip
        if out.returncode == 0:
            held.add(c)
    return len(commits - held) if held else 0


def trends(store, key_filter: str = "", repo: str | None = None) -> list[Trend]:
    """Every benchmark's trend in the store (each key on one device), whose key contains
    `key_filter` (its fields joined by '/'); changes found where there are enough runs; with
    `repo`, a note of the commits that repository no longer holds."""
    by_key: dict = {}
    for row in store.rows():
        k = key_of(row)
        if key_filter and key_filter not in "/".join(k):
            continue
        env = row.get("env") or {}
        point = Point(row["run_id"], row["created"], env.get("git") or "", row["median_ms"],
                      (row.get("ci_lo_ms") or 0.0, row.get("ci_hi_ms") or 0.0))  # fmt: skip
        by_key.setdefault(k, []).append(point)
    out = []
    for k, points in sorted(by_key.items()):
        t = Trend(k, points)
        if len(points) < 2 * MIN_SIDE:
            t.notes.append(f"{len(points)} run(s): a change point needs {2 * MIN_SIDE} or more")
        else:
            t.changes = change_points(points)
            edge = latest_off_line(points, t.changes)
            if edge:
                t.notes.append(edge)
        gone = missing_commits(points, repo)
        if gone:
            t.notes.append(f"{gone} commit(s) of these runs are not in {repo} (rebased away, or another "
                           "clone): bisect cannot check them out")  # fmt: skip
        unknown = sum(1 for p in points if not p.commit)
        if unknown:
            t.notes.append(f"{unknown} run(s) recorded no commit (not in a git working tree)")
        dirty = sum(1 for p in points if p.commit.endswith("-dirty"))
        if dirty:
            t.notes.append(f"{dirty} run(s) at a commit with uncommitted changes (-dirty)")
        out.append(t)
    return out
