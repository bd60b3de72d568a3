"""perfloop tune: every advised fix tried on the unchanged script, verified, measured, kept.

1. The script is profiled (script mode) and diagnosed; each finding with a fix proposes its
   candidate (workflows.tune.candidates), torch.compile always (the reference).
2. The baseline runs three times: at the script's seed twice (its own noise) and at another
   seed (the spread of an equally good training): the loss check's tolerances (verify.py).
3. Search: each candidate alone, one run, checked on the loss (its first steps) and timed (the
   steps after the warm-up). Where the model drops out, a search run checks its first steps
   with dropout off, so the losses compare the same function (compiled code draws its masks
   otherwise), then puts the script's dropout back and times the program as written.
4. Stacking: fixes interact (TF32 saves little while the step waits on the host, much once
   compile removes the wait), so from the best verified candidate, each other verified one is
   added in turn, best first, and taken where the stack is verified and faster than without it
   at 95% confidence -- whether or not it paid alone.
5. Confirmation: the search's best and torch.compile alone (for a generation script, compile
   reduce-overhead where it was tried: what gpt-fast does), together, interleaved with the
   unchanged script `rounds` times (more, up to twice, while a verdict is within its noise and
   the budget allows), run as the script is (dropout as written). Kept: what the confirmation
   finds faster at 95% confidence over runs; the faster of the two, or nothing confirmed. The
   stacks leave the budget that confirmation needs.
Everything runs in child processes (workflows.tune.child): the user's files are not touched.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from perfloop.workflows.step_sources import MODEL_CALL, STEP_SAID
from perfloop.workflows.tune.candidates import CANDIDATES, Candidate, get
from perfloop.workflows.tune.runner import run_child
from perfloop.workflows.tune.sites import said
from perfloop.workflows.tune.spec import RunSpec
from perfloop.workflows.tune.trials import (
    CheckedOn,
    Checks,
    Clock,
    Runs,
    Trial,
    faster,
    judge_all,
    ratio_stats,
)

MISS = 0.30  # a prediction off by more than this share of itself is said


@dataclass
class Options:
    script: str
    argv: list[str] = field(default_factory=list)
    budget_s: float = 600.0
    steps: int = 20
    warmup: int = 5
    rounds: int = 2  # confirmation runs of the best and of compile, interleaved with the baseline
    tried: list[str] | None = None  # by name (or module:NAME): these only; None: what the diagnosis advises
    allow_numerics: bool = False  # also the opt-in candidates that change numerics (autocast)
    profile_first: bool = True
    range: str | None = None  # a generation script: the range one step is (one token's call); None:
    # the profile's step (a generation script with no range: its model's decode calls, MODEL_CALL)


@dataclass
class Result:
    script: str
    device: str
    findings: list[dict]
    trials: list[Trial]  # the baseline first, then each candidate alone, then the stacks
    best: Trial | None  # kept: confirmed faster over runs (None: nothing confirmed)
    compile_alone: Trial | None  # the reference: torch.compile alone, in the mode reference() picks
    notes: list[str]
    elapsed_s: float
    budget_s: float
    warmup: int = 5
    stopped: str = ""  # why tune stopped early: "budget", "interrupted"
    checked_on: CheckedOn = CheckedOn.LOSS
    searched: Trial | None = None  # the search's best, confirmed or not (kept only if confirmed)
    sites: dict = field(default_factory=dict)  # where the script builds its model, optimizer (sites.py)

    @staticmethod
    def speedup(t: Trial | None) -> float | None:
        """t's speed-up as confirmed (interleaved, the script as written), else None: a figure
        of the search is read from t.stats, and never printed beside a confirmed one."""
        return t.final["speedup"] if t is not None and t.final else None


def propose(findings: list[dict], cuda: bool, opts: Options) -> list[tuple[str, Candidate, float | None]]:
    """(key, candidate, the share of the step its findings predict it saves) for each candidate
    tune tries: those named (the key as given: a name or module:NAME), or those advised (and
    compile); those needing CUDA only on CUDA."""
    if opts.tried:
        chosen = [(n, get(n)) for n in dict.fromkeys(opts.tried)]  # a name given twice: tried once
    else:
        chosen = [
            (c.name, c)
            for c in CANDIDATES
            if (c.always or c.predicted_share(findings) is not None) and (not c.opt_in or opts.allow_numerics)
        ]
    return [(k, c, c.predicted_share(findings)) for k, c in chosen if cuda or not c.needs_cuda]


UNTRIED_SHARE = 0.05  # findings this share of the step or more that no candidate answers are said


def untried(findings: list[dict]) -> list[str]:
    """A note for each finding of UNTRIED_SHARE or more that no candidate makes from outside the
    script (the batch a generation script serves, a sync in its loop): the user's own change,
    with the diagnosis's prediction, so the report says it rather than drop it."""
    answered = {k.value for c in CANDIDATES for k in c.advised_by}
    return [
        f"told, not tried (no candidate makes it from outside the script): {f['title']} "
        f"({f['share']:.0%} of the profiled step); {f.get('advice', '')}".rstrip("; ")
        for f in findings
        if str(f.get("kind")) not in answered and (f.get("share") or 0) >= UNTRIED_SHARE
    ]


