"""perfloop tune: every advised fix tried on the unchanged script, verified, measured, kept.

1. The script is profiled (script mode) and diagnosed; each finding with a fix proposes its
   candidate (workflows.tune.candidates), torch.compile always (the reference).
2. The baseline runs three times: at the script's seed twice (its own noise) and at another
   seed (the spread of an equally good training): the loss check's tolerances (verify.py).
3. Rounds, each the baseline then every candidate, interleaved so drift hits all alike; each
   candidate's first run is checked on the loss; the steps after the warm-up are its samples.
4. Kept: verified and faster at 95% confidence (ratio of median step times, bootstrap CI,
   Mann-Whitney). The best of each group (compile modes) with every verified candidate not
   slower is tried together; the best verified result is what to change.
Everything runs in child processes (workflows.tune.child): the user's files are not touched.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from perfloop.workflows.tune.candidates import CANDIDATES, Candidate, Numerics, get
from perfloop.workflows.tune.runner import run_child
from perfloop.workflows.tune.verify import Verdict, judge

MISS = 0.30  # a prediction off by more than this share of itself is said


@dataclass
class Options:
    script: str
    argv: list[str] = field(default_factory=list)
    budget_s: float = 600.0
    steps: int = 20
    warmup: int = 5
    rounds: int = 2
    tried: list[str] | None = None  # by name (or module:NAME): these only; None: what the diagnosis advises
    allow_numerics: bool = False  # also the opt-in candidates that change numerics (autocast)
    profile_first: bool = True


@dataclass
class Trial:
    names: tuple[str, ...]  # () is the baseline
    runs: list[dict] = field(default_factory=list)
    verdict: Verdict | None = None
    predicted_share: float | None = None  # of the unchanged step, from the diagnosis
    error: str | None = None
    stats: dict | None = None  # speedup, ci, p_value, median_ms
    check: list | None = None  # the losses its verdict reads (Checks says which run gave them)

    @property
    def label(self) -> str:
        return " + ".join(get(n).name for n in self.names) or "baseline"

    def samples(self, warmup: int) -> list[float]:
        return [ms for r in self.runs if r.get("ok") for ms in r["step_ms"][warmup:]]

    @property
    def predicted_ms(self) -> float | None:
        """The predicted saving per step: its share of the unchanged script's median step."""
        if self.predicted_share is None or not self.stats:
            return None
        return self.predicted_share * self.stats["base_ms"]

    @property
    def kept(self) -> bool:
        s = self.stats
        return bool(self.verdict and self.verdict.ok and s and s["ci"][0] > 1.0 and s["p_value"] < 0.05)


@dataclass
class Checks:
    """The losses every verdict compares with: the unchanged script's at its seed (`base`),
    again (`noise`: its own nondeterminism) and at another seed (`seeds`). Where the model drops
    out, these and each candidate's come from runs with dropout off (`dropout_off`): compiled
    code draws its masks otherwise, so with dropout on a right kernel and a wrong one part alike."""

    dropout_off: bool = False
    base: list = field(default_factory=list)
    noise: list = field(default_factory=list)
    seeds: list = field(default_factory=list)


@dataclass
class Result:
    script: str
    device: str
    findings: list[dict]
    trials: list[Trial]
    best: Trial | None
    compile_alone: Trial | None
    notes: list[str]
    elapsed_s: float
    budget_s: float
    warmup: int = 5
    stopped: str = ""  # why tune stopped early: "budget", "interrupted"


def propose(findings: list[dict], cuda: bool, opts: Options) -> list[tuple[str, Candidate, float | None]]:
    """(key, candidate, the share of the step its findings predict it saves) for each candidate
    tune tries: those named (the key as given: a name or module:NAME), or those advised (and
    compile); those needing CUDA only on CUDA."""
    if opts.tried:
        chosen = [(n, get(n)) for n in opts.tried]
    else:
        chosen = [
            (c.name, c)
            for c in CANDIDATES
            if (c.always or c.predicted_share(findings) is not None) and (not c.opt_in or opts.allow_numerics)
        ]
    return [(k, c, c.predicted_share(findings)) for k, c in chosen if cuda or not c.needs_cuda]


