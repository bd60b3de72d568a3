"""A benchmark's history: its median over the runs, in the order they were taken, grouped by the
commit each ran at, and the steps in that line (change points) with their size, confidence and
the commits they fall between.

Runs the harness flagged as contended (other processes took CPU while they were timed) are left
out of the fit and said, unless too few quiet runs remain; where every fitted run stored a
reference workload timed beside it and dividing by it steadies the line, the line is divided
(the machine's drift cancels). The change points come from binary segmentation on log times:
the best split of a segment is the one, between two commits, whose sides' medians differ most
in units of their standard error, where each run's own noise (its 95% CI) and the noise between
runs (from successive differences, robust to the steps themselves) both count. A split is kept
when that z exceeds a bound that grows with the number of splits tried (Bonferroni at alpha =
0.001) and the runs right next to it agree (their medians step the same way); each side is then
split again. A step's size and direction are the ratio of the medians either side: one wild run
moves a mean, not a median. No fixed percentage: a 3% step stands out on a GPU's 0.5% noise and
a 10% one drowns in a loaded CPU's 15%.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from statistics import NormalDist, median

ALPHA = 0.001
MIN_SIDE = 3  # runs on each side of a change point
MEDIAN_SE = math.sqrt(math.pi / 2)  # a median's standard error over a mean's, for normal noise
HAMPEL = 4.0  # noise sigmas from the running median beyond which a run is pulled in


@dataclass(frozen=True)
class Point:
    run_id: str
    created: str
    commit: str  # "" when the run recorded none
    median_ms: float
    ci_ms: tuple[float, float]
    contended: bool = False  # the harness flagged the run: other processes took CPU meanwhile
    reference_ms: float | None = None  # the reference workload's median in the same run


@dataclass(frozen=True)
class Change:
    at: int  # index (in the trend's points) of the first fitted point after the step
    ratio: float  # after / before, medians (>1: slower)
    z: float  # the step in standard errors
    p_value: float  # Bonferroni-adjusted
    before: str  # the last commit before the step
    after: str  # the first commit after it

    def __str__(self) -> str:
        word = "slower" if self.ratio > 1 else "faster"
        p = f"p {fmt_p(self.p_value)}"
        return (
            f"{self.ratio:.3f}x ({word}) between {self.before or '?'} and {self.after or '?'}: "
            f"{self.z:.1f} standard errors, {p}"
        )


def fmt_p(p: float) -> str:
    """A p-value to one digit; under 1e-6 said so (one digit would read 0)."""
    return f"{p:.1g}" if p >= 1e-6 else "< 1e-6"


@dataclass
class Trend:
    key: tuple  # (op, variant, shape, dtype, device)
    points: list[Point]
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    left_out: list[int] = field(default_factory=list)  # indices of points not fitted (contended)
    divided: bool = False  # the fit ran on times divided by each run's reference workload
    repo: str | None = None  # the git repository bisect would check the commits out of
    gone: set[str] = field(default_factory=set)  # commits of the line that repository no longer holds

    def to_dict(self) -> dict:
        return {
            "key": dict(zip(KEY_FIELDS, self.key, strict=True)),
            "points": [
                p.__dict__ | {"ci_ms": list(p.ci_ms), "left_out": i in self.left_out}
                for i, p in enumerate(self.points)
            ],
            "changes": [c.__dict__ for c in self.changes],
            "notes": self.notes,
            "left_out": len(self.left_out),
            "divided_by_reference": self.divided,
            "bisect": bisect_command(self),
        }


KEY_FIELDS = ("op", "variant", "shape", "dtype", "device")


def key_of(row: dict) -> tuple:
    return tuple(row.get(k) or "" for k in KEY_FIELDS)


def key_text(key: tuple) -> str:
    """A key as `history`, `bisect --key` and the report write it: its fields joined by '/',
    empty ones kept (`test:step/pytest///AMD EPYC`), so it matches the stored key."""
    return "/".join(key).rstrip("/")


def bisect_command(t: Trend, change: int = -1) -> str | None:
    """The command that names the commit behind one of the trend's steps (default: the last);
    None where bisect could not run it: no such step, a commit not recorded, a step between a
    commit and its own uncommitted state (-dirty), or a commit the trend's repository does not
    hold. `history`, the report and --json all print this line."""
    if not -len(t.changes) <= change < len(t.changes):
        return None
    c = t.changes[change]
    ends = (c.before.removesuffix("-dirty"), c.after.removesuffix("-dirty"))
    if not all(ends) or ends[0] == ends[1]:
        return None
    if set(ends) & t.gone:
        return None
    which = "" if change % len(t.changes) == len(t.changes) - 1 else f" --change {change % len(t.changes)}"
    return f"perfloop bisect --key {shlex.quote(key_text(t.key))}{which} -- COMMAND"


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
    differs from that of the runs just before by half the step or more, the same way."""
    w = 2 * MIN_SIDE
    near = median(logs[k : min(hi, k + w)]) - median(logs[max(lo, k - w) : k])
    return near * d > 0 and abs(near) >= abs(d) / 2