def tune(opts: Options, say: Callable[[str], None] = lambda s: None) -> Result:
    """Run the loop on `opts.script`; `say` gets one line per run as it ends."""
    # the judgement's statistics loaded before any run: a Ctrl-C landing inside scipy's first
    # import leaves it half-loaded, and the judgement that keeps what was measured then fails
    import scipy.stats  # noqa: F401

    notes: list[str] = []
    runs = Runs(Clock(opts.budget_s), tempfile.mkdtemp(prefix="perfloop-tune-"), say)
    clock = runs.clock
    base_spec = RunSpec(
        script=os.path.abspath(opts.script),
        argv=list(opts.argv),
        steps=opts.steps,
        warmup=opts.warmup,
        range=opts.range,
    )
    findings, cuda, base_spec = _diagnose(opts, base_spec, runs, notes)
    proposed = propose(findings, cuda, opts)
    notes += untried(findings)
    baseline = Trial(())
    trials = [Trial((k,), predicted_share=p) for k, _, p in proposed]
    floors = {k: c.numerics for k, c, _ in proposed}
    on = CheckedOn.of(base_spec)
    stopped, checks, searched, sites = "", Checks(), None, {}

    def judged() -> None:
        judge_all(trials, baseline, checks, floors, opts.warmup)

    try:
        checks, sites = _baselines(baseline, base_spec, runs)
        plan, too_small = _plan(baseline, len(trials), opts.rounds, clock)
        say(plan)
        if too_small:
            notes.append(plan)
        search = _checked(base_spec) if checks.dropout_off else base_spec
        for t in list(trials):
            runs.run(t, search, expect_s=0.5 * baseline.rerun_s)  # start-up, at the least
        judged()
        notes += _stack(trials, baseline, proposed, search, runs, judged, opts.rounds)
        searched = _best(trials)
        _confirm(baseline, searched, reference(trials, on), base_spec, opts.rounds, runs, judged)
        judged()
    except KeyboardInterrupt:
        stopped = "interrupted"
        judged()
        searched = searched or _best(trials)
    best = _kept(searched, reference(trials, on))
    stopped = stopped or ("budget" if clock.left <= 0 else "")
    _notes(notes, checks, searched, best, [baseline, *trials], runs.logs)
    return Result(
        script=opts.script,
        device="cuda" if cuda else "cpu",
        findings=findings,
        trials=[baseline, *trials],
        best=best,
        compile_alone=reference(trials, on),
        notes=notes,
        elapsed_s=clock.elapsed,
        budget_s=opts.budget_s,
        warmup=opts.warmup,
        stopped=stopped,
        checked_on=on,
        searched=searched,
        sites=sites,
    )


