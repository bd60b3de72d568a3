"""tune's edges, each said plainly: options that can never work refused with what would, a
candidate module that fails to import, a name given twice, a budget spent before the first
timed run, a script whose own loss is NaN, strict JSON. In-process where the process boundary is
not what is tested."""

import json
import math
import re

import pytest

from helpers import write_script
from perfloop.cli import main
from perfloop.cli.output import emit_json
from perfloop.workflows.tune import trials as trials_mod
from perfloop.workflows.tune import tuner

MLP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(40):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _tune(tmp_path, capsys, *args):
    script = write_script(tmp_path, MLP, name="train.py")
    rc = main(["tune", "--db", str(tmp_path / "r.db"), *args, "--script", str(script)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_steps_too_few_to_tell_a_speed_up_are_refused(tmp_path, capsys):
    # one search run of 2 steps against 6 or 9 baseline steps: Mann-Whitney cannot reach p < 0.05
    for steps in ("1", "2"):
        rc, _, err = _tune(tmp_path, capsys, "--steps", steps)
        assert (
            rc == 2 and f"--steps: {steps} steps a run cannot tell a speed-up at 95%; give 3 or more" in err
        ), err


def test_a_candidate_module_that_raises_on_import_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "badmod.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    rc, _, err = _tune(tmp_path, capsys, "--try", "badmod:X")
    assert rc == 2 and "--try badmod:X: cannot load it (RuntimeError: no GPU here)" in err, err
    assert "Traceback" not in err


def test_a_candidate_named_twice_is_tried_once():
    opts = tuner.Options(script="train.py", tried=["fused-optimizer", "compile", "fused-optimizer"])
    assert [k for k, _, _ in tuner.propose([], False, opts)] == ["fused-optimizer", "compile"]


def test_a_budget_spent_before_the_first_timed_run_says_what_would_fit(tmp_path, capsys):
    rc, _, err = _tune(tmp_path, capsys, "--budget", "1s")
    assert rc == 2 and "--budget: 1 s ran out before the unchanged script's first timed run" in err, err
    assert "failed: None" not in err and "profiling it took" in err and "give --budget" in err


def test_a_script_whose_own_loss_is_nan_is_told_so(simulated, monkeypatch):
    simulated({(): 40.0, ("compile",): 35.0})
    fake = trials_mod.run_child

    def nan_losses(spec, timeout_s, logs):
        got = fake(spec, timeout_s, logs)
        return got | {"losses": [math.nan] * len(got["losses"])}

    monkeypatch.setattr(trials_mod, "run_child", nan_losses)
    monkeypatch.setattr(tuner, "_diagnose", lambda opts, spec, *a: ([], True, spec))
    opts = tuner.Options(script="train.py", steps=15, warmup=3, tried=["compile"], profile_first=False)
    with pytest.raises(
        ValueError, match=r"--script: the unchanged script's own loss is not finite \(nan at step 0\)"
    ):
        tuner.tune(opts)


def test_json_is_strict_where_a_figure_is_not_finite(capsys):
    emit_json({"speedup": math.nan, "ci": [math.inf, 1.0], "nested": {"p": -math.inf}})
    assert json.loads(capsys.readouterr().out) == {"speedup": None, "ci": [None, 1.0], "nested": {"p": None}}


def test_the_help_of_try_names_every_candidate_in_the_registry(capsys):
    from perfloop.workflows.tune.candidates import CANDIDATES

    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    helptext = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))  # argparse wraps at hyphens
    listed = helptext.split("advised or not: ")[1].split(", or package.module:NAME")[0].split(", ")
    assert listed == [c.name for c in CANDIDATES] and "pinned-memory" in listed and "sdpa-no-cudnn" in listed


def test_a_run_spec_crosses_as_json_and_an_unknown_key_is_named():
    from perfloop.workflows.tune.spec import RunSpec

    spec = RunSpec(script="train.py", steps=4, dropout="off", check_steps=9, candidates=["compile"])
    back = RunSpec.of(json.loads(json.dumps(spec.to_json())) | {"out": "r.json", "keep": {}})
    assert (
        back == spec and back.checked_steps == 9 and RunSpec(script="t.py", check_steps=9).checked_steps == 0
    )
    with pytest.raises(ValueError, match=r"spec: unknown keys \['stpes'\]"):
        RunSpec.of({"script": "train.py", "stpes": 4})