@dataclass(frozen=True)
class Line:
    """What the fit runs on: the fitted points' indices, their log times (divided by the
    reference where that steadied them), each run's own noise and the noise between runs."""

    index: list[int]
    logs: list[float]
    filtered: list[float]  # the logs with wild runs pulled to the running median (_hampel)
    own: list[float]
    tau: float
    divided: bool
    left_out: list[int]


def fitted_line(points: list[Point]) -> Line:
    """The runs to fit (contended ones left out while 2 * MIN_SIDE quiet runs remain) and their
    log times, divided by each run's reference workload where every fitted run has one and the
    division narrows the run-to-run noise."""
    quiet = [i for i, p in enumerate(points) if not p.contended]
    index = quiet if len(quiet) >= 2 * MIN_SIDE else list(range(len(points)))
    left_out = sorted(set(range(len(points))) - set(index))
    raw = [math.log(points[i].median_ms) for i in index]
    tau, divided_out = _between(raw), False
    if index and all(points[i].reference_ms for i in index):
        divided = [x - math.log(points[i].reference_ms) for x, i in zip(raw, index, strict=True)]
        if _between(divided) < tau:
            raw, tau, divided_out = divided, _between(divided), True
    own = [_sigma(points[i]) for i in index]
    return Line(index, raw, _hampel(raw, tau, own), own, tau, divided_out, left_out)


def _split_z(line: Line, lo: int, k: int, hi: int) -> float:
    """The step at k in [lo, hi) in standard errors: the difference of the sides' means of the
    filtered logs (a mean locates a step to the run; a median is flat around it)."""
    left, right = line.filtered[lo:k], line.filtered[k:hi]
    var = [line.tau**2 + s**2 for s in line.own[lo:hi]]
    se = math.sqrt(sum(var[: k - lo]) / len(left) ** 2 + sum(var[k - lo :]) / len(right) ** 2)
    d = sum(right) / len(right) - sum(left) / len(left)
    return abs(d) / se if se > 0 else 0.0


def _hampel(logs: list[float], tau: float, own: list[float]) -> list[float]:
    """Each log time pulled to within HAMPEL noise sigmas of the median of the runs around it
    (MIN_SIDE each side): an unflagged wild run cannot move a side's mean, a step (which the
    running median follows) is kept."""
    out = []
    for i, x in enumerate(logs):
        around = median(logs[max(0, i - MIN_SIDE) : i + MIN_SIDE + 1])
        limit = HAMPEL * math.sqrt(tau**2 + own[i] ** 2)
        out.append(min(max(x, around - limit), around + limit))
    return out


