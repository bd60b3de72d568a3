"""compare reads exported JSON and pytest-benchmark files as well as stored runs, and shows only
what changed, in the order asked (issue 52). Samples are drawn from a seeded generator, not timed:
the verdicts do not depend on the machine's load."""

import json

import numpy as np
import pytest

from perfloop.cli import main
from perfloop.harness.measurement import Measurement
from perfloop.results.store import Store


def _samples(seed: int, center_ms: float, n: int = 40) -> list[float]:
    return list(center_ms * np.random.default_rng(seed).lognormal(0.0, 0.02, n))


def _two_runs(db: str) -> tuple[str, str]:
    """Run a: two ops at 1 ms and 2 ms; run b: the first 50% slower, the second the same."""
    s = Store(db)
    runs = []
    for seed, slow in ((1, 1.0), (2, 1.5)):
        run = s.new_run(f"synthetic {slow}")
        for op, ms in (("copy", 1.0 * slow), ("gemm", 2.0)):
            m = Measurement(samples_ms=_samples(seed * 10 + len(op), ms))
            s.add(run, m, op=op, variant="v", shape=(64,), dtype="fp32")
        runs.append(run)
    return runs[0], runs[1]


def _export(db: str, run: str, path) -> str:
    assert main(["report", "--run", run, "--export-json", str(path), "--db", db]) == 0
    return str(path)


def test_exported_files_compare_as_the_runs_they_hold(tmp_path, capsys):
    db = str(tmp_path / "c.db")
    a, b = _two_runs(db)
    fa, fb = _export(db, a, tmp_path / "a.json"), _export(db, b, tmp_path / "b.json")
    capsys.readouterr()
    assert main(["compare", fa, fb, "--json", "--db", str(tmp_path / "absent.db")]) == 0  # no db needed
    from_files = {r["op"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main(["compare", a, b, "--json", "--db", db]) == 0
    from_store = {r["op"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert from_files["copy"]["verdict"] == from_store["copy"]["verdict"] == "slower"
    assert from_files["gemm"]["verdict"].startswith("same")
    assert from_files["copy"]["ratio"] == pytest.approx(from_store["copy"]["ratio"])
    assert from_files["copy"]["b_ms"] / from_files["copy"]["a_ms"] == pytest.approx(1.5, rel=0.03)
    assert main(["compare", a, fb, "--db", db, "--fail-above", "10"]) == 1  # a run against a file
    assert "REGRESSION" in capsys.readouterr().out


def test_only_changed_and_sort(tmp_path, capsys):
    db = str(tmp_path / "c.db")
    a, b = _two_runs(db)
    assert main(["compare", a, b, "--json", "--only-changed", "--db", db]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in out["rows"]] == ["copy"] and out["not_shown"] == 1
    assert main(["compare", a, b, "--only-changed", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "copy" in text and "gemm" not in text and "1 row(s) judged the same" in text
    assert main(["compare", a, b, "--json", "--sort", "name", "--db", db]) == 0
    assert [r["op"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["copy", "gemm"]
    assert main(["compare", a, b, "--json", "--sort", "ratio", "--db", db]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["op"] == "copy" and rows[0]["b_ms"] / rows[0]["a_ms"] > rows[1]["b_ms"] / rows[1]["a_ms"]
    with pytest.raises(SystemExit) as exc:  # argparse's own error, with the choices
        main(["compare", a, b, "--sort", "size", "--db", db])
    assert exc.value.code == 2 and "order, name, ratio" in capsys.readouterr().err.replace("'", "")


def _pytest_benchmark(path, centers: dict, seed: int, data: bool = True) -> str:
    benches = []
    for i, (name, ms) in enumerate(centers.items()):
        xs = [x / 1e3 for x in _samples(seed + i, ms)]
        stats = {"min": min(xs), "max": max(xs), "median": float(np.median(xs)), "rounds": len(xs)}
        benches.append(
            {
                "name": name,
                "fullname": f"tests/test_speed.py::{name}",
                "group": None,
                "params": None,
                "stats": stats | ({"data": xs} if data else {}),
            }
        )
    doc = {
        "machine_info": {"cpu": {"brand_raw": "Some CPU"}, "processor": "x86_64"},
        "commit_info": {"id": "abc123", "dirty": False},
        "benchmarks": benches,
        "datetime": "2026-12-05T00:00:00",
        "version": "5.1.0",
    }
    path.write_text(json.dumps(doc))
    return str(path)


def test_pytest_benchmark_files_are_judged_with_their_samples(tmp_path, capsys):
    fa = _pytest_benchmark(tmp_path / "0001.json", {"test_parse": 3.0, "test_dump": 0.5}, seed=1)
    fb = _pytest_benchmark(tmp_path / "0002.json", {"test_parse": 2.0, "test_dump": 0.5}, seed=7)
    assert main(["compare", fa, fb, "--json"]) == 0
    rows = {r["op"].split("::")[1]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["test_parse"]["verdict"] == "faster"
    assert rows["test_parse"]["b_ms"] / rows["test_parse"]["a_ms"] == pytest.approx(2 / 3, rel=0.03)
    assert rows["test_dump"]["verdict"].startswith("same")


def test_pytest_benchmark_files_without_samples_show_medians_and_say_why_not_judged(tmp_path, capsys):
    fa = _pytest_benchmark(tmp_path / "a.json", {"test_parse": 3.0}, seed=1, data=False)
    fb = _pytest_benchmark(tmp_path / "b.json", {"test_parse": 6.0}, seed=2, data=False)
    assert main(["compare", fa, fb, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["ratio"] == pytest.approx(2.0, rel=0.05) and not row["regression"]
    assert "--benchmark-save-data" in row["verdict"]
    assert main(["compare", fa, fb, "--strict"]) == 3


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        ('{"benchmarks": [{"name": "t", "stats": {"median": NaN}}]}', "NaN is not a time"),
        ('{"rows": []}', "neither a perfloop export"),
        ('{"benchmarks": []}', "holds no benchmarks"),
        ('{"benchmarks": [{"name": "t", "stats": {"median": 0.1, "data": [0.1, -1]}}]}', "positive"),
        ('[{"kind": "measurement", "run_id": "r1"}, {"kind": "measurement", "run_id": "r2"}]', "2 runs"),
        ('[{"kind": "profile", "run_id": "r1"}]', "no measurements"),
    ],
)
def test_a_bad_file_is_a_clear_usage_error_naming_it(tmp_path, capsys, content, says):
    good = _pytest_benchmark(tmp_path / "good.json", {"test_parse": 3.0}, seed=1)
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert main(["compare", good, str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and says in err and "Traceback" not in err
