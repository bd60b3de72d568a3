"""perfloop tune on a generation script that names no range (issue 65): the profile's step is
its model's decode call, so tune reads it as a generation script -- each decode call a step,
each candidate checked on the greedy tokens -- with no --range given."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPTS = importlib.util.spec_from_file_location(
    "script_model_calls", Path(__file__).resolve().parents[1] / "test_script_model_calls.py"
)
_scripts = importlib.util.module_from_spec(_SCRIPTS)
_SCRIPTS.loader.exec_module(_scripts)
GEN, HF = _scripts.GEN, _scripts.HF  # the generation scripts profile's tests run

PLANT = textwrap.dedent(
    """
    import torch
    from perfloop.workflows.tune.candidates import Candidate, Numerics

    def _skew(child):
        def skew(model, args, kwargs):
            with torch.no_grad():
                model.output.weight.add_(0.05 * torch.randn_like(model.output.weight))
        child.on_model(skew)

    SKEWED = Candidate(name="skewed-head", what="the output layer 5% off", lines=(), apply=_skew,
                       numerics=Numerics.REORDERED)
    """
)


def _tune(folder, script: str, tried: list[str], *argv: str) -> dict:
    (folder / "gen.py").write_text(script)
    (folder / "plant.py").write_text(PLANT)
    cmd = [sys.executable, "-m", "perfloop", "tune", "--db", str(folder / "t.db"), "--json"]
    cmd += ["--budget", "3m", "--steps", "6", "--warmup", "2", "--rounds", "1"]
    cmd += [a for name in tried for a in ("--try", name)]
    p = subprocess.run(
        [*cmd, "--script", "gen.py", *argv], capture_output=True, text=True, timeout=400, cwd=folder
    )
    assert p.returncode == 0, p.stderr
    assert "tune: a generation script: a step: one decode call of" in p.stderr, p.stderr
    return json.loads(p.stdout)


@pytest.mark.slow
def test_a_gpt_fast_decode_loop_is_tuned_on_its_decode_calls_and_checked_on_its_tokens(tmp_path):
    data = _tune(tmp_path, GEN, ["plant:SKEWED", "channels-last"], "40")
    assert data["checked_on"] == "tokens" and data["tokens_per_step"] == 1
    said = "a step: one decode call of Transformer (1 token per sequence, batch 1); "
    said += "prefill (1 call, 12 tokens) left out"
    assert said in data["notes"]
    rows = {r["candidate"]: r for r in data["candidates"]}
    assert rows["skewed-head"]["verified"] is False
    assert "refused: greedy token" in rows["skewed-head"]["loss_check"]["reason"]
    same = rows["channels-last"]
    assert same["verified"] is True and "greedy tokens equal the script's" in same["loss_check"]["reason"]
    assert same["tokens_per_s"] == pytest.approx(1e3 / same["median_ms"])


@pytest.mark.slow
def test_a_transformers_generate_script_is_tuned_as_a_generation_script_with_no_range(tmp_path):
    data = _tune(
        tmp_path,
        HF.replace("max_new_tokens=24, min_new_tokens=24", "max_new_tokens=40, min_new_tokens=40"),
        ["channels-last"],
    )
    assert data["checked_on"] == "tokens"
    assert any(
        n.startswith("a step: one decode call of LlamaForCausalLM (1 token per sequence")
        for n in data["notes"]
    )
    [row] = data["candidates"]
    assert row["verified"] is True and row["median_ms"] > 0