def change_points(points: list[Point], alpha: float = ALPHA, line: Line | None = None) -> list[Change]:
    """The steps in a line of runs (binary segmentation; see the module's docstring)."""
    line = line or fitted_line(points)
    pts = [points[i] for i in line.index]
    # runs at one commit measure one code: a step can only fall between commits (where known)
    known = all(p.commit for p in pts)
    between = {k for k in range(1, len(pts)) if not known or pts[k].commit != pts[k - 1].commit}
    tried = max(sum(1 for k in between if MIN_SIDE <= k <= len(pts) - MIN_SIDE), 1)
    bound = NormalDist().inv_cdf(1 - alpha / (2 * tried))
    found: list[tuple[int, float, float]] = []

    def split(lo: int, hi: int) -> None:
        best = None
        for k in range(lo + MIN_SIDE, hi - MIN_SIDE + 1):
            if k in between:
                z = _split_z(line, lo, k, hi)
                if best is None or z > best[1]:
                    best = (k, z)
        if not best or best[1] <= bound:
            return
        k = best[0]
        d = median(line.logs[k:hi]) - median(line.logs[lo:k])
        if _persists(line.logs, lo, k, hi, d):
            found.append((k, best[1], d))  # sized again below, between its final neighbours
            split(lo, k)
            split(k, hi)

    split(0, len(pts))
    cuts = [0, *sorted(k for k, _, _ in found), len(pts)]
    out = []
    for i, k in enumerate(cuts[1:-1], start=1):  # sized between the neighbouring steps, by medians
        lo, hi = cuts[i - 1], cuts[i + 1]
        d = median(line.logs[k:hi]) - median(line.logs[lo:k])
        z = _split_z(line, lo, k, hi)
        p = min(1.0, 2 * (1 - NormalDist().cdf(z)) * tried)
        out.append(Change(line.index[k], math.exp(d), z, p, pts[k - 1].commit, pts[k].commit))
    return out


def latest_off_line(
    points: list[Point], changes: list[Change], alpha: float = ALPHA, line: Line | None = None
) -> str | None:
    """A note when the newest fitted run or two sit off the line before them by more than noise:
    a step too new to call (it needs MIN_SIDE runs after it)."""
    line = line or fitted_line(points)
    start = line.index.index(changes[-1].at) if changes else 0
    logs, own = line.logs[start:], line.own[start:]
    bound = NormalDist().inv_cdf(1 - alpha / 2)
    for k in range(MIN_SIDE - 1, 0, -1):
        body, tail = logs[:-k], logs[-k:]
        if len(body) < MIN_SIDE:
            continue
        var = [line.tau**2 + s**2 for s in own]
        se = math.sqrt(MEDIAN_SE**2 * sum(var[:-k]) / len(body) ** 2 + sum(var[-k:]) / k**2)
        level = median(body)
        d = sum(tail) / k - level
        same_way = all((x - level) * d > 0 for x in tail)
        if se > 0 and abs(d) / se > bound and same_way:
            return (
                f"the latest {k} run(s) read {math.exp(d):.3f}x the line before them "
                f"({abs(d) / se:.1f} standard errors): a step there is called once {MIN_SIDE} runs "
                "follow it; run again"
            )
    return None