def _plan(baseline: Trial, n: int, rounds: int, clock: Clock) -> tuple[str, bool]:
    """What the budget allows, said before the search: from a run of the unchanged script, the
    least the search (each candidate alone, one run) and the confirmation (the best, compile and
    the unchanged script, `rounds` times) need; compiling candidates take longer."""
    run_s = baseline.rerun_s
    need = n * run_s + rounds * 3 * run_s
    left = max(clock.left, 0)
    head = (
        f"the budget: {left:.0f} s left; a run of the unchanged script takes {run_s:.0f} s, so the search "
        f"({n} candidate(s)) and the confirmation ({rounds} rounds) need {need:.0f} s at least"
    )
    if need > left:
        return (
            f"{head}: too small to confirm anything (nothing unconfirmed is kept); --budget "
            f"{clock.budget_s + 1.5 * (need - left):.0f}s would fit them"
        ), True
    return f"{head}; {left - need:.0f} s more for compiling and the stacks", False


def _kept(searched: Trial | None, compile_alone: Trial | None) -> Trial | None:
    """Of the two confirmed together, the faster of those kept (confirmed faster over runs)."""
    kept = [t for t in (searched, compile_alone) if t is not None and t.kept]
    return max(kept, key=lambda t: t.final["speedup"], default=None)


