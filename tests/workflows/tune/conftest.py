"""The tune loop on simulated runs: `simulated` replaces the child process with a seeded draw of
step times around a table of what each set of fixes costs, and the clock with the runs' wall
times, so the verdicts do not depend on the machine."""

import numpy as np
import pytest

from perfloop.workflows.tune import trials as trials_mod


def _fake_child(clock: list, step_ms: dict, wrong: set, calls, builds: dict | None = None, level=None):
    rng = np.random.default_rng(0)
    built: set = set()  # the machine's cache of C++ builds: each paid by the first run that needs it
    seen: dict = {}  # runs so far of each set of fixes

    def run_child(spec, timeout_s, logs):
        names = tuple(sorted(spec.get("candidates", [])))
        if calls is not None:
            calls.append((names, spec.get("dropout", "on")))
        # a run's wall time: start-up, and compiling (compile, or patch's kernels) where it has them
        waited = sum(s for n, s in (builds or {}).items() if n in names and n not in built)
        built.update(n for n in names if n in (builds or {}))
        if builds is None:
            clock[0] += 10.0 + 40.0 * any("compile" in n for n in names) + 70.0 * ("patch" in names)
        else:  # patch: its checks each run, its C++ builds once a machine
            clock[0] += 10.0 + 40.0 * any("compile" in n for n in names) + 10.0 * ("patch" in names) + waited
        # a search run of a model that drops out checks its first steps with dropout off, then
        # times its steps with dropout on (as written); `level` is the timed steps' pace: a
        # process's own (nth: the runs of these fixes so far), and dropout as those steps ran
        checked = spec.get("check_steps", 0) if spec.get("dropout") == "off" else 0
        timed = "on" if checked else spec.get("dropout", "on")
        nth = seen[names] = seen.get(names, -1) + 1
        ms = step_ms[names] * (level(names, timed, nth) if level else 1.0)
        off = spec.get("seed_offset", 0)
        losses = [
            2.0 - 0.01 * i + 1e-3 * off + rng.normal(0, 1e-6)
            for i in range(checked or spec["warmup"] + spec["steps"])
        ]
        if wrong & set(names):
            losses = [x + 0.05 for x in losses]
        times = [ms * 3] * (checked + spec["warmup"]) + list(ms * rng.lognormal(0, 0.01, spec["steps"]))
        return {
            "ok": True,
            "builds_s": waited,
            "step_ms": times,
            "timed_from": checked + spec["warmup"],
            "losses": losses,
            "peak_mb": 100.0,
            "warm_s": 1.0,
            "steps_seen": len(times) + 1,
            "dropout_seen": True,
        }

    return run_child


@pytest.fixture
def simulated(monkeypatch):
    def use(step_ms, wrong=frozenset(), calls=None, builds=None, level=None):
        clock = [0.0]  # simulated seconds: each run moves it by its wall time
        monkeypatch.setattr(trials_mod, "run_child", _fake_child(clock, step_ms, wrong, calls, builds, level))
        monkeypatch.setattr(trials_mod, "now", lambda: clock[0])

    return use
