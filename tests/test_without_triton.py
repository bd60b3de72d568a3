"""The default install has no Triton (it is the [triton] extra): perfloop imports, pl.patch and
script mode run there, say that the fused kernels are missing and how to get them, and never blame
the user's script for perfloop's own import (issue 52). Each case runs in a Python whose
`import triton` fails (tests/fixtures/no_triton/sitecustomize.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = ROOT / "tests" / "fixtures" / "no_triton"


def _run(code: str, *args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BLOCK), str(ROOT / "src")]))
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    cmd = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_in_this_python_triton_cannot_be_imported():
    r = _run("import triton")
    assert r.returncode != 0 and "No module named 'triton'" in r.stderr


def test_pl_patch_runs_and_says_the_kernels_need_triton_and_how_to_get_them():
    r = _run(
        textwrap.dedent(
            """
            import torch, perfloop as pl, perfloop.nn as pnn
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
            x = torch.randn(4, 16)
            want = m(x)
            report = pl.patch(m, x)
            assert torch.equal(m(x), want)
            assert pnn.LayerNorm(16)(x).shape == x.shape  # torch's forward, with the reason said once
            print(report)
            """
        )
    )
    assert r.returncode == 0, r.stderr
    assert "patched 0 of 2" in r.stdout and 'pip install "perfloop[triton]"' in r.stdout, r.stdout


def test_script_mode_profiles_a_script_and_says_pl_patch_would_need_triton(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
            for step in range(8):
                loss = torch.nn.functional.cross_entropy(m(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
            """
        )
    )
    env_db = str(tmp_path / "h.db")
    r = _run("", "-m", "perfloop", "profile", "--db", env_db, "--script", str(script), interpret=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LayerNorm module: pl.patch swaps it" in r.stdout
    assert "but here: Triton is not installed" in r.stdout and 'pip install "perfloop[triton]"' in r.stdout


def test_perfloops_own_failed_import_is_not_called_the_scripts(tmp_path):
    """A script that runs a fused kernel by name where Triton is missing: perfloop's import fails,
    and the message names perfloop and the extra, not 'the script raised'."""
    script = tmp_path / "uses_kernel.py"
    script.write_text("from perfloop.ops.gelu import triton_impl\n")
    r = _run("", "-m", "perfloop", "profile", "--db", str(tmp_path / "h.db"), "--script", str(script))
    assert r.returncode != 0
    said = r.stdout + r.stderr
    assert "perfloop, called by the script, could not import 'triton'" in said, said[-2000:]
    assert 'pip install "perfloop[triton]"' in said and "the script raised" not in said


@pytest.mark.parametrize("module", ["perfloop.nn", "perfloop.nn.compiled", "perfloop.workflows.script"])
def test_perfloops_modules_import_without_triton(module):
    r = _run(f"import {module}")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_scripts_own_failed_import_is_still_the_scripts(tmp_path):
    script = tmp_path / "imports_triton.py"
    script.write_text("import triton\n")
    r = _run("", "-m", "perfloop", "profile", "--db", str(tmp_path / "h.db"), "--script", str(script))
    said = r.stdout + r.stderr
    assert r.returncode != 0 and "the script raised ModuleNotFoundError" in said, said[-2000:]
