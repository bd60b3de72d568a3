"""The search on simulated runs (no child process, no timing: each run's step times are drawn
from a seeded generator around a table of what each set of fixes costs), so the verdicts do not
depend on the machine: fixes that interact are found by stacking, the best confirmed beside
compile alone, a candidate that breaks the loss never stacked, the budget kept for the
confirmation."""

import numpy as np
import pytest

from perfloop.workflows.tune import trials as trials_mod
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


def _fake_child(clock: list, step_ms: dict, wrong: set, calls: list | None):
    rng = np.random.default_rng(0)

    def run_child(spec, timeout_s, logs):
        names = tuple(sorted(spec.get("candidates", [])))
        if calls is not None:
            calls.append((names, spec.get("dropout", "on")))
        clock[0] += 50.0 if any("compile" in n for n in names) else 10.0  # a run's wall time
        ms = step_ms[names]
        steps = spec["warmup"] + spec["steps"]
        off = spec.get("seed_offset", 0)
        losses = [2.0 - 0.01 * i + 1e-3 * off + rng.normal(0, 1e-6) for i in range(steps)]
        if wrong & set(names):
            losses = [x + 0.05 for x in losses]
        times = [ms * 3] * spec["warmup"] + list(ms * rng.lognormal(0, 0.01, spec["steps"]))
        return {
            "ok": True,
            "step_ms": times,
            "losses": losses,
            "peak_mb": 100.0,
            "warm_s": 1.0,
            "steps_seen": steps + 1,
            "dropout_seen": True,
        }

    return run_child


@pytest.fixture
def simulated(monkeypatch):
    def use(step_ms=STEP_MS, wrong=frozenset(), calls=None):
        clock = [0.0]  # simulated seconds: each run moves it by its wall time
        monkeypatch.setattr(trials_mod, "run_child", _fake_child(clock, step_ms, wrong, calls))
        monkeypatch.setattr(trials_mod, "now", lambda: clock[0])

    return use


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
    simulated(calls=calls)
    monkeypatch.setattr(tuner, "_diagnose", lambda *a: ([], True))
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
    simulated(wrong={"tf32"})
    monkeypatch.setattr(tuner, "_diagnose", lambda *a: ([], True))
    r = tuner.tune(_opts())
    by = {t.label: t for t in r.trials}
    assert by["tf32"].verdict.ok is False
    assert not any("tf32" in t.names and len(t.names) > 1 for t in r.trials)
    assert not by["fused-optimizer + compile"].step["taken"]  # it does not pay over compile alone
    assert r.best.label == "compile"


def test_stacking_stops_where_the_confirmation_would_not_fit(simulated, monkeypatch):
    simulated()
    monkeypatch.setattr(tuner, "_diagnose", lambda *a: ([], True))
    said = []
    # 170 s of baselines and singles; a stack run (50 s) and the confirmation kept for it
    # (2 rounds of baseline, compile and the stack: 220 s) do not fit in the 230 s left
    r = tuner.tune(_opts(budget_s=400), say=said.append)
    assert any("stacking stops" in s for s in said)
    assert not any(len(t.names) > 1 for t in r.trials)
    assert r.best is not None and r.best.final_runs  # what was found is confirmed
