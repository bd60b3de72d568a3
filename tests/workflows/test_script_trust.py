"""Script mode runs a script as plain `python` would (threads, its own profiler, chdir, os._exit)
and writes where it says: one test per case a new user hit (issue 22)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import assert_no_profiling_left, write_script
from perfloop.cli import _split_script_args, main
from perfloop.results.store import Store
from perfloop.workflows.script import ScriptError, profile_script

STEPS = """
import torch
import perfloop as pl
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
x = torch.randn(16, 32)
def step():
    with pl.annotate("step"):
        net(x).square().mean().backward()
"""


def _run_cli(tmp_path, *args, timeout=120):
    """perfloop in a fresh process (a hang or an abort shows as such)."""
    src = Path(__file__).resolve().parents[2] / "src"
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "perfloop", "profile", "--db", str(tmp_path / "r.db"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("daemon", [False, True])
def test_a_worker_thread_calling_modules_neither_breaks_the_ranges_nor_hangs(tmp_path, daemon):
    script = write_script(
        tmp_path,
        STEPS
        + f"""
import threading
m2 = torch.nn.Linear(32, 32)
stop = []
def work():
    while not stop:
        m2(torch.randn(4, 32))
t = threading.Thread(target=work, daemon={daemon})
t.start()
for _ in range(8):
    step()
stop.append(1)
""",
    )
    r = _run_cli(tmp_path, "--skip", "2", "--steps", "2", "--script", str(script))
    assert r.returncode == 0, r.stderr
    assert "INTERNAL ASSERT" not in r.stderr and "occurrence(s) of 'step'" in r.stdout


def test_a_window_without_ops_says_so_and_stores_nothing(tmp_path, capsys):
    script = write_script(
        tmp_path,
        """
    import time
    import perfloop as pl
    for _ in range(4):
        with pl.annotate("step"):
            time.sleep(0.01)
    """,
    )
    db = tmp_path / "r.db"
    assert main(["profile", "--db", str(db), "--skip", "1", "--steps", "1", "--script", str(script)]) == 2
    assert "ran no torch op" in capsys.readouterr().err
    assert not db.exists() or Store(db).artifacts(kind="profile") == []


PROFILED = """
import torch
m = torch.nn.Linear(32, 32)
with torch.profiler.profile() as p:
    for i in range(3):
        m(torch.randn(8, 32)).sum().backward()
ops = sorted({e.key for e in p.key_averages() if "::" in e.key})  # aten ops (not CUDA's start-up calls)
assert len(ops) > 5, f"the script's profiler saw {ops}"
with open("seen.txt", "w") as f:
    f.write(" ".join(ops))
"""


def test_a_scripts_own_profiler_records_what_it_would_alone_and_perfloop_says_why_it_gave_way(tmp_path):
    script = write_script(tmp_path, PROFILED)
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=True)
    alone = (tmp_path / "seen.txt").read_text()
    (tmp_path / "seen.txt").unlink()
    with pytest.raises(ValueError, match="runs torch.profiler itself.*--trace-file"), _chdir(tmp_path):
        profile_script(script, [], None, window=(0.0, 30.0))
    assert_no_profiling_left()
    assert (tmp_path / "seen.txt").read_text() == alone


def test_a_window_before_the_scripts_profiler_is_profiled_and_one_after_it_is_refused(tmp_path):
    script = write_script(
        tmp_path,
        STEPS
        + """
step(); step(); step()
with torch.profiler.profile() as p:
    step()
