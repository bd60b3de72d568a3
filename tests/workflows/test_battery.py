"""The battery of real-library scripts (examples/battery/), each written the way its library's own
docs write one, at its tiny size: it runs under plain python, `perfloop profile --script` finds
its steps and leaves its output as plain python prints it, and `perfloop tune --script` measures
it with nothing of perfloop's crashing. A tune costs minutes on 2 cores, so it runs on two
scripts that stand for the rest: a transformers model called by keyword (pl.patch's case), and
gpt-fast's decode loop with no range and no optimizer; scripts/gpu-battery tunes them all."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BATTERY = Path(__file__).resolve().parents[2] / "examples" / "battery"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "BATTERY_SIZE": "tiny"}

# (case, script, its arguments)
CASES = [
    ("hf_llama_loop", "hf_llama_loop.py", ()),
    ("hf_gpt2_loop", "hf_gpt2_loop.py", ()),
    ("hf_trainer", "hf_trainer.py", ()),
    ("hf_generate", "hf_generate.py", ()),
    ("hf_generate_static_sampled", "hf_generate.py", ("--static", "--sample")),
    ("lightning_fit", "lightning_fit.py", ()),
    ("accelerate_loop", "accelerate_loop.py", ()),
    ("gptfast_decode", "gptfast_decode.py", ()),
    ("timm_train", "timm_train.py", ()),
]
# case -> tune's budget and its own flags: the HF model on pl.patch alone (its keyword-only calls
# are the case to reach), the gpt-fast loop on what tune advises (compile); each budget fits its
# runs on 2 unloaded cores about twice over
TUNED = {"hf_llama_loop": ("180s", ("--try", "patch")), "gptfast_decode": ("90s", ())}


def _needs(case: str):
    if case == "timm_train":
        try:
            import timm  # noqa: F401
        except Exception as exc:  # timm needs torchvision, which the CPU build here cannot load
            return pytest.mark.skip(reason=f"timm does not import here ({type(exc).__name__}); GPU only")
    return pytest.mark.slow


def _params(cases):
    return [pytest.param(case, script, args, id=case, marks=_needs(case)) for case, script, args in cases]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=ENV)


def _tail(p: subprocess.CompletedProcess) -> str:
    return f"rc {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


@functools.cache
def _plain(script: str, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(BATTERY / script), *args], BATTERY)


def _done_line(stdout: str) -> str:
    """The script's last line of results ("done: ..."): its losses or tokens, no timings."""
    lines = [line for line in stdout.splitlines() if line.startswith("done:")]
    assert lines, f"the script printed no 'done:' line:\n{stdout[-2000:]}"
    return lines[-1]


@pytest.mark.parametrize(("case", "script", "args"), _params(CASES))
def test_the_script_runs_under_plain_python(case, script, args):
    p = _plain(script, args)
    assert p.returncode == 0, _tail(p)
    _done_line(p.stdout)


@pytest.mark.parametrize(("case", "script", "args"), _params(CASES))
def test_profile_finds_its_steps_and_the_script_prints_what_it_prints_alone(case, script, args, tmp_path):
    db = tmp_path / "runs.sqlite"
    p = _run(
        [sys.executable, "-m", "perfloop", "profile", "--db", str(db), "--script", script, *args], BATTERY
    )
    assert p.returncode == 0, _tail(p)
    # "train.py: profiled 2 occurrence(s) of 'optimizer.step'", "... 2 decode call(s) of LlamaForCausalLM"
    found = re.search(rf"^{re.escape(script)}: profiled (\d+) ", p.stdout, re.MULTILINE)
    assert found and int(found.group(1)) >= 1, _tail(p)
    plain = _plain(script, args)
    assert plain.returncode == 0, _tail(plain)
    assert _done_line(p.stdout) == _done_line(plain.stdout)


@pytest.mark.parametrize(("case", "script", "args"), _params(c for c in CASES if c[0] in TUNED))
def test_tune_measures_the_script_and_no_run_fails_but_by_the_budget(case, script, args, tmp_path):
    cmd = [sys.executable, "-m", "perfloop", "tune", "--db", str(tmp_path / "tune.sqlite"), "--json"]
    budget, flags = TUNED[case]
    cmd += ["--budget", budget, "--steps", "4", "--warmup", "2", "--rounds", "1", *flags]
    p = _run([*cmd, "--script", script, *args], BATTERY)
    assert p.returncode == 0, _tail(p)
    result = json.loads(p.stdout)
    assert result["baseline_ms"], _tail(p)
    # the unchanged script runs clean, so a run that failed other than by the budget's clock
    # failed by what perfloop did to it
    failed = {r["candidate"]: r["error"] for r in result["candidates"] if r["error"] and not r["cut"]}
    assert not failed, f"{failed}\n{_tail(p)}"
    assert any(r["median_ms"] for r in result["candidates"]), f"no candidate was measured\n{_tail(p)}"