def _notes(notes, checks: Checks, searched: Trial | None, best: Trial | None, trials, logs: str) -> None:
    if checks.dropout_off:
        notes.append(
            "the model drops out: each search run's loss was checked on its first steps with dropout "
            "off (compiled code draws its masks otherwise), and its steps were timed after, with "
            "dropout as written, as in the confirmation"
        )
    if best is not None and searched is not None and best is not searched:  # (none kept: report says why)
        f = searched.final
        notes.append(
            f"the search's best ({searched.label}, {searched.stats['speedup']:.3f}x in the search) was "
            f"not confirmed faster: {f['speedup']:.3f}x [{f['ci'][0]:.3f}, {f['ci'][1]:.3f}] over "
            f"{len(searched.final_runs)} run(s) as the script is written; {best.label} was, and is kept"
        )
    if any(t.error for t in trials):
        notes.append(f"the failed runs' output (the script's prints and tracebacks) is kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)


def reference(trials: list[Trial], on: CheckedOn = CheckedOn.LOSS) -> Trial | None:
    """torch.compile alone, what tune is read against: for a generation script, its
    reduce-overhead mode (CUDA graphs, as gpt-fast compiles its decode) where that was tried."""
    modes = (("compile-reduce-overhead",), ("compile",)) if on is CheckedOn.TOKENS else (("compile",),)
    for names in modes:
        t = next((t for t in trials if t.names == names), None)
        if t is not None:
            return t
    return None


def _best(trials: list[Trial]) -> Trial | None:
    """The search's fastest promising trial: a candidate alone, or a stack whose last addition
    paid."""
    able = [t for t in trials if t.promising and (t.step is None or t.step["taken"])]
    return max(able, key=lambda t: t.stats["speedup"], default=None)


def _diagnose(opts, base_spec: RunSpec, runs: Runs, notes) -> tuple[list[dict], bool, RunSpec]:
    """The unchanged script's profile: its findings, whether CUDA is here, and the spec its runs
    take (a generation script with no range named: stepped by its model's decode calls)."""
    import torch

    cuda, say = torch.cuda.is_available(), runs.say
    if not opts.profile_first:
        return [], cuda, base_spec
    say("profiling the unchanged script")
    got = run_child(
        replace(base_spec, mode="profile", steps=3).to_json(), max(runs.clock.left, 30), runs.logs
    )
    if not got.get("ok"):
        raise ValueError(f"--script: the unchanged script could not be profiled: {got.get('error')}")
    notes.extend(got.get("warnings", []))
    if base_spec.range is None and got.get("step") == MODEL_CALL:
        # no optimizer steps and no range named: a generation script, stepped by its model's
        # decode calls and checked on its greedy tokens, as with --range
        base_spec = replace(base_spec, range=MODEL_CALL)
        said = next((w for w in notes if w.startswith(STEP_SAID)), "a step: one decode call of its model")
        say(f"a generation script: {said}")
    say(f"diagnosed: {len(got['findings'])} findings; step {got['wall_ms']:.3f} ms wall")
    return got["findings"], cuda, base_spec


def _baselines(baseline: Trial, spec: RunSpec, runs: Runs) -> tuple[Checks, dict]:
    """The unchanged script's search runs: at its seed, again (its own nondeterminism) and at
    another seed, whose losses every verdict compares with; with dropout off where the first
    run shows the model drops out (that run is then set aside)."""
    clock, say = runs.clock, runs.say
    if clock.left <= 0:
        took = clock.elapsed
        raise ValueError(
            f"--budget: {clock.budget_s:.0f} s ran out before the unchanged script's first timed run "
            f"(profiling it took {took:.0f} s); give --budget {max(60, 20 * took):.0f}s or more"
        )
    if not runs.run(baseline, replace(spec, seed_offset=0, sites=True)):
        raise ValueError(f"--script: the unchanged script's run failed: {baseline.error}")
    sites = baseline.runs[0].get("sites") or {}  # where the lines to add go (this run's only)
    _finite_loss(baseline.runs[0].get("losses") or [])
    on = CheckedOn.of(spec)
    tokens = on is CheckedOn.TOKENS
    checks = Checks(dropout_off=bool(baseline.runs[0].get("dropout_seen")) and not tokens, tokens=tokens)
    offsets = (0,) if tokens else (0, 1)  # another seed samples other tokens: no spread to read
    if checks.dropout_off:
        say(
            "the model drops out: each search run checks its first steps with dropout off, then "
            "times the script as written (dropout on)"
        )
        baseline.runs.clear()
        spec, offsets = _checked(spec), (0, 0, 1)
    for offset in offsets:
        if not runs.run(baseline, replace(spec, seed_offset=offset)) and clock.left > 0:
            at = "another seed" if offset else "its own seed, again"  # a missing one reads as no spread
            raise ValueError(f"--script: the unchanged script's run at {at} failed: {baseline.error}")
    curves = [r.get(on.key, []) for r in baseline.runs] + [[], [], []]
    checks.base, checks.noise, checks.seeds = curves[:3]
    return checks, sites


def _checked(spec: RunSpec) -> RunSpec:
    """A search run of a model that drops out: its first warmup + steps steps with dropout off,
    their losses checked (compiled code draws its masks otherwise, so with dropout on a right
    kernel and a wrong one part alike); then the script's dropout back, a warm-up (compiled code
    recompiles there) and the steps timed, as the script is written."""
    return replace(spec, dropout="off", check_steps=spec.warmup + spec.steps)


def _finite_loss(losses: list) -> None:
    """A script whose own loss is not finite: nothing can be checked against it, said as its."""
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    if bad is not None:
        raise ValueError(
            f"--script: the unchanged script's own loss is not finite ({losses[bad]} at step {bad}): no "
            "candidate can be checked against it; fix the script's loss (its inputs, learning rate, "
            "initialization) and tune again"
        )


def _stack(trials, baseline, proposed, spec: RunSpec, runs: Runs, judged, rounds) -> list[str]:
    """From the best verified candidate, each other verified one added in turn (best alone
    first; one of a group), taken where the stack is verified and faster than without it at 95%
    confidence. One whose run and confirmation would not fit in the budget left is passed over
    (a cheaper one after it may fit); a part's C++ builds are not counted again (the machine
    keeps them: Trial.rerun_s). Returns, for each stack passed over, what budget would try it."""
    clock, say = runs.clock, runs.say
    passed: list[str] = []
    group = {k: c.group or k for k, c, _ in proposed}
    order = [k for k, _, _ in proposed]
    ok = [t for t in trials if len(t.names) == 1 and t.verified and t.stats]
    ok.sort(key=lambda t: -t.stats["speedup"])
    if len(ok) < 2:
        return passed
    current, base_s = ok[0], baseline.rerun_s
    ref = reference(trials, CheckedOn.of(spec))
    ref_s = ref.rerun_s if ref is not None else 0.0  # confirmed beside the best, always
    for t in ok[1:]:
        if group[t.names[0]] in {group[n] for n in current.names}:
            continue
        cost = current.rerun_s + max(t.rerun_s - base_s, 0.0)
        need = cost + rounds * (base_s + cost + ref_s)  # its run, and its confirmation's
        if clock.left < need:
            say(f"{t.label} not stacked on {current.label}: its run and confirmation do not fit")
            more = need - clock.left
            passed.append(
                f"{t.label} was not stacked on {current.label}: its run and confirmation need about "
                f"{need:.0f} s, {max(clock.left, 0):.0f} s were left; --budget {clock.budget_s + more:.0f}s "
                "would try it"
            )
            continue
        names = tuple(sorted((*current.names, *t.names), key=order.index))
        shares = [x.predicted_share for x in trials if len(x.names) == 1 and x.names[0] in names]
        shares = [x for x in shares if x is not None]
        s = Trial(names, predicted_share=min(sum(shares), 1.0) if shares else None)
        trials.append(s)
        if not runs.run(s, spec):
            continue
        judged()
        step = ratio_stats(current.samples(spec.warmup), s.samples(spec.warmup))
        taken = s.verified and faster(step)
        s.step = (step or {}) | {"over": current.label, "taken": taken}
        say(f"{s.label}: {'taken' if taken else 'not taken'} over {current.label}")
        if taken:
            current = s
    return passed


def _confirm(baseline, best, compile_alone, spec: RunSpec, rounds, runs: Runs, judged) -> None:
    """The search's best and torch.compile alone together, interleaved with the unchanged script,
    the script as written (dropout on where it has it): `rounds` rounds where the budget fits
    them, and more (up to twice as many) while a verdict's CI holds 1."""
    clock, say = runs.clock, runs.say
    if best is None:
        return
    beside = compile_alone is not None and compile_alone is not best and compile_alone.verified
    who = [baseline] + ([compile_alone] if beside else []) + [best]
    per_round = sum(t.rerun_s for t in who)
    fits = int(clock.left // per_round) if per_round > 0 else rounds
    if fits < rounds:
        say(
            f"the budget left ({max(clock.left, 0):.0f} s) fits {max(fits, 0)} of {rounds} confirmation "
            f"rounds ({per_round:.0f} s each)"
        )

    def one_round() -> None:
        for t in who:
            runs.run(t, spec, final=True)

    for _ in range(min(rounds, max(fits, 0))):
        one_round()
    for _ in range(rounds if fits >= rounds else 0):  # more while a verdict is within its noise
        judged()
        if clock.left < per_round or not any(_within_noise(t) for t in who[1:]):
            break
        say("a confirmed speed-up's CI holds 1.0: one more confirmation round")
        one_round()


def _within_noise(t: Trial) -> bool:
    """A verified trial whose confirmed CI holds 1: another round may tell it apart."""
    return t.verified and bool(t.final) and t.final["ci"][0] <= 1.0 <= t.final["ci"][1]


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


def lines_to_add(best: Trial | None, at: dict | None = None) -> list[str]:
    """Each of best's fixes: what it is, the script's own line it goes beside where the run
    found it (`at`: sites.Sites.readings()), and the lines."""
    if best is None:
        return []
    out = []
    for key in best.names:
        c = get(key)
        out.append(f"# {c.name}: {c.what}")
        if c.at is not None and c.at.value in (at or {}):
            out.append(f"# at {said(c.at, at[c.at.value])}")
        out.extend(c.lines)
    return out


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