assert len(p.key_averages()) > 5
""",
    )
    with pytest.raises(ValueError, match="runs torch.profiler itself"):
        profile_script(script, [], "step", skip=3, steps=1)  # the 4th step runs under the script's
    assert_no_profiling_left()
    p = profile_script(script, [], "step", skip=1, steps=1)
    assert_no_profiling_left()
    assert p.calls == 1 and any(i.module == "0" for i in p.items())


class _chdir:
    def __init__(self, path):
        self.path, self.old = path, None

    def __enter__(self):
        import os

        self.old = os.getcwd()
        os.chdir(self.path)

    def __exit__(self, *exc):
        import os

        os.chdir(self.old)


@pytest.mark.slow
def test_report_and_trace_land_where_perfloop_ran_though_the_script_changes_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    script = write_script(
        tmp_path, STEPS + "import os\nos.chdir('elsewhere')\nfor _ in range(5):\n    step()\n"
    )
    r = _run_cli(
        tmp_path,
        "--skip",
        "1",
        "--steps",
        "1",
        "--report",
        "rep",
        "--trace",
        "t.json",
        "--script",
        str(script),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rep" / "index.html").exists() and (tmp_path / "t.json").exists()
    assert not (tmp_path / "elsewhere" / "rep").exists() and not (tmp_path / "elsewhere" / "t.json").exists()


def test_a_window_the_script_ends_inside_is_said_to_be_cut_short(tmp_path, capsys):
    script = write_script(tmp_path, STEPS + "for _ in range(3):\n    step()\n")
    p = profile_script(script, [], None, window=(0.0, 100.0))
    assert_no_profiling_left()
    assert any("ended" in w and "into the window of 100 s" in w for w in p.warnings)
    db = str(tmp_path / "r.db")
    assert main(["profile", "--db", db, "--window", "0:100", "--script", str(script)]) == 0
    assert "cut short" in capsys.readouterr().out
    for bad in ("nan:1", "inf:1", "0:inf", "0:nan"):
        assert main(["profile", "--db", db, "--window", bad, "--script", str(script)]) == 2
        assert "--window: must be START:DURATION in finite seconds" in capsys.readouterr().err


def test_the_script_path_given_with_equals_and_its_options_with_equals_reach_it():
    assert _split_script_args(["profile", "--script=s.py", "--lr=1", "x"]) == (
        ["profile", "--script=s.py"],
        ["--lr=1", "x"],
    )
    assert _split_script_args(["profile", "--steps", "1", "--script", "s.py", "--steps=9"]) == (
        ["profile", "--steps", "1", "--script", "s.py"],
        ["--steps=9"],
    )


def test_the_script_gets_its_equals_options(tmp_path, capsys):
    script = write_script(
        tmp_path,
        STEPS
        + """
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float, required=True)
assert ap.parse_args().lr == 1.0
for _ in range(4):
    step()
