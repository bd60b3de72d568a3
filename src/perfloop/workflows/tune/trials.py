"""A trial (the unchanged script, one candidate or a stack of them), its runs in child
processes, and how its runs are judged: on the loss (verify.judge) and on step time against the
unchanged script's: in the search, over steps (independent_ratio: median ratio, bootstrap CI,
Mann-Whitney); in the confirmation, over runs (runs_ratio), as processes differ."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from perfloop.workflows.tune.candidates import Numerics, get
from perfloop.workflows.tune.runner import run_child
from perfloop.workflows.tune.spec import RunSpec
from perfloop.workflows.tune.verify import Logits, Verdict, judge, judge_tokens

now = time.perf_counter  # the clock runs and budgets are read on


class CheckedOn(str, Enum):
    """What a candidate's run is checked on: a training script's losses, or a generation
    script's (one run with `--range`) greedy tokens."""

    LOSS = "loss"
    TOKENS = "tokens"

    @staticmethod
    def of(spec: RunSpec) -> CheckedOn:
        return CheckedOn.TOKENS if spec.range else CheckedOn.LOSS

    @property
    def key(self) -> str:
        """The child's result that holds it."""
        return "tokens" if self is CheckedOn.TOKENS else "losses"


@dataclass
class Trial:
    names: tuple[str, ...]  # () is the baseline
    runs: list[dict] = field(default_factory=list)  # the search's runs (dropout off where it drops out)
    verdict: Verdict | None = None
    predicted_share: float | None = None  # of the unchanged step, from the diagnosis
    error: str | None = None
    cut: bool = False  # its error is the budget's (a run cut, or not started), not the script's
    stats: dict | None = None  # against the baseline's search runs: speedup, ci, p_value, median_ms
    check: list | None = None  # the losses its verdict reads
    step: dict | None = None  # a stack: its speed-up over its parent, and whether it was taken
    final_runs: list[dict] = field(default_factory=list)  # the confirmation's runs (the script as it is)
    final: dict | None = None  # against the baseline's confirmation runs

    @property
    def label(self) -> str:
        return " + ".join(get(n).name for n in self.names) or "baseline"

    def samples(self, warmup: int, final: bool = False) -> list[float]:
        return [ms for run in self.run_samples(warmup, final) for ms in run]

    def run_samples(self, warmup: int, final: bool = False) -> list[list[float]]:
        """Each run's steady step times (after the warm-up), a list a run."""
        runs = self.final_runs if final else self.runs
        return [list(r["step_ms"][r.get("timed_from", warmup) :]) for r in runs if r.get("ok")]

    @property
    def predicted_ms(self) -> float | None:
        """The predicted saving per step: its share of the unchanged script's median step."""
        if self.predicted_share is None or not self.stats:
            return None
        return self.predicted_share * self.stats["base_ms"]

    @property
    def verified(self) -> bool:
        return bool(self.verdict and self.verdict.ok)

    @property
    def promising(self) -> bool:
        """Verified on the loss (the tokens) and faster than the unchanged script at 95%
        confidence in the search: what is stacked on and confirmed. A run with nothing to check
        (no loss, no logits seen) is not verified."""
        return self.verified and faster(self.stats)

    @property
    def kept(self) -> bool:
        """Verified, and confirmed faster: the confirmation's 95% CI, taken over its runs
        against the unchanged script's interleaved runs, lies above 1. Never on the search's
        figures alone."""
        return self.verified and faster(self.final)

    @property
    def took_s(self) -> float:
        """The longest wall time a run of it took (start-up and compiling included)."""
        return max((r.get("took_s", 0.0) for r in [*self.runs, *self.final_runs]), default=0.0)

    @property
    def rerun_s(self) -> float:
        """What another run of it (or of a stack holding it) takes on this machine: its longest
        run less the C++ builds that run waited for, which the machine keeps."""
        runs = [*self.runs, *self.final_runs]
        return max((r.get("took_s", 0.0) - r.get("builds_s", 0.0) for r in runs), default=0.0)


@dataclass
class Checks:
    """The losses (a generation script's greedy tokens) every verdict compares with: the
    unchanged script's at its seed (`base`), again (`noise`: its own nondeterminism) and at
    another seed (`seeds`; none for tokens). Where the model drops
    out, the search runs with dropout off (`dropout_off`): compiled code draws its masks
    otherwise, so with dropout on a right kernel and a wrong one part alike."""

    dropout_off: bool = False
    tokens: bool = False  # a generation script: the lists are greedy tokens, not losses
    base: list = field(default_factory=list)
    noise: list = field(default_factory=list)
    seeds: list = field(default_factory=list)


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = now(), budget_s

    @property
    def left(self) -> float:
        return self.budget_s - (now() - self.t0)

    @property
    def elapsed(self) -> float:
        return now() - self.t0


