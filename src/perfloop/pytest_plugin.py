"""pytest plugin: record kernel timings in a test suite and fail on a regression.

    def test_my_kernel_speed(perfloop):
        x = torch.randn(1 << 20, device="cuda")
        perfloop.bench(my_kernel, x, name="my_kernel/1M")

    pytest --perfloop-save base.json             # record a baseline (merged into an existing one)
    pytest --perfloop-db runs.db                 # keep every session's timings: `perfloop history`
    pytest --perfloop-compare base.json          # fail a test that got slower; pytest-benchmark's
           [--perfloop-fail-above 5]             #   JSON is read too; by more than 5% (default),
           [--perfloop-strict]                   #   beyond noise; strict: "cannot judge" fails too
    pytest --perfloop-skip | --perfloop-only     # leave out, or run only, the tests that benchmark
    pytest --perfloop-disable                    # call each benchmarked function once, untimed
    pytest --perfloop-benchmark-json out.json    # write pytest-benchmark's format

A slowdown fails only past the larger of the threshold and the run-to-run noise floor, judged
on the fast tails of the samples and divided by a reference workload measured in both
sessions (harness.gate says how). A measurement is keyed by its `name`, else by the test's
file path relative to its project root and the test's name (a test's second unnamed call adds
`#2`), so the key does not depend on the folder pytest was started from. A baseline none of
whose keys this session measured fails the session: a check that silently compares nothing is
no check. Every output path is checked before the first test runs.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported where a test takes a measurement: a session that takes none stays light
    from perfloop.harness.measurement import Measurement


def pytest_addoption(parser):
    g = parser.getgroup("perfloop", "perfloop benchmarks")
    g.addoption("--perfloop-save", metavar="PATH", help="write the measurements taken to PATH (JSON)")
    g.addoption(
        "--perfloop-compare",
        metavar="PATH",
        help="compare against a saved baseline (perfloop's "
        "--perfloop-save file, or pytest-benchmark's JSON saved with --benchmark-save-data)",
    )
    g.addoption(
        "--perfloop-fail-above",
        metavar="PCT",
        type=float,
        default=None,
        help="slowdown in percent beyond which a compared test fails (default 5, or [tool.perfloop] "
        "threshold), if beyond noise",
    )
    g.addoption(
        "--perfloop-strict",
        action="store_true",
        help="a comparison the gate cannot judge fails the test (default: a warning)",
    )
    g.addoption(
        "--perfloop-db",
        metavar="PATH",
        help="also keep the measurements in the results store "
        "at PATH, a run per session: `perfloop history` follows each test",
    )
    g.addoption(
        "--perfloop-benchmark-json",
        metavar="PATH",
        help="also write the measurements in pytest-benchmark's JSON format",
    )
    g.addoption("--perfloop-skip", action="store_true", help="skip the tests that use the perfloop fixture")
    g.addoption(
        "--perfloop-only", action="store_true", help="run only the tests that use the perfloop fixture"
    )
    g.addoption(
        "--perfloop-disable",
        action="store_true",
        help="call each benchmarked function once, untimed (bench returns None)",
    )


def stable_key(path: Path, name: str) -> str:
    """`name` of a test in `path`, with the path relative to its project's root (the nearest
    folder above it holding pyproject.toml, setup.cfg, setup.py or .git), in / form."""
    path = Path(path).resolve()
    root = next(
        (
            p
            for p in path.parents
            if any((p / m).exists() for m in ("pyproject.toml", "setup.cfg", "setup.py", ".git"))
        ),
        path.parent,
    )
    return f"{path.relative_to(root).as_posix()}::{name}"


INTERLEAVABLE = {"budget_s", "work", "flush_l2", "target_ci", "warmup_s"}
DEFAULT_FAIL_ABOVE = 5.0


@dataclass
class _State:
    """What one pytest session's perfloop keeps, in the config's stash (pytest's place for a
    plugin's own data on its objects)."""

    notes: list = field(default_factory=list)
    taken: dict = field(default_factory=dict)  # key -> Measurement
    owner: dict = field(default_factory=dict)  # a measurement's name -> the test that took it
    test_of: dict = field(default_factory=dict)  # key -> the test that took it
    failed: set = field(default_factory=set)  # the tests that failed: their timings are not kept
    verdicts: dict = field(default_factory=dict)
    baseline: dict = field(default_factory=dict)
    matched: set = field(default_factory=set)
    fail_above: float = 0.0


STATE = pytest.StashKey[_State]()


def state(config) -> _State:
    """This session's perfloop state (empty where pytest_configure did not run: --help)."""
    return config.stash.get(STATE, None) or _State()


class Recorder:
    def __init__(self, config, key: str, nodeid: str = ""):
        self.config = config
        self.key = key
        self.nodeid = nodeid
        self.unnamed = 0

    def _key(self, name: str | None) -> str:
        """The key of this call: its name, else the test's key (`#2`, `#3` on its later unnamed
        calls: one key each, so the baseline keeps every one). A name given twice is an error."""
        if name is None:
            self.unnamed += 1
            return self.key if self.unnamed == 1 else f"{self.key}#{self.unnamed}"
        owner = state(self.config).owner.get(name)
        if owner is not None:
            raise ValueError(
                f"name: {name!r} was already measured in this session (by {owner}); give each "
                "perfloop.bench call its own name"
            )
        state(self.config).owner[name] = self.nodeid
        return name

    def bench(self, fn, *args, name: str | None = None, **kwargs) -> Measurement | None:
        """Time fn(*args) -- interleaved, round by round, with the reference workload the gate
        divides out, unless options only bench() takes are given -- and check it against the
        baseline. Under --perfloop-disable, fn(*args) runs once and None is returned."""
        key = self._key(name)
        if self.config.getoption("--perfloop-disable"):
            fn(*args)
            return None
        from perfloop.device import default_device
        from perfloop.harness import gate
        from perfloop.harness.timing import bench, compare

        if set(kwargs) <= INTERLEAVABLE:
            c = compare({key: lambda: fn(*args)}, reference=gate.reference(default_device()), **kwargs)
            m = c.measurements[key]
            m.meta["reference_samples_ms"] = list(c.reference.samples_ms)
        else:
            m = bench(fn, *args, label=key, **kwargs)
        state(self.config).taken[key] = m
        state(self.config).test_of[key] = self.nodeid
        base = state(self.config).baseline.get(key)
        if base is not None:
            self._judge(key, base, m)
        return m

    def _judge(self, key: str, base: Measurement, m: Measurement) -> None:
        from perfloop.harness import gate

        state(self.config).matched.add(key)
        v = gate.judge(
            base.samples_ms,
            m.samples_ms,
            fail_above_pct=state(self.config).fail_above,
            kind=(m.env.get("device") or {}).get("kind", "cpu"),
            a_ref=base.meta.get("reference_samples_ms"),
            b_ref=m.meta.get("reference_samples_ms"),
            contended=gate.contended(base.meta) or gate.contended(m.meta),
        )
        state(self.config).verdicts[key] = v
        if v.verdict.startswith("cannot judge"):  # said, never passed in silence
            if self.config.getoption("--perfloop-strict"):
                pytest.fail(f"perfloop: {key}: {v.verdict} (--perfloop-strict)", pytrace=False)
            warnings.warn(f"perfloop: {key}: {v.verdict}", PerfloopWarning, stacklevel=3)
        if v.regression:
            pytest.fail(
                f"perfloop regression in {key}: {m.median_ms:.4g} ms vs baseline "
                f"{base.median_ms:.4g} ms, {v.adjusted:.2f}x slower (judged on {v.method})",
                pytrace=False,
            )


class PerfloopWarning(UserWarning):
    """A comparison the plugin could not make (the machine's pace changed between the runs)."""


def _positive_times(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in v
        )
    )


