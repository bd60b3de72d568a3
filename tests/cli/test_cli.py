"""The `perfloop` command, run as a user runs it."""

import json
import subprocess
import sys

import pytest

import perfloop as pl
from helpers import busy
from perfloop.cli import main
from perfloop.results.store import Store


def run(*args):
    p = subprocess.run([sys.executable, "-m", "perfloop", *args], capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


def test_unknown_verb_and_flag_list_what_exists():
    rc, _, err = run("bneck")
    assert rc == 2 and "invalid choice" in err and "bench" in err and "demo" in err
    rc, _, err = run("env", "--frobnicate")
    assert rc == 2 and "unrecognized arguments" in err


def test_every_verb_has_help():
    for verb in [
        "env",
        "list",
        "check",
        "bench",
        "profile",
        "asm",
        "sweep",
        "report",
        "compare",
        "demo",
        "experiment",
    ]:
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0


def test_env_json_reports_versions_device_and_precision(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and info["python"]
    assert info["device"]["kind"] in ("cpu", "cuda")
    assert "float32_matmul_precision" in info["precision"]


def test_list_says_what_runs_here(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["op"], r["variant"]): r["runs_here"] for r in rows}
    assert len(by) == sum(len(pl.ops.get(o).variants) for o in pl.ops.names())
    assert by[("gelu", "naive")] == "yes"


def test_check_passes_and_unknown_names_are_usage_errors(capsys):
    assert main(["check", "softmax", "--variant", "naive", "--dtype", "fp32", "--json"]) == 0
    [r] = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["cases"] > 0 and 0 < r["of_tolerance"] < 1
    # a failure's seed reruns it as it failed
    seeded = ["check", "softmax", "--variant", "naive", "--dtype", "fp32", "--seed", "7", "--json"]
    runs = []
    for _ in range(2):
        assert main(seeded) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1]
    assert main(["check", "softmax", "--variant", "naive", "--seed", str(2**70)]) == 2
    assert "--seed" in capsys.readouterr().err
    assert main(["check", "softmaks"]) == 2
    assert "valid: " + ", ".join(pl.ops.names()) in capsys.readouterr().err
    assert main(["check", "gelu", "--variant", "fastest"]) == 2


def test_bench_stores_rows_and_rejects_bad_shapes_and_dtypes(tmp_path, capsys):
    db = str(tmp_path / "b.db")
    args = [
        "bench",
        "gelu",
        "--variant",
        "naive",
        "--variant",
        "builtin",
        "--shape",
        "128x96",
        "--budget",
        "0.3",
        "--db",
        db,
    ]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == {"naive", "builtin"} and rows["builtin"]["baseline"] == "naive"
    assert rows["naive"]["gbps"] > 0 and rows["builtin"]["speedup_ci"][0] <= rows["builtin"]["speedup"]
    stored = Store(db).rows(out["run_id"])
    assert sorted(r["variant"] for r in stored if r["op"] == "gelu") == ["builtin", "naive"]
    assert [r["op"] for r in stored if r["op"] != "gelu"] == ["_reference"]  # the gate's, once a run
    assert main([*args]) == 0
    assert "speed-up" in capsys.readouterr().out
    assert main(["bench", "gelu", "--shape", "12xq", "--db", db]) == 2
    assert "e.g. 4096x4096" in capsys.readouterr().err
    assert main(["bench", "gelu", "--dtype", "fp13", "--db", db]) == 2
    assert "fp32, fp16, bf16" in capsys.readouterr().err


def test_compare_flags_a_real_slowdown_and_passes_noise(tmp_path, capsys):
    db = str(tmp_path / "c.db")
    s = Store(db)
    runs = []
    for ms in (1.0, 1.0, 1.6):  # the same function twice, then 60% slower
        run = s.new_run(f"busy {ms}")
        s.add(run, pl.bench(busy(ms), budget_s=0.4), op="busy", variant="v", shape=(1,), dtype="fp32")
        runs.append(run)
    assert main(["compare", runs[0], runs[1], "--fail-above", "5%", "--db", db, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["verdict"].startswith("same") and not row["regression"]
    assert main(["compare", runs[0], runs[2], "--fail-above", "5%", "--db", db, "--json"]) == 1
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["regression"] and row["ratio"] == pytest.approx(1.6, rel=0.1)
    assert main(["compare", runs[0], "nope", "--db", db]) == 2
    assert main(["compare", runs[0], runs[2], "--fail-above", "lots", "--db", db]) == 2


def test_report_exports_and_a_corrupt_db_is_a_usage_error(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    assert (
        main(["bench", "rowsum", "--variant", "builtin", "--shape", "64x33", "--budget", "0.2", "--db", db])
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "report",
                "--csv",
                str(tmp_path / "r.csv"),
                "--export-json",
                str(tmp_path / "r.json"),
                "--db",
                db,
            ]
        )
        == 0
    )
    assert "rowsum" in (tmp_path / "r.csv").read_text()
    assert json.loads((tmp_path / "r.json").read_text())[0]["shape"] == "64x33"
    assert main(["report", "--run", "missing", "--db", db]) == 2
    bad = tmp_path / "bad.db"
    bad.write_text("garbage" * 50)
    assert main(["report", "--db", str(bad)]) == 2
    assert "not a usable perfloop database" in capsys.readouterr().err


def test_perfloop_runs_without_triton_and_says_why():
    code = (
        "import sys, json, io, contextlib; sys.modules['triton'] = None\n"
        "from perfloop.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf): main(['list', '--json'])\n"
        "rows = json.loads(buf.getvalue())\n"
        "print(json.dumps({r['op'] + '/' + r['variant']: r['runs_here'] for r in rows}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    here = json.loads(p.stdout.strip().splitlines()[-1])
    assert here["gelu/triton"].startswith("no: needs Triton")
    assert here["gelu/naive"] == "yes"


def test_help_lists_the_exit_codes_and_every_environment_variable_perfloop_reads():
    import pathlib
    import re

    src = pathlib.Path(pl.__file__).parent
    names = {m for f in src.rglob("*.py") for m in re.findall(r"PERFLOOP_[A-Z_]+", f.read_text())}
    rc, out, _ = run("--help")
    assert rc == 0 and "exit status:" in out and "130" in out
    assert names and all(n in out for n in names), names - {n for n in names if n in out}


def test_every_argument_of_every_verb_has_help_text():
    import argparse

    from perfloop.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{verb} {a.option_strings or a.dest}"
        for verb, p in sub.choices.items()
        for a in p._actions
        if a.help is None and a.dest != "help"
    ]
    assert missing == []


def test_shell_completion_knows_every_verb_and_its_flags():
    pytest.importorskip("shtab")
    rc, out, _ = run("completion", "bash")
    assert rc == 0
    for word in ("tune", "profile", "compare", "--budget", "--import-aside", "--allow-numerics"):
        assert word in out, word
    rc, _, err = run("completion", "fish")
    assert rc == 2 and "invalid choice" in err