@dataclass
class Runs:
    """One tune's runs: the budget's clock, the folder their logs go to, and what is said as
    each ends."""

    clock: Clock
    logs: str
    say: Callable[[str], None]

    def run(self, t: Trial, spec: RunSpec, final: bool = False, expect_s: float = 0.0) -> bool:
        """One timed run of t, kept in t.runs (t.final_runs with `final`); its losses become t's
        check on its first search run (before the line is said: a Ctrl-C after it still finds
        them). False where it failed, was cut by the budget, or was not started: the budget
        spent, or less left than `expect_s` (what a run takes at the least)."""
        clock, say = self.clock, self.say
        if clock.left <= 0:
            return False
        if clock.left < expect_s:
            if t.error is None:
                left = f"{clock.left:.0f} s of the budget were left"
                t.error, t.cut = f"not started: {left}, a run takes about {expect_s:.0f} s", True
            say(f"{t.label}: {t.error}")
            return False
        started = now()
        got = run_child(replace(spec, candidates=list(t.names)).to_json(), max(clock.left, 1.0), self.logs)
        got["seed_offset"] = spec.seed_offset
        got["took_s"] = now() - started
        checked = spec.checked_steps
        if got.get("ok") and len(got.get("step_ms", [])) <= checked + spec.warmup:
            first = f"{checked} checked with dropout off + " if checked else ""
            got.update(
                ok=False,
                error=f"the script ended after {got.get('steps_seen')} steps, "
                f"fewer than {first}--warmup {spec.warmup} + 2",
            )
        if not got.get("ok"):
            err = got.get("error")
            if t.error is None:
                t.error, t.cut = err, bool(got.get("cut"))
            say(f"{t.label}: {err}" if got.get("cut") else f"{t.label}: failed ({err}); the others go on")
            return False
        if final:
            t.final_runs.append(got)
        else:
            if t.names and not t.runs:
                t.check = got.get(CheckedOn.of(spec).key)
            t.runs.append(got)
        steady = sorted(got["step_ms"][got.get("timed_from", spec.warmup) :])
        what = "confirming, " if final else ""
        say(
            f"{t.label}: {what}{steady[len(steady) // 2]:.3f} ms/step, run took {got['took_s']:.0f} s "
            f"({clock.left:.0f} s left)"
        )
        return True


def faster(stats: dict | None) -> bool:
    """Whether a speed-up (ratio_stats) is past 1 at 95% confidence."""
    return bool(stats and stats["ci"][0] > 1.0 and stats["p_value"] < 0.05)


def runs_stats(base: list[list[float]], cand: list[list[float]]) -> dict | None:
    """cand's speed-up over base where each is a list of runs' step times: the CI and p over
    runs (harness.stats.runs_ratio), the unit that varies between processes."""
    from perfloop.harness.stats import runs_ratio

    flat_b, flat_c = [x for run in base for x in run], [x for run in cand for x in run]
    if len(flat_b) < 2 or len(flat_c) < 2:
        return None
    return _speedup(runs_ratio(base, cand), flat_b, flat_c) | {"over": "runs"}


def ratio_stats(base: list[float], cand: list[float]) -> dict | None:
    """cand's speed-up over base (medians), its 95% CI and p, or None with too few samples."""
    from perfloop.harness.stats import independent_ratio

    if len(base) < 2 or len(cand) < 2:
        return None
    return _speedup(independent_ratio(base, cand), base, cand)


def _speedup(r: dict, base: list[float], cand: list[float]) -> dict:
    """A ratio of medians cand / base (harness.stats) as cand's speed-up, its CI turned over."""
    lo, hi = r["ci"]
    return {
        "speedup": 1 / r["ratio"],
        "ci": (1 / hi, 1 / lo),
        "p_value": r["p_value"],
        "median_ms": statistics.median(cand),
        "base_ms": statistics.median(base),
    }


def judge_all(trials, baseline: Trial, checks: Checks, floors: dict, warmup: int) -> None:
    """Each trial's loss (token) verdict and its speed-up over the unchanged script, search and
    final. A generation script's is read from the first search runs' logits: the trial's, the
    script's at its seed and again."""
    base, base_final = baseline.samples(warmup), baseline.run_samples(warmup, final=True)
    script = [Logits.of(r) for r in baseline.runs[:2]] + [Logits([]), None]  # none read: not checked
    for t in trials:
        if t.runs:
            floor = max(float(floors.get(n, Numerics.REORDERED)) for n in t.names)
            if checks.tokens:
                t.verdict = judge_tokens(Logits.of(t.runs[0]), script[0], script[1], floor)
            elif t.check is not None:
                t.verdict = judge(t.check, checks.base, checks.noise, checks.seeds, floor)
            t.stats = ratio_stats(base, t.samples(warmup))
        if t.final_runs:
            t.final = runs_stats(base_final, t.run_samples(warmup, final=True))