""",
    )
    db = str(tmp_path / "r.db")
    assert main(["profile", "--db", db, "--skip", "1", "--steps", "1", f"--script={script}", "--lr=1"]) == 0


@pytest.mark.slow
def test_os_exit_zero_in_the_script_still_gives_the_analysis_and_stores_it(tmp_path):
    script = write_script(tmp_path, STEPS + "import os\nfor _ in range(4):\n    step()\nos._exit(0)\n")
    r = _run_cli(tmp_path, "--skip", "1", "--steps", "1", "--json", "--script", str(script))
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    assert payload["calls"] == 1 and any("os._exit(0)" in w for w in payload["warnings"])
    assert len(Store(tmp_path / "r.db").artifacts(kind="profile")) == 1
    script = write_script(tmp_path, STEPS + "import os\nstep()\nos._exit(3)\n", "three.py")
    r = _run_cli(tmp_path, "--script", str(script))
    assert r.returncode == 3 and "os._exit(3)" in r.stderr


def test_the_documented_example_runs_as_written(tmp_path, capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    lines = [ln.strip() for ln in example.read_text().splitlines()]
    [line] = [ln for ln in lines if ln.startswith("perfloop profile")]
    argv = line.split()[1:]
    argv[argv.index("--script") + 1] = str(example)
    assert main([argv[0], "--db", str(tmp_path / "r.db"), *argv[1:]]) == 0, capsys.readouterr().err
    assert "2 occurrence(s) of 'step'" in capsys.readouterr().out
    # the profiled steps are a line of the history, keyed by script and range
    assert main(["history", "train_gpt", "--db", str(tmp_path / "r.db"), "--json"]) == 0
    [trend] = json.loads(capsys.readouterr().out)["trends"]
    assert trend["key"]["op"] == "script:train_gpt.py" and trend["key"]["variant"] == "step (profiled step)"
    assert trend["points"][0]["median_ms"] > 0


def test_perfloop_options_handed_to_a_failing_script_are_named_and_its_exit_is_its_code(tmp_path, capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    rc = main(
        [
            "profile",
            "--db",
            str(tmp_path / "r.db"),
            "--script",
            str(example),
            "--range",
            "step",
            "--size",
            "tiny",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "sys.exit(2)" in err and "SystemExit" not in err
    assert "--range reached the script" in err and "Put perfloop's options before --script" in err


def test_a_script_that_exits_non_zero_is_a_failure_with_its_code(tmp_path):
    script = write_script(tmp_path, "import sys\nsys.exit(5)\n")
    with pytest.raises(ScriptError, match=r"sys.exit\(5\)") as info:
        profile_script(script, [], "step")
    assert info.value.code == 5
    assert_no_profiling_left()


def test_report_and_exports_show_a_profile_run_and_compare_says_what_each_run_holds(tmp_path, capsys):
    script = write_script(tmp_path, STEPS + "for _ in range(4):\n    step()\n")
    db = str(tmp_path / "r.db")
    assert main(["profile", "--db", db, "--skip", "1", "--steps", "1", "--script", str(script)]) == 0
    capsys.readouterr()
    assert main(["report", "--db", db, "--run", "latest"]) == 0
    out = capsys.readouterr().out
    assert "stored profiles" in out and "script:s.py" in out and "no results" not in out
    csv_path, json_path = tmp_path / "r.csv", tmp_path / "r.json"
    assert main(["report", "--db", db, "--csv", str(csv_path), "--export-json", str(json_path)]) == 0
    [profile] = [r for r in json.loads(json_path.read_text()) if r["kind"] == "profile"]
    assert profile["op"] == "script:s.py" and profile["profile"]["ops"]
    lines = csv_path.read_text().splitlines()
    assert lines[0].endswith("kind,name,calls,commit,run_created")
    assert any(",profile op,aten::linear," in ln for ln in lines)
    script_run = profile["run_id"]
    assert (
        main(["bench", "rowsum", "--variant", "builtin", "--shape", "64x33", "--budget", "0.2", "--db", db])
        == 0
    )
    capsys.readouterr()
    assert main(["compare", "--db", db, script_run, "latest"]) == 2
    err = capsys.readouterr().err
    assert f"{script_run} holds a step profile and no measurements" in err and "different devices" not in err


@pytest.mark.slow
def test_a_dataloader_with_forked_workers_runs_as_under_plain_python(tmp_path):
    # the workers are forked from inside the script: each ends with os._exit, which must end the
    # worker there, not run perfloop's own exit path in it ("no step found", exit 2)
    script = write_script(
        tmp_path,
        """
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
        loader = DataLoader(data, batch_size=32, num_workers=2, multiprocessing_context="fork")
        for epoch in range(2):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
        print("trained")
        """,
    )
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "trained" in plain.stdout, plain.stderr
    r = _run_cli(tmp_path, "--skip", "2", "--steps", "2", "--json", "--script", str(script))
    assert r.returncode == 0, r.stderr
    assert "no step found" not in r.stderr and "exited unexpectedly" not in r.stderr
    assert json.loads(r.stdout)["calls"] == 2 and "trained" in r.stderr  # the script's print: stderr


LOOP = """
import time
import torch
lin = torch.nn.Linear(512, 512)
x = torch.randn(256, 512)  # ~1 ms a call: a window holds hundreds of calls, not tens of thousands
end = time.perf_counter() + SECONDS
while time.perf_counter() < end:
    lin(x)