def _entry(path: str, k: str, v: Any) -> Measurement:
    """One saved measurement, each field checked, as a Measurement; a UsageError naming the key
    and the field otherwise."""
    where = f"--perfloop-compare: baseline {path}, key {k!r}"
    if not isinstance(v, dict) or "samples_ms" not in v:
        raise pytest.UsageError(f"{where}: no samples_ms")
    if not _positive_times(v["samples_ms"]):
        raise pytest.UsageError(
            f"{where}: samples must be finite positive times (found NaN, inf, zero or text)"
        )
    for part, kind in (("meta", dict), ("env", dict), ("work", dict)):
        if v.get(part) is not None and not isinstance(v[part], kind):
            raise pytest.UsageError(f"{where}: {part} must be an object, got a {type(v[part]).__name__}")
    ref = (v.get("meta") or {}).get("reference_samples_ms")
    if ref is not None and not _positive_times(ref):
        raise pytest.UsageError(f"{where}: meta.reference_samples_ms must be finite positive times")
    try:
        from perfloop.harness.measurement import Measurement

        return Measurement.from_dict(v)
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None


def _from_pytest_benchmark(path: str, raw: dict) -> dict[str, Measurement]:
    """pytest-benchmark's saved JSON: each benchmark's raw timings (seconds, kept with
    --benchmark-save-data) as a Measurement keyed as this plugin keys the same test."""
    from perfloop.harness.measurement import Measurement

    out = {}
    for b in raw.get("benchmarks") or []:
        name = b.get("fullname") or b.get("name") if isinstance(b, dict) else None
        data = (b.get("stats") or {}).get("data") if isinstance(b, dict) else None
        if not name:
            raise pytest.UsageError(f"--perfloop-compare: {path}: a pytest-benchmark entry without a name")
        if not _positive_times(data):
            raise pytest.UsageError(
                f"--perfloop-compare: {path}, {name!r}: no raw timings (stats.data); save "
                "it with pytest --benchmark-save-data, so the gate sees the samples"
            )
        key = stable_key(Path(name.split("::")[0]), name.split("::", 1)[1]) if "::" in name else name
        out[key] = Measurement(
            samples_ms=tuple(s * 1e3 for s in data),
            label=key,
            env={"pytest-benchmark": raw.get("machine_info") or {}},
        )
    return out