def missing_commits(points: list[Point], repo: str | None) -> set[str]:
    """The distinct commits of the line `repo` does not hold (rebased away, another clone);
    none when it holds none of them (then it is not this line's repository)."""
    import subprocess

    commits = {p.commit.removesuffix("-dirty") for p in points if p.commit}
    if not repo or not commits:
        return set()
    asked = sorted(commits)
    try:  # one git process for all of them: each answered "<sha> commit <size>" or "<name> missing"
        out = subprocess.run(
            ["git", "-C", repo, "cat-file", "--batch-check"],
            capture_output=True,
            text=True,
            input="".join(f"{c}^{{commit}}\n" for c in asked),
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    answers = out.stdout.splitlines() if out.returncode == 0 else []
    held = {c for c, a in zip(asked, answers, strict=False) if a.split()[1:2] == ["commit"]}
    return commits - held if held else set()


def _contended(row: dict) -> bool:
    from perfloop.harness.gate import contended

    warned = any(str(w).startswith("contended") for w in row.get("warnings") or [])
    return warned or contended(row.get("meta"))


def _reference_ms(row: dict, stored: dict[str, float]) -> float | None:
    """The median of the reference workload timed in the row's run: beside it (the pytest
    plugin keeps its samples in the row) or as the run's own reference row (bench, sweep)."""
    samples = (row.get("meta") or {}).get("reference_samples_ms")
    if isinstance(samples, list) and samples and all(isinstance(x, (int, float)) and x > 0 for x in samples):
        return float(median(samples))
    return stored.get(row["run_id"])


def trends(store, key_filter: str = "", repo: str | None = None) -> list[Trend]:
    """Every benchmark's trend in the store (each key on one device), whose key contains
    `key_filter` (its fields joined by '/'); changes found where there are enough runs; with
    `repo`, a note of the commits that repository no longer holds."""
    from perfloop.harness.gate import REFERENCE_OP

    rows = store.rows()
    stored_refs = {
        r["run_id"]: r["median_ms"] for r in rows if r["op"] == REFERENCE_OP and r["median_ms"] > 0
    }
    by_key: dict = {}
    for row in rows:
        k = key_of(row)
        if row["op"] == REFERENCE_OP or (key_filter and key_filter not in "/".join(k)):
            continue  # the reference workload divides the others' drift out; it is no benchmark
        if not (isinstance(row["median_ms"], (int, float)) and row["median_ms"] > 0):
            store.skipped.append(
                f"row {row.get('id')} ({key_text(k)}): median {row['median_ms']!r} ms, not a time"
            )
            continue
        env = row.get("env") or {}
        point = Point(
            row["run_id"],
            row["created"],
            env.get("git") or "",
            row["median_ms"],
            (row.get("ci_lo_ms") or 0.0, row.get("ci_hi_ms") or 0.0),
            _contended(row),
            _reference_ms(row, stored_refs),
        )
        by_key.setdefault(k, []).append(point)
    return [_trend(k, points, repo) for k, points in sorted(by_key.items())]


def _trend(key: tuple, points: list[Point], repo: str | None) -> Trend:
    t = Trend(key, points, repo=repo)
    line = fitted_line(points)
    t.left_out, t.divided = line.left_out, line.divided
    if t.left_out:
        t.notes.append(
            f"{len(t.left_out)} of {len(points)} run(s) left out of the fit: contended (other "
            "processes took CPU while they were timed)"
        )
    elif any(p.contended for p in points):
        t.notes.append(
            f"{sum(p.contended for p in points)} run(s) contended, kept: too few quiet runs to "
            "fit without them; medians weigh them down"
        )
    if len(line.index) < 2 * MIN_SIDE:
        t.notes.append(f"{len(line.index)} run(s) fitted: a change point needs {2 * MIN_SIDE} or more")
    else:
        t.changes = change_points(points, line=line)
        edge = latest_off_line(points, t.changes, line=line)
        if edge:
            t.notes.append(edge)
    if t.divided:
        t.notes.append(
            "fitted on times divided by each run's reference workload (it followed the "
            "machine's drift): steps are the code's"
        )
    t.gone = missing_commits(points, repo)
    if t.gone:
        t.notes.append(
            f"{len(t.gone)} commit(s) of these runs are not in {repo} (rebased away, or another "
            "clone): bisect cannot check them out"
        )
    unknown = sum(1 for p in points if not p.commit)
    if unknown:
        t.notes.append(f"{unknown} run(s) recorded no commit (not in a git working tree)")
    dirty = sum(1 for p in points if p.commit.endswith("-dirty"))
    if dirty:
        t.notes.append(f"{dirty} run(s) at a commit with uncommitted changes (-dirty)")
    return t
