"""`profile --script`: a user's script, run unchanged, profiled over a window of its steps."""

import json
import textwrap

import pytest
import torch

from perfloop.analysis import annotate
from perfloop.cli import main
from perfloop.results.store import Store
from perfloop.workflows.script import ScriptError, profile_script

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import perfloop as pl

    steps = int(sys.argv[1])
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(128, 64)
    for i in range(steps):
        with pl.annotate("step"):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        with pl.annotate("eval"):
            net(x)
    if len(sys.argv) > 2:
        raise RuntimeError(sys.argv[2])
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def _clean():
    assert not torch.autograd.profiler._is_profiler_enabled
    assert annotate.RANGE_WATCHERS == []


def test_the_window_is_the_steps_after_the_skipped_ones(script):
    p = profile_script(script, ["6"], "step", skip=2, steps=3)
    _clean()
    assert p.calls == 3
    rows = {r.name: r for r in p.breakdown("module")}
    assert {"0", "2", "optimizer"} <= set(rows)  # the Sequential's children, and SGD
    # three steps only: each Linear ran forward once per step (the eval ranges are outside)
    assert sum(1 for i in p.items() if i.module == "0" and i.phase == "forward") == 3
    assert rows["0"].flops > 0  # the fourth step was counted


def test_a_range_that_never_occurs_names_the_ranges_seen(script):
    with pytest.raises(ValueError, match=r"no range named 'stpe'.*step \(x2\), eval \(x2\)"):
        profile_script(script, ["2"], "stpe")
    _clean()
    with pytest.raises(ValueError, match="needs 5"):
        profile_script(script, ["2"], "step", skip=3, steps=2)
    _clean()


def test_a_script_that_raises_stops_the_profiler_and_says_so(script):
    with pytest.raises(ScriptError, match="RuntimeError: boom") as info:
        profile_script(script, ["3", "boom"], "step", skip=0, steps=2)
    assert isinstance(info.value.original, RuntimeError)
    _clean()


def test_a_script_without_ranges_is_profiled_over_a_time_window(tmp_path):
    p = tmp_path / "plain.py"
    p.write_text(
        "import torch\nnet = torch.nn.Linear(32, 32)\nfor _ in range(200):\n    net(torch.randn(8, 32))\n"
    )
    prof = profile_script(p, [], None, window=(0.0, 0.05))
    _clean()
    assert prof.calls == 1 and any(i.module == "Linear" for i in prof.items())


def test_the_cli_prints_modules_ops_and_opportunities_and_stores_the_profile(script, tmp_path, capsys):
    db = tmp_path / "r.db"
    assert main(["profile", "--db", str(db), "--steps", "2", "--script", str(script), "5"]) == 0
    out = capsys.readouterr().out
    assert "module" in out and "optimizer" in out and "opportunit" in out and "step: wall" in out
    [art] = Store(db).artifacts(kind="profile")
    assert art["op"] == "script:train.py" and art["payload"]["modules"]
    assert main(["profile", "--db", str(db), "--json", "--script", str(script), "5"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["calls"] == 2 and payload["diagnosis"]["opportunities"]


def test_the_cli_passes_the_scripts_error_on_and_stores_nothing(script, tmp_path, capsys):
    db = tmp_path / "r.db"
    assert main(["profile", "--db", str(db), "--script", str(script), "4", "boom"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and "nothing was stored" in err
    assert not db.exists() or Store(db).artifacts(kind="profile") == []
    assert main(["profile", "--db", str(db), "--range", "nope", "--script", str(script), "2"]) == 2
    assert "ranges seen: step (x2), optimizer.step (x2), eval (x2)" in capsys.readouterr().err


def test_two_profiled_runs_compare_op_by_op(script, tmp_path, capsys):
    db = tmp_path / "r.db"
    for steps in ("4", "4"):
        assert main(["profile", "--db", str(db), "--steps", "1", "--script", str(script), steps]) == 0
    capsys.readouterr()
    assert main(["compare", "--db", str(db), "previous", "latest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in out["ops"]}
    assert "aten::linear" in names and {"0", "2", "optimizer"} <= {r["name"] for r in out["modules"]}
    assert all(r["a_ms"] > 0 and r["b_ms"] > 0 for r in out["ops"] if r["name"] == "aten::linear")


def test_the_report_page_shows_the_roofline_modules_and_opportunities(script, tmp_path, capsys):
    out = tmp_path / "page"
    args = ["profile", "--db", str(tmp_path / "r.db"), "--steps", "1", "--report", str(out)]
    assert main([*args, "--script", str(script), "4"]) == 0
    page = (out / "index.html").read_text()
    assert "step profile" in page and "roofline" in page and "opportunity" in page
    assert (out / "step-0-roofline.png").stat().st_size > 1000 and (out / "step-0-modules.png").exists()
    (tmp_path / "file").write_text("")
    bad = ["profile", "--report", str(tmp_path / "file" / "x"), "--script", str(script), "4"]
    assert main(bad) == 2 and "--report: cannot write" in capsys.readouterr().err


def test_the_cli_runs_a_script_in_the_environment_it_was_given(tmp_path, monkeypatch):
    """On a CPU the CLI sets TRITON_INTERPRET=1 for perfloop's own kernels; a profiled script must
    not inherit it: a model patched with perfloop's fused ops then ran them in Triton's
    interpreter, its 8 ms step profiled at 5.19 s (found trying a patched minGPT in script mode)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = tmp_path / "seen.txt"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, torch\n"
        "open(sys.argv[1], 'w').write(os.environ.get('TRITON_INTERPRET', 'unset'))\n"
        "m = torch.nn.Linear(8, 8)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    m(torch.randn(4, 8)).sum().backward()\n"
        "    opt.step()\n"
    )
    assert (
        main(
            [
                "profile",
                "--db",
                str(tmp_path / "r.db"),
                "--skip",
                "1",
                "--steps",
                "1",
                "--script",
                str(script),
                str(seen),
            ]
        )
        == 0
    )
    assert seen.read_text() == "unset"


def test_only_the_verbs_that_run_perfloops_kernels_set_triton_interpret():
    """bisect runs the user's command and `profile --script` the user's script: neither gets the
    interpreter switch perfloop's own kernels need on a CPU."""
    from types import SimpleNamespace as A

    from perfloop.cli import runs_own_kernels

    assert runs_own_kernels(A(verb="check")) and runs_own_kernels(A(verb="profile", script=None))
    assert not runs_own_kernels(A(verb="profile", script="train.py"))
    assert not runs_own_kernels(A(verb="profile", script=None, trace_file="t.json"))
    assert not runs_own_kernels(A(verb="bisect")) and not runs_own_kernels(A(verb="history"))