class _Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    @property
    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def tune(opts: Options, say: Callable[[str], None] = lambda s: None) -> Result:
    """Run the loop on `opts.script`; `say` gets one line per run as it ends."""
    clock, notes = _Clock(opts.budget_s), []
    logs = tempfile.mkdtemp(prefix="perfloop-tune-")
    base_spec = {
        "script": os.path.abspath(opts.script),
        "argv": list(opts.argv),
        "steps": opts.steps,
        "warmup": opts.warmup,
    }
    findings, cuda = _diagnose(opts, base_spec, clock, logs, say, notes)
    proposed = propose(findings, cuda, opts)
    baseline, trials = Trial(()), [Trial((k,), predicted_share=p) for k, _, p in proposed]
    floors = {k: c.numerics for k, c, _ in proposed}
    stopped = ""
    checks = Checks()
    try:
        checks = _baselines(baseline, base_spec, clock, logs, say)
        for r in range(opts.rounds):
            for t in ([baseline] if r else []) + trials:
                _trial_run(t, base_spec, checks, clock, logs, say)
            if clock.left <= 0:
                stopped = "budget"
                break
        _judge_all(trials, baseline, checks, floors, opts.warmup)
        combo = _combination(trials, proposed)
        if combo and clock.left > 0:
            trials.append(combo)
            for _ in range(opts.rounds):
                _run(baseline, base_spec, clock, logs, say)
                _trial_run(combo, base_spec, checks, clock, logs, say)
            _judge_all(trials, baseline, checks, floors, opts.warmup)
        stopped = "budget" if clock.left <= 0 and not stopped else stopped
    except KeyboardInterrupt:
        stopped = "interrupted"
        _judge_all(trials, baseline, checks, floors, opts.warmup)
    if checks.dropout_off:
        notes.append(
            "the model drops out: the loss checks compared runs with dropout off (compiled code "
            "draws its masks otherwise); the timed runs kept it on"
        )
    if any(t.error for t in [baseline, *trials]):
        notes.append(f"the failed runs' output (the script's prints and tracebacks) is kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    compile_alone = next((t for t in trials if t.names == ("compile",)), None)
    best = max((t for t in trials if t.kept), key=lambda t: t.stats["speedup"], default=None)
    return Result(
        opts.script,
        "cuda" if cuda else "cpu",
        findings,
        [baseline, *trials],
        best,
        compile_alone,
        notes,
        clock.elapsed,
        opts.budget_s,
        opts.warmup,
        stopped,
    )


def _diagnose(opts, base_spec, clock, logs, say, notes) -> tuple[list[dict], bool]:
    import torch

    cuda = torch.cuda.is_available()
    if not opts.profile_first:
        return [], cuda
    say("profiling the unchanged script")
    got = run_child({**base_spec, "mode": "profile", "steps": 3}, max(clock.left, 30), logs)
    if not got.get("ok"):
        raise ValueError(f"--script: the unchanged script could not be profiled: {got.get('error')}")
    notes.extend(got.get("warnings", []))
    say(f"diagnosed: {len(got['findings'])} findings; step {got['wall_ms']:.3f} ms wall")
    return got["findings"], cuda


def _baselines(baseline, spec, clock, logs, say) -> Checks:
    """The unchanged script's first timed run, and the losses the verdicts compare with."""
    if not _run(baseline, {**spec, "seed_offset": 0}, clock, logs, say):
        raise ValueError(f"--script: the unchanged script's run failed: {baseline.error}")
    checks = Checks(dropout_off=bool(baseline.runs[0].get("dropout_seen")))
    if checks.dropout_off:
        say("the model drops out: the loss checks run with dropout off, the timed runs with it on")
        curves = [_check_run(baseline, spec, offset, clock, logs) or [] for offset in (0, 0, 1)]
    else:
        for offset in (0, 1):
            _run(baseline, {**spec, "seed_offset": offset}, clock, logs, say)
        curves = [r.get("losses", []) for r in baseline.runs] + [[], []]
    checks.base, checks.noise, checks.seeds = curves[:3]
    return checks


def _trial_run(t: Trial, spec: dict, checks: Checks, clock, logs, say) -> None:
    """One timed run of t; the first also gives the losses its verdict reads."""
    first = bool(t.names) and not t.runs
    if (
        _run(t, spec, clock, logs, say, keep_losses=first and not checks.dropout_off)
        and first
        and checks.dropout_off
    ):
        t.check = _check_run(t, spec, 0, clock, logs)


def _check_run(t: Trial, spec: dict, offset: int, clock, logs) -> list | None:
    """The losses of a run of t with dropout off (not timed), or None where it failed."""
    if clock.left <= 0:
        return None
    got = run_child(
        {**spec, "candidates": list(t.names), "seed_offset": offset, "dropout": "off"}, clock.left, logs
    )
    if not got.get("ok"):
        t.error = t.error or f"its loss-check run: {got.get('error')}"
        return None
    return got.get("losses", [])


def _run(t: Trial, spec: dict, clock: _Clock, logs: str, say, keep_losses: bool = False) -> bool:
    """One timed run of t, kept in t.runs (its losses as t's check with `keep_losses`, before
    it is said: a Ctrl-C after the line still finds them); False where it failed."""
    if clock.left <= 0:
        return False
    started = time.perf_counter()
    got = run_child({**spec, "candidates": list(t.names)}, max(clock.left, 1.0), logs)
    got["seed_offset"] = spec.get("seed_offset", 0)
    took = time.perf_counter() - started
    if got.get("ok") and len(got.get("step_ms", [])) <= spec["warmup"]:
        got.update(
            ok=False,
            error=f"the script ended after {got.get('steps_seen')} steps, "
            f"fewer than --warmup {spec['warmup']} + 2",
        )
    if not got.get("ok"):
        t.error = t.error or got.get("error")
        say(f"{t.label}: failed ({got.get('error')}); the others go on")
        return False
    t.runs.append(got)
    if keep_losses:
        t.check = got.get("losses")
    steady = sorted(got["step_ms"][spec["warmup"] :])
    say(f"{t.label}: {steady[len(steady) // 2]:.3f} ms/step, run took {took:.0f} s ({clock.left:.0f} s left)")
    return True


def _judge_all(trials, baseline, checks: Checks, floors, warmup) -> None:
    from perfloop.harness.stats import independent_ratio

    base = baseline.samples(warmup)
    for t in trials:
        if not t.runs:
            continue
        floor = max(float(floors.get(n, Numerics.REORDERED)) for n in t.names)
        if t.check is not None:
            t.verdict = judge(t.check, checks.base, checks.noise, checks.seeds, floor)
        cand = t.samples(warmup)
        if len(base) >= 2 and len(cand) >= 2:
            r = independent_ratio(base, cand)  # median(cand) / median(base)
            lo, hi = r["ci"]
            t.stats = {
                "speedup": 1 / r["ratio"],
                "ci": (1 / hi, 1 / lo),
                "p_value": r["p_value"],
                "median_ms": _median(cand),
                "base_ms": _median(base),
            }


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _combination(trials: list[Trial], proposed) -> Trial | None:
    """The best verified candidate of each group with every other verified one not slower; None
    when that is one candidate (it is measured already)."""
    group = {k: c.group for k, c, _ in proposed}
    ok = [
        t
        for t in trials
        if len(t.names) == 1 and t.verdict and t.verdict.ok and t.stats and t.stats["speedup"] >= 1.0
    ]
    chosen: dict[str, Trial] = {}
    for t in sorted(ok, key=lambda t: -t.stats["speedup"]):
        key = group.get(t.names[0]) or t.names[0]
        chosen.setdefault(key, t)
    names = tuple(k for k, _, _ in proposed if any(t.names == (k,) for t in chosen.values()))
    if len(names) < 2:
        return None
    predicted = [t.predicted_share for t in chosen.values() if t.predicted_share is not None]
    return Trial(names, predicted_share=min(sum(predicted), 1.0) if predicted else None)


def missed(t: Trial) -> str:
    """Where the prediction missed the realized saving by more than MISS, in words ("" if not)."""
    if t.predicted_ms is None or not t.stats or t.predicted_ms <= 0:
        return ""
    realized = t.stats["base_ms"] - t.stats["median_ms"]
    if abs(realized - t.predicted_ms) <= MISS * t.predicted_ms:
        return ""
    how = "more" if realized > t.predicted_ms else "less"
    by = abs(realized / t.predicted_ms - 1)
    return (
        f"{t.label}: predicted {t.predicted_ms:.3f} ms saved per step, realized {realized:.3f} ms "
        f"({how} than predicted, by {by:.0%})"
    )


def lines_to_add(best: Trial | None) -> list[str]:
    if best is None:
        return []
    out = []
    for key in best.names:
        c = get(key)
        out.append(f"# {c.name}: {c.what}")
        out.extend(c.lines)
    return out


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
