"""The search on simulated runs (no child process, no timing: each run's step times are drawn
from a seeded generator around a table of what each set of fixes costs), so the verdicts do not
depend on the machine: fixes that interact are found by stacking, the best confirmed beside
compile alone, a candidate that breaks the loss never stacked, the budget kept for the
confirmation."""

import pytest

from perfloop.workflows.tune import tuner

# ng-video's shape: the eager step waits on the host, so TF32 alone saves nothing; once compile
# removes the wait, TF32 is worth much; the fused optimizer pays a little on top of both
STEP_MS = {
    (): 40.0,
    ("tf32",): 40.0,
    ("fused-optimizer",): 40.0,
    ("compile",): 35.0,
    ("compile", "tf32"): 24.0,
    ("compile", "fused-optimizer", "tf32"): 21.0,
    ("compile", "fused-optimizer"): 35.0,
    ("compile-reduce-overhead",): 36.0,
}


def _opts(**kw):
    return tuner.Options(
        script="train.py",
        steps=15,
        warmup=3,
        rounds=2,
        tried=["tf32", "fused-optimizer", "compile", "compile-reduce-overhead"],
        profile_first=False,
        budget_s=kw.pop("budget_s", 1e4),
        **kw,
    )


def test_fixes_that_pay_only_together_are_found_by_stacking_and_confirmed(simulated, monkeypatch):
    calls = []
    simulated(STEP_MS, calls=calls)
    monkeypatch.setattr(tuner, "_diagnose", lambda opts, spec, *a: ([], True, spec))
    r = tuner.tune(_opts())
    by = {t.label: t for t in r.trials}
    assert not by["tf32"].kept and by["compile"].kept  # alone, TF32 buys nothing here
    stacked = by["tf32 + compile"]
    assert stacked.step["taken"] and stacked.step["over"] == "compile"
    assert stacked.step["speedup"] == pytest.approx(35 / 24, rel=0.03)
    assert r.best.label == "tf32 + fused-optimizer + compile"
    assert "compile-reduce-overhead + compile" not in by  # one of a group in a stack
    assert r.speedup(r.best) == pytest.approx(40 / 21, rel=0.03)
    assert r.speedup(r.best) / r.speedup(r.compile_alone) == pytest.approx(35 / 21, rel=0.03)
    assert len(r.best.final_runs) == len(r.compile_alone.final_runs) == 2  # confirmed, interleaved
    assert len(r.trials[0].final_runs) == 2
    # the model drops out: the search (and its loss checks) ran with dropout off, the
    # confirmation as the script is written
    assert {d for names, d in calls[1:-6]} == {"off"} and {d for _, d in calls[-6:]} == {"on"}
    assert any("dropout off" in n for n in r.notes)


def test_a_candidate_that_changes_the_loss_is_never_stacked(simulated, monkeypatch):
    simulated(STEP_MS, wrong={"tf32"})
    monkeypatch.setattr(tuner, "_diagnose", lambda opts, spec, *a: ([], True, spec))
    r = tuner.tune(_opts())
    by = {t.label: t for t in r.trials}
    assert by["tf32"].verdict.ok is False
    assert not any("tf32" in t.names and len(t.names) > 1 for t in r.trials)
    assert not by["fused-optimizer + compile"].step["taken"]  # it does not pay over compile alone
    assert r.best.label == "compile"


def test_a_stack_that_does_not_fit_is_passed_over_for_one_that_does(simulated, monkeypatch):
    """Baselines (4 x 10 s) and singles (50 + 80 + 10 s) leave 120 s of 300: patch on the best
    (an 80 s run, and its confirmation) does not fit and is passed over, with the budget that would
    try it in the notes; TF32 on it (a 50 s run, 60 s to confirm) fits and is taken; compile alone
    is not confirmed (no time): said."""
    table = dict(STEP_MS) | {
        ("compile-reduce-overhead",): 30.0,
        ("patch",): 33.0,
        ("compile-reduce-overhead", "tf32"): 22.0,
    }
    simulated(step_ms=table)
    monkeypatch.setattr(tuner, "_diagnose", lambda opts, spec, *a: ([], True, spec))
    said = []
    opts = _opts(budget_s=300)
    opts.tried, opts.rounds = ["tf32", "patch", "compile-reduce-overhead"], 1
    r = tuner.tune(opts, say=said.append)
    assert any(s.startswith("patch not stacked on compile-reduce-overhead") for s in said), said
    # the user is told what it would take: the stack's run (compile's 50 s + patch's 70 s past a
    # baseline's), and its confirmation beside a 10 s baseline run: 250 s, where 120 s were left
    [note] = [n for n in r.notes if n.startswith("patch was not stacked")]
    assert "need about 250 s, 120 s were left; --budget 430s would try it" in note, note
    assert r.best.label == "tf32 + compile-reduce-overhead" and r.best.step["taken"]
    assert r.best.final_runs and r.trials[0].final_runs  # the best confirmed, interleaved
    assert r.elapsed_s <= 300


def test_a_stack_is_budgeted_without_the_c_builds_its_parts_already_paid(simulated, monkeypatch):
    """run41: patch's first run on a fresh machine took 133 s, mostly C++ builds the machine then
    keeps. Here its first run waits 60 s for them (its checks take 10 s every run): a stack of
    patch and compile is costed at what a run of it takes now (10 + 40 + 10 s), not at patch's
    first run again, so it fits the time left and is run, taken and confirmed (costed with
    patch's first run, it would not)."""
    table = {(): 40.0, ("patch",): 30.0, ("compile",): 35.0, ("compile", "patch"): 20.0}
    simulated(step_ms=table, builds={"patch": 60.0})
    monkeypatch.setattr(tuner, "_diagnose", lambda opts, spec, *a: ([], True, spec))
    said = []
    opts = _opts(budget_s=350)
    opts.tried, opts.rounds = ["patch", "compile"], 1
    r = tuner.tune(opts, say=said.append)
    by = {t.label: t for t in r.trials}
    assert by["patch"].took_s == 80 and by["patch"].rerun_s == 20  # its first run, and another
    assert "patch + compile" in by and by["patch + compile"].step["taken"], said
    assert r.best.label == "patch + compile" and r.best.final_runs
    assert r.elapsed_s <= 350