def _read_baseline(path: str) -> dict[str, Measurement]:
    """The saved measurements, each checked: a file that is not one of ours is a usage error."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise pytest.UsageError(f"--perfloop-compare: cannot read baseline {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise pytest.UsageError(
            f"--perfloop-compare: baseline {path} holds a {type(raw).__name__}, not the "
            "{key: measurement} object --perfloop-save writes"
        )
    if "machine_info" in raw and "benchmarks" in raw:
        return _from_pytest_benchmark(path, raw)
    return {k: _entry(path, k, v) for k, v in raw.items()}


def _check_output(flag: str, path: str, holds_object: bool = False) -> None:
    """An output path that can be written, checked before any test runs."""
    p = Path(path)
    if not path.strip():
        raise pytest.UsageError(f"{flag}: an empty path; give a file, e.g. {flag} perf.json")
    if p.is_dir():
        raise pytest.UsageError(f"{flag}: {p} is a folder; give a file path in it")
    folder = p.resolve().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"{flag}: cannot create {folder}: {exc}") from exc
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise pytest.UsageError(f"{flag}: {p if p.exists() else folder} is not writable; choose another path")
    if holds_object and p.exists():
        try:
            held = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise pytest.UsageError(
                f"{flag}: {p} exists and is not a baseline to merge into ({exc}); choose another path"
            ) from exc
        if not isinstance(held, dict):
            raise pytest.UsageError(
                f"{flag}: {p} exists and holds a {type(held).__name__}, not a baseline to "
                "merge into; choose another path"
            )


def _check_db(path: str) -> None:
    from perfloop.results.store import Store, StoreError

    if not path.strip():
        raise pytest.UsageError("--perfloop-db: an empty path; give a file, e.g. --perfloop-db runs.db")
    try:
        Store(path).check_writable()
    except StoreError as exc:
        raise pytest.UsageError(f"--perfloop-db: {exc}") from None


def _settings(config) -> None:
    """[tool.perfloop] of the project's pyproject.toml as the defaults of the flags not given:
    threshold, db, reference (the baseline compared against), strict."""
    from perfloop.settings import SettingsError, load

    try:
        s = load(config.rootpath)
    except SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None
    opt = config.option
    if opt.perfloop_fail_above is None and s.threshold is not None:
        opt.perfloop_fail_above = s.threshold
    if opt.perfloop_db is None and s.db is not None:
        opt.perfloop_db = s.db
    if opt.perfloop_compare is None and opt.perfloop_save is None and s.reference is not None:
        if Path(s.reference).exists():
            opt.perfloop_compare = s.reference
        else:
            state(config).notes.append(
                f"[tool.perfloop] reference {s.reference} does not exist yet: nothing "
                f"was compared; save one with --perfloop-save {s.reference}"
            )
    opt.perfloop_strict = opt.perfloop_strict or s.strict


def pytest_configure(config):
    config.stash[STATE] = _State()
    _settings(config)
    fail_above = config.getoption("--perfloop-fail-above", default=None)
    state(config).fail_above = DEFAULT_FAIL_ABOVE if fail_above is None else fail_above
    if fail_above is not None and not (math.isfinite(fail_above) and fail_above >= 0):
        raise pytest.UsageError(f"--perfloop-fail-above: must be a percentage >= 0, got {fail_above}")
    path = config.getoption("--perfloop-compare", default=None)
    if path:
        state(config).baseline = _read_baseline(path)
    save = config.getoption("--perfloop-save", default=None)
    if save is not None:
        _check_output("--perfloop-save", save, holds_object=True)
    out = config.getoption("--perfloop-benchmark-json", default=None)
    if out is not None:
        _check_output("--perfloop-benchmark-json", out)
    db = config.getoption("--perfloop-db", default=None)
    if db is not None:
        _check_db(db)


def pytest_collection_modifyitems(config, items):
    """--perfloop-skip / --perfloop-only: the tests that take the perfloop fixture left out, or kept."""
    skip, only = config.getoption("--perfloop-skip"), config.getoption("--perfloop-only")
    if skip and only:
        raise pytest.UsageError("--perfloop-skip and --perfloop-only: give one of them")
    if not (skip or only):
        return
    marker = pytest.mark.skip(reason="perfloop benchmark, left out by --perfloop-skip")
    kept, dropped = [], []
    for item in items:
        benches = "perfloop" in getattr(item, "fixturenames", ())
        if skip and benches:
            item.add_marker(marker)
        (kept if benches or not only else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every measurement this session took, as a table (pytest-benchmark prints one every
    session), then each compared one's verdict, slowest first."""
    taken = state(config).taken
    verdicts = state(config).verdicts
    for note in state(config).notes:
        terminalreporter.write_line(f"perfloop: {note}", yellow=True)
    if taken:
        from perfloop.harness.measurement import fmt_ms

        terminalreporter.section("perfloop benchmarks")
        width = max(len(k) for k in taken)
        terminalreporter.write_line(
            f"{'name':<{width}}  {'median':>10}  {'p20':>10}  {'p80':>10}  {'n':>5}  note"
        )
        for key, m in sorted(taken.items(), key=lambda kv: -kv[1].median_ms):
            note = "; ".join(w.split(":")[0] for w in m.warnings)
            terminalreporter.write_line(
                f"{key:<{width}}  {fmt_ms(m.median_ms):>10}  {fmt_ms(m.p20_ms):>10}  "
                f"{fmt_ms(m.p80_ms):>10}  {m.n:>5}  {note}"
            )
    if not verdicts:
        return
    terminalreporter.section("perfloop comparison")
    for key, v in sorted(verdicts.items(), key=lambda kv: -kv[1].adjusted):
        terminalreporter.write_line(
            f"{key}: {v.adjusted:.3f}x, {v.verdict} (raw {v.ratio:.3f}x; {v.method})", red=v.regression
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        state(item.config).failed.add(item.nodeid)


def _kept(config) -> dict:
    """The measurements of the tests that passed: a failed test's timing (a wrong result, an
    error half-way) is no baseline and no history."""
    s = state(config)
    return {k: m for k, m in s.taken.items() if s.test_of.get(k) not in s.failed}


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    base = state(config).baseline
    taken = list(state(config).taken)
    keys = list(base)
    if base and taken and not state(config).matched:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        msg = (
            f"perfloop: the baseline has {len(keys)} keys and none matched the {len(taken)} measured "
            f"here (baseline: {', '.join(keys[:3])}; measured: {', '.join(taken[:3])}): nothing was "
            "compared. Name each measurement (perfloop.bench(..., name=...)) or save the baseline "
            "again."
        )
        if tr:
            tr.write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _save(config)
    _save_benchmark_json(config)
    _keep(config)


def _keep(config) -> None:
    path = config.getoption("--perfloop-db", default=None)
    taken = _kept(config)
    if not path or not taken:
        return
    from perfloop.results.store import Store
    from perfloop.workflows.runs import start_run

    store = Store(path)
    run_id = start_run(store, "pytest --perfloop-db")
    for key, m in taken.items():
        store.add(run_id, m, op=f"test:{key}", variant="pytest", shape=(), dtype="")


def _write(path: str, payload: Any) -> None:
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def _save(config) -> None:
    path = config.getoption("--perfloop-save", default=None)
    taken = _kept(config)
    dropped = sorted(set(state(config).taken) - set(taken))
    if path and dropped:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr:
            why = "its test failed; a failed test's timing is no baseline"
            tr.write_line(f"perfloop: not saved: {', '.join(dropped)} ({why})")
    if not path or not taken:
        return
    merged = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    merged.update({k: m.to_dict() for k, m in taken.items()})  # -k runs replace only their own keys
    _write(path, merged)


def _save_benchmark_json(config) -> None:
    """The measurements in pytest-benchmark's layout (seconds; the raw timings in stats.data)."""
    import datetime as dt
    import statistics

    path = config.getoption("--perfloop-benchmark-json", default=None)
    taken = _kept(config)
    if not path or not taken:
        return
    from perfloop.device import env_fingerprint

    benches = []
    for key, m in taken.items():
        s = [x / 1e3 for x in m.samples_ms]
        q1, q3 = m.p20_ms, m.p80_ms
        stats = {
            "min": min(s),
            "max": max(s),
            "mean": statistics.fmean(s),
            "median": m.median_ms / 1e3,
            "stddev": statistics.stdev(s) if len(s) > 1 else 0.0,
            "rounds": len(s),
            "iterations": 1,
            "q1": q1 / 1e3,
            "q3": q3 / 1e3,
            "iqr": m.iqr_ms / 1e3,
            "ops": 1 / statistics.fmean(s),
            "total": sum(s),
            "data": s,
        }
        path_part, _, name = key.partition("::")
        benches.append(
            {
                "group": None,
                "name": name or key,
                "fullname": key,
                "params": None,
                "param": None,
                "extra_info": {"perfloop": True},
                "options": {},
                "stats": stats,
            }
        )
    env = env_fingerprint()
    _write(
        path,
        {
            "machine_info": {"perfloop": env},
            "commit_info": {"id": env.get("git")},
            "benchmarks": benches,
            "datetime": dt.datetime.now(dt.timezone.utc).isoformat(),
            "version": "perfloop",
        },
    )


@pytest.fixture
def perfloop(request) -> Recorder:
    """Benchmark inside a test: `perfloop.bench(fn, *args, name=...)` -> Measurement."""
    return Recorder(request.config, stable_key(request.node.path, request.node.name), request.node.nodeid)
