"""CUDA C++ sources: they compile with nvcc for sm_90, and a failed build shows its log."""

import shutil
import subprocess
from pathlib import Path

import pytest

import perfloop as pl


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_sources_compile_with_nvcc_for_sm90():
    from perfloop.ops.cuda_build import ptxas_report

    for cu in Path(pl.ops.__file__).parent.glob("*/kernel.cu"):
        rep = ptxas_report(cu, arch="sm_90")
        assert rep["kernels"], f"{cu}: no kernels in the ptxas report"
        for name, info in rep["kernels"].items():
            assert info["registers"] > 0, name
            assert info.get("spill_stores", 0) == 0, f"{name} spills"


def test_nvcc_failure_is_reported_with_its_log(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    from perfloop.ops.cuda_build import ptxas_report

    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k() { this is not cuda; }\n")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        ptxas_report(bad)
    assert subprocess.run(["nvcc", "--version"], capture_output=True).returncode == 0
