"""perfloop tune on a generation script (issue 54): a step is one occurrence of the script's
range (one token's call), and a candidate is checked on the greedy tokens its model picks
instead of a loss: a planted skewed output layer is refused at the first token it changes,
torch.compile is verified token for token."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from perfloop.workflows.tune.trials import CheckedOn, Trial
from perfloop.workflows.tune.tuner import reference
from perfloop.workflows.tune.verify import Logits, judge_tokens

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llama_decode.py"

PLANT = textwrap.dedent(
    """
    import torch
    from perfloop.workflows.tune.candidates import Candidate, Numerics

    def _skew(child):
        def skew(model, args, kwargs):
            with torch.no_grad():
                model.output.weight.add_(0.02 * torch.randn_like(model.output.weight))
        child.on_model(skew)

    SKEWED = Candidate(name="skewed-head", what="the output layer 2% off", lines=(), apply=_skew,
                       numerics=Numerics.REORDERED)
    """
)


def _run(*tokens):  # each position's logits: its token 1.0, the others 0
    return Logits(list(tokens), [[1.0, 0.0]] * len(tokens), [[t, t + 1] for t in tokens], [1.0] * len(tokens))


def test_tokens_are_judged_equal_up_to_where_the_scripts_own_runs_part():
    assert judge_tokens(_run(5, 6, 7), _run(5, 6, 7), _run(5, 6, 7), 2e-4).ok
    bad = judge_tokens(_run(5, 9, 7), _run(5, 6, 7), _run(5, 6, 7), 2e-4)
    assert not bad.ok and "greedy token 9 at position 1 where the script's is 6" in bad.reason
    own = judge_tokens(_run(5, 6, 1), _run(5, 6, 7), _run(5, 6, 8), 2e-4)  # the script itself parts at 2
    assert own.ok and "part at position 2" in own.reason
    assert not judge_tokens(Logits([]), _run(5), _run(5), 2e-4).ok
    unread = judge_tokens(_run(5), Logits([]), None, 2e-4)  # no logits read: never "ok"
    assert not unread.ok and not unread.checked and "not checked" in unread.reason


def test_a_generation_script_is_read_against_compile_reduce_overhead_where_it_was_tried():
    default, graphed, tf32 = Trial(("compile",)), Trial(("compile-reduce-overhead",)), Trial(("tf32",))
    trials = [tf32, default, graphed]
    assert reference(trials, CheckedOn.TOKENS) is graphed  # gpt-fast's decode: CUDA graphs
    assert reference(trials, CheckedOn.LOSS) is default
    assert reference([tf32, default], CheckedOn.TOKENS) is default  # on the CPU: no CUDA graphs
    assert reference([tf32], CheckedOn.TOKENS) is None


@pytest.mark.slow
def test_a_generation_script_is_tuned_on_its_decode_range_and_checked_on_its_tokens(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    shutil.copy(EXAMPLE, folder / "generate.py")
    (folder / "plant.py").write_text(PLANT)
    before = sorted(os.listdir(folder))
    cmd = [sys.executable, "-m", "perfloop", "tune", "--db", str(tmp_path / "t.db"), "--json"]
    cmd += ["--budget", "4m", "--steps", "8", "--warmup", "3", "--rounds", "1", "--range", "decode"]
    cmd += ["--try", "plant:SKEWED", "--try", "compile", "--script", "generate.py"]
    cmd += ["--dtype", "fp32", "--vocab", "512", "--layers", "1", "--dim", "128", "--max_new_tokens", "24"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=folder)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["checked_on"] == "tokens"
    rows = {r["candidate"]: r for r in data["candidates"]}
    skewed, compiled = rows["skewed-head"]["loss_check"], rows["compile"]["loss_check"]
    assert rows["skewed-head"]["verified"] is False and "refused: greedy token" in skewed["reason"], skewed
    assert rows["compile"]["verified"] is True and "greedy tokens equal the script's" in compiled["reason"]
    assert rows["compile"]["median_ms"] > 0 and rows["compile"]["runs"] == 1
    assert data["compile_reference"] == "compile" and data["tokens_per_step"] == 1  # batch 1, a token a call
    assert rows["compile"]["tokens_per_s"] == pytest.approx(1e3 / rows["compile"]["median_ms"])
    assert sorted(os.listdir(folder)) == before