"""


@pytest.mark.slow
def test_a_time_window_records_its_whole_duration_from_when_recording_began(tmp_path):
    script = write_script(tmp_path, LOOP.replace("SECONDS", "2.5"))
    r = _run_cli(tmp_path, "--window", "1:0.5", "--no-count", "--json", "--script", str(script))
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    assert 450 <= payload["wall_ms_per_call"] <= 1000, payload["wall_ms_per_call"]
    [linear] = [k for k in payload["ops"] if k["name"] == "aten::linear"]
    assert linear["calls"] > 10  # hundreds on an idle machine; one when the window closed at once


@pytest.mark.slow
def test_a_window_the_script_cuts_short_says_how_long_it_recorded(tmp_path):
    script = write_script(tmp_path, LOOP.replace("SECONDS", "0.6"))
    r = _run_cli(tmp_path, "--window", "0.2:5", "--no-count", "--json", "--script", str(script))
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    [cut] = [w for w in payload["warnings"] if w.startswith("--window: the script ended")]
    said_s = float(cut.split("profiled ")[1].split(" s only")[0])
    assert said_s == pytest.approx(payload["wall_ms_per_call"] / 1e3, rel=0.25), (
        cut,
        payload["wall_ms_per_call"],
    )


@pytest.mark.slow
def test_a_folder_with_main_runs_as_python_runs_it_and_a_scripts_help_is_not_an_error(tmp_path):
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__main__.py").write_text(textwrap.dedent(STEPS) + "for _ in range(3):\n    step()\n")
    r = _run_cli(tmp_path, "--skip", "1", "--steps", "1", "--no-count", "--json", "--script", str(pkg))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["calls"] == 1
    helpful = write_script(
        tmp_path, "import argparse\nargparse.ArgumentParser(description='trains').parse_args()\n"
    )
    r = _run_cli(tmp_path, "--script", str(helpful), "--help")
    assert r.returncode == 0, r.stderr
    assert "trains" in r.stdout and "printed its own help" in r.stderr and "no step found" not in r.stderr


# issue 52's fault probe: the script's exit status, and a profile taken before the script fails
TRAIN_THEN = """
import sys
import torch
net = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for _ in range(8):
    net(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
{end}
"""


def test_the_scripts_exit_status_is_passed_through_as_python_would(tmp_path):
    write_script(tmp_path, "import sys\nsys.exit(-1)\n")
    p = _run_cli(tmp_path, "--script", "s.py")
    assert p.returncode == 255, p.stderr  # python s.py exits 255 for sys.exit(-1)
    assert "sys.exit(-1)" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "end, status, said",
    [("sys.exit(3)", 3, "exited with sys.exit(3)"), ("raise KeyboardInterrupt", 130, "interrupted")],
)
def test_a_profile_taken_before_the_script_fails_is_kept_and_said_so(tmp_path, end, status, said):
    write_script(tmp_path, TRAIN_THEN.format(end=end))
    p = _run_cli(tmp_path, "--script", "s.py")
    assert p.returncode == status, p.stderr
    assert said in p.stderr and "the profile taken before it is kept" in p.stderr, p.stderr
    assert "nothing was stored" not in p.stderr
    assert "stored as run" in p.stdout
    [run] = Store(str(tmp_path / "r.db")).runs()
    assert run["artifacts"] == 1


def test_a_script_that_closes_stdout_still_gets_its_analysis_printed(tmp_path):
    write_script(tmp_path, TRAIN_THEN.format(end="sys.stdout.close()"))
    p = _run_cli(tmp_path, "--script", "s.py")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "stored as run" in p.stdout


def test_under_json_the_scripts_prints_go_to_stderr_and_stdout_is_the_json_alone(tmp_path, capfd):
    """`perfloop profile --json --script train.py | jq` must read: the script's prints, its
    Python's and a child process's, went to the same stdout as the JSON."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch
            lin = torch.nn.Linear(32, 32)
            opt = torch.optim.SGD(lin.parameters(), lr=0.1)
            for step in range(6):
                loss = lin(torch.randn(8, 32)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                print("step", step, "loss", round(loss.item(), 3))
            os.system("echo from-a-child-process")
            """
        )
    )
    rc = main(["profile", "--json", "--db", str(tmp_path / "r.db"), "--script", str(script)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert json.loads(out)["window"]  # the JSON, whole, alone
    assert "step 5 loss" in err and "from-a-child-process" in err
    print("after")  # stdout is perfloop's again once the script is done
    assert capfd.readouterr().out == "after\n"
