"""[tool.perfloop] as the defaults a team commits (the command line overriding them), `perfloop
runs`, and `compare --strict` (issue 37)."""

import json
import math
import random

import pytest

from perfloop.cli import main
from perfloop.harness.measurement import Measurement
from perfloop.results.store import Store
from perfloop.settings import SettingsError, load


def _project(tmp_path, table: str):
    (tmp_path / "pyproject.toml").write_text(f"[project]\nname = 'user'\n\n[tool.perfloop]\n{table}\n")
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    return sub


def test_settings_are_read_from_the_nearest_pyproject_and_paths_are_its_folders(tmp_path):
    sub = _project(tmp_path, 'db = "perf/r.db"\nthreshold = 7\nbudget = 0.5\nstrict = true')
    s = load(sub)
    assert s.source == tmp_path / "pyproject.toml" and s.db == str(tmp_path / "perf" / "r.db")
    assert (s.threshold, s.budget, s.strict, s.reference) == (7.0, 0.5, True, None)


@pytest.mark.parametrize(
    "table, says",
    [
        ("tresh = 5", "unknown key(s) tresh; known: db, threshold"),
        ("threshold = -1", "threshold must be a percentage >= 0, got -1"),
        ("budget = 0", "budget must be seconds > 0, got 0"),
        ('strict = "yes"', "strict must be true or false"),
        ("db = 3", "db must be a path, got 3"),
    ],
)
def test_a_wrong_setting_is_named_with_its_file_and_key(tmp_path, table, says, monkeypatch, capsys):
    sub = _project(tmp_path, table)
    with pytest.raises(SettingsError, match="tool.perfloop") as info:
        load(sub)
    assert says in str(info.value)
    monkeypatch.chdir(sub)
    assert main(["runs"]) == 2
    assert says in capsys.readouterr().err


def _stored(db, level_b=1.0, ref_b=1.0, commit_b="bbbbbbbbbbbb"):
    rng, s = random.Random(4), Store(db)
    for commit, level, ref in (("aaaaaaaaaaaa", 1.0, 1.0), (commit_b, level_b, ref_b)):
        run = s.new_run(f"perfloop bench gelu  # {commit}", {"git": commit, "device": {"name": "AMD EPYC"}})
        for op, lv in (("gelu", level), ("_reference", ref)):
            samples = tuple(lv * math.exp(rng.gauss(0, 0.01)) for _ in range(30))
            m = Measurement(samples_ms=samples, env={"git": commit, "device": {"name": "AMD EPYC"}})
            s.add(run, m, op=op, variant="v", shape=(64,), dtype="fp32")
    return [r["run_id"] for r in s.runs()][::-1]


def test_settings_give_the_db_and_threshold_and_a_flag_overrides_them(tmp_path, monkeypatch, capsys):
    sub = _project(tmp_path, 'db = "perf/r.db"\nthreshold = 50')
    (tmp_path / "perf").mkdir()
    a, b = _stored(tmp_path / "perf" / "r.db", level_b=1.3, ref_b=1.0)
    monkeypatch.chdir(sub)
    monkeypatch.delenv("PERFLOOP_DB", raising=False)
    assert main(["compare", a, b, "--json"]) == 0  # 1.3x is under the file's 50%
    assert json.loads(capsys.readouterr().out)["rows"][0]["verdict"] == "slower"
    assert main(["compare", a, b, "--fail-above", "10"]) == 1  # the flag wins
    other = tmp_path / "other.db"
    _stored(other)
    capsys.readouterr()
    assert main(["runs", "--db", str(other), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 2


def test_runs_lists_id_time_commit_device_command_and_rows(tmp_path, capsys):
    db = tmp_path / "r.db"
    a, b = _stored(db)
    assert main(["runs", "--db", str(db), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["runs"]
    assert [r["run_id"] for r in listed] == [b, a]  # newest first
    assert listed[0]["commit"] == "bbbbbbbbbbbb" and listed[0]["device"] == "AMD EPYC"
    assert listed[0]["rows"] == 2 and "bench gelu" in listed[0]["command"]
    assert main(["runs", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert a in out and "bbbbbbbbbbbb" in out and "AMD EPYC" in out
    assert main(["runs", "--db", str(tmp_path / "missing.db")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "missing.db").exists()


def test_strict_turns_cannot_judge_into_exit_3_with_the_reason(tmp_path, capsys):
    db = tmp_path / "r.db"
    a, b = _stored(db, level_b=2.0, ref_b=10.0)  # the machine itself ran 10x slower, the code's way
    assert main(["compare", a, b, "--db", str(db)]) == 0
    assert "cannot judge" in capsys.readouterr().out
    assert main(["compare", a, b, "--db", str(db), "--strict"]) == 3
    assert "--strict: gelu/v 64: cannot judge: the machine ran" in capsys.readouterr().err
