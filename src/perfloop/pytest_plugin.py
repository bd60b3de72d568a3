"""pytest plugin: record kernel timings in a test suite and fail on a regression.

    def test_my_kernel_speed(perfloop):
        x = torch.randn(1 << 20, device="cuda")
        perfloop.bench(my_kernel, x, name="my_kernel/1M")

    pytest --perfloop-save base.json             # record a baseline (merged into an existing one)
    pytest --perfloop-db runs.db                 # keep every session's timings: `perfloop history`
    pytest --perfloop-compare base.json          # fail a test that got slower
           [--perfloop-fail-above 5]             #   by more than 5% (default), beyond noise

A slowdown fails only past the larger of the threshold and the run-to-run noise floor, judged
on the fast tails of the samples and divided by a reference workload measured in both
sessions (harness.gate says how). A measurement is keyed by its `name`, else by the test's
file path relative to its project root and the test's name, so the key does not depend on the
folder pytest was started from. A baseline none of whose keys this session measured fails the
session: a check that silently compares nothing is no check.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from perfloop.harness.measurement import Measurement


def pytest_addoption(parser):
    g = parser.getgroup("perfloop", "perfloop benchmarks")
    g.addoption("--perfloop-save", metavar="PATH", help="write the measurements taken to PATH (JSON)")
    g.addoption("--perfloop-compare", metavar="PATH", help="compare against a saved baseline")
    g.addoption(
        "--perfloop-fail-above",
        metavar="PCT",
        type=float,
        default=5.0,
        help="slowdown in percent beyond which a compared test fails (default 5), if beyond noise",
    )
    g.addoption("--perfloop-db", metavar="PATH", help="also keep the measurements in the results store "
                "at PATH, a run per session: `perfloop history` follows each test")  # fmt: skip


def stable_key(path: Path, name: str) -> str:
    """`name` of a test in `path`, with the path relative to its project's root (the nearest
    folder above it holding pyproject.toml, setup.cfg, setup.py or .git), in / form."""
    path = Path(path).resolve()
    root = next((p for p in path.parents if any((p / m).exists() for m in
                                                   ("pyproject.toml", "setup.cfg", "setup.py", ".git"))),
                path.parent)  # fmt: skip
    return f"{path.relative_to(root).as_posix()}::{name}"


INTERLEAVABLE = {"budget_s", "work", "flush_l2", "target_ci", "warmup_s"}


class Recorder:
    def __init__(self, config, key: str):
        self.config = config
        self.key = key

    def bench(self, fn, *args, name: str | None = None, **kwargs) -> Measurement:
        """Time fn(*args) -- interleaved, round by round, with the reference workload the gate
        divides out, unless options only bench() takes are given -- and check it against the
        baseline."""
        from perfloop.device import default_device
        from perfloop.harness import gate
        from perfloop.harness.timing import bench, compare

        key = name or self.key
        if set(kwargs) <= INTERLEAVABLE:
            c = compare({key: lambda: fn(*args)}, reference=gate.reference(default_device()), **kwargs)
            m = c.measurements[key]
            m.meta["reference_samples_ms"] = list(c.reference.samples_ms)
        else:
            m = bench(fn, *args, label=key, **kwargs)
        self.config._perfloop_taken[key] = m
        base = self.config._perfloop_baseline.get(key)
        if base is not None:
            self.config._perfloop_matched.add(key)
            v = gate.judge(
                base.samples_ms,
                m.samples_ms,
                fail_above_pct=self.config.getoption("--perfloop-fail-above"),
                kind=(m.env.get("device") or {}).get("kind", "cpu"),
                a_ref=base.meta.get("reference_samples_ms"),
                b_ref=m.meta.get("reference_samples_ms"),
                contended=gate.contended(base.meta) or gate.contended(m.meta),
            )
            self.config._perfloop_verdicts[key] = v
            if v.verdict.startswith("cannot judge"):  # said, never passed in silence
                warnings.warn(f"perfloop: {key}: {v.verdict}", PerfloopWarning, stacklevel=2)
            if v.regression:
                pytest.fail(
                    f"perfloop regression in {key}: {m.median_ms:.4g} ms vs baseline "
                    f"{base.median_ms:.4g} ms, {v.adjusted:.2f}x slower (judged on {v.method})",
                    pytrace=False,
                )
        return m


class PerfloopWarning(UserWarning):
    """A comparison the plugin could not make (the machine's pace changed between the runs)."""


def _read_baseline(path: str) -> dict[str, Measurement]:
    """The saved measurements, each checked: a file that is not one of ours is a usage error."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise pytest.UsageError(f"--perfloop-compare: cannot read baseline {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise pytest.UsageError(f"--perfloop-compare: baseline {path} holds a {type(raw).__name__}, not the "
                                "{key: measurement} object --perfloop-save writes")  # fmt: skip
    out = {}
    for k, v in raw.items():
        samples = v.get("samples_ms") if isinstance(v, dict) else None
        if not isinstance(samples, list) or not samples:
            raise pytest.UsageError(f"--perfloop-compare: baseline {path}, key {k!r}: no samples_ms")
        if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in samples):
            raise pytest.UsageError(f"--perfloop-compare: baseline {path}, key {k!r}: samples must be finite "
                                    "positive times (found NaN, inf, zero or text)")  # fmt: skip
        out[k] = Measurement.from_dict(v)
    return out


def pytest_configure(config):
    config._perfloop_taken = {}
    config._perfloop_verdicts = {}
    config._perfloop_baseline = {}
    config._perfloop_matched = set()
    path = config.getoption("--perfloop-compare", default=None)
    if path:
        config._perfloop_baseline = _read_baseline(path)
    save = config.getoption("--perfloop-save", default=None)
    if save:  # fail now, not after the suite ran
        folder = Path(save).resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise pytest.UsageError(f"--perfloop-save: cannot create {folder}: {exc}") from exc
        if Path(save).exists():
            try:
                json.loads(Path(save).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise pytest.UsageError(f"--perfloop-save: {save} exists and is not a baseline to merge into "
                                        f"({exc}); choose another path") from exc  # fmt: skip


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every compared measurement's verdict, slowest first: what was judged, and how."""
    verdicts = getattr(config, "_perfloop_verdicts", {})
    if not verdicts:
        return
    terminalreporter.section("perfloop comparison")
    for key, v in sorted(verdicts.items(), key=lambda kv: -kv[1].adjusted):
        terminalreporter.write_line(f"{key}: {v.adjusted:.3f}x, {v.verdict} (raw {v.ratio:.3f}x; {v.method})",
                                    red=v.regression)  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    base = getattr(config, "_perfloop_baseline", {})
    taken = list(getattr(config, "_perfloop_taken", {}))
    keys = list(base)
    if base and taken and not config._perfloop_matched:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        msg = (f"perfloop: the baseline has {len(keys)} keys and none matched the {len(taken)} measured "
               f"here (baseline: {', '.join(keys[:3])}; measured: {', '.join(taken[:3])}): nothing was "
               "compared. Name each measurement (perfloop.bench(..., name=...)) or save the baseline "
               "again.")  # fmt: skip
        if tr:
            tr.write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _save(config)
    _keep(config)


def _keep(config) -> None:
    path = config.getoption("--perfloop-db", default=None)
    taken = getattr(config, "_perfloop_taken", {})
    if not path or not taken:
        return
    from perfloop.results.store import Store
    from perfloop.workflows.runs import start_run

    store = Store(path)
    run_id = start_run(store, "pytest --perfloop-db")
    for key, m in taken.items():
        store.add(run_id, m, op=f"test:{key}", variant="pytest", shape=(), dtype="")


def _save(config) -> None:
    path = config.getoption("--perfloop-save", default=None)
    taken = getattr(config, "_perfloop_taken", {})
    if not path or not taken:
        return
    merged = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    merged.update({k: m.to_dict() for k, m in taken.items()})  # -k runs replace only their own keys
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)


@pytest.fixture
def perfloop(request) -> Recorder:
    """Benchmark inside a test: `perfloop.bench(fn, *args, name=...)` -> Measurement."""
    return Recorder(request.config, stable_key(request.node.path, request.node.name))
