import os
import shutil

import pytest
import torch

import perfloop as pl
from perfloop.analysis.asm import AsmError, inspect_variant, vector_widths
from perfloop.device import occupancy

B_NOT_ROUNDED = """
import json
import torch
import perfloop as pl
from perfloop.analysis import asm
from perfloop.ops.matmul_relu import asm_specs

spec = asm_specs.asm_specs("fp32")[0]
spec["constexprs"] = {**spec["constexprs"], "ROUND": False}
asm_specs.asm_specs = lambda ty: [spec]
rep = asm._triton_report(pl.ops.get("matmul_relu"), "triton", torch.float32, "sm_90")
print(json.dumps(rep["kernels"][0]["memory_ops"]))
"""


def test_occupancy_follows_the_sm90_limits():
    assert occupancy(32, 256, 0) == (1.0, "threads")  # 8 blocks x 256 threads = 2048
    occ, by = occupancy(255, 256, 0)  # 256 regs x 256 threads = the whole file: one block
    assert occ == pytest.approx(256 / 2048) and by == "registers"
    occ, by = occupancy(32, 128, 100 * 1024)  # two 100 KiB blocks fit in 228 KiB
    assert occ == pytest.approx(2 * 128 / 2048) and by == "shared memory"


def test_vector_widths_reads_ptx():
    ptx = "ld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1];\nst.global.b16 [%rd2], %rs1;\n"
    assert vector_widths(ptx) == {"ld 16B": 1, "st 2B": 1}
    pipelined = (  # a pipelined loop's copies into shared memory: 16-byte, a gathered 4-byte, TMA
        "cp.async.cg.shared.global [ %r45 + 0 ], [ %rd27 + 0 ], 0x10, %r3;\n"
        "cp.async.ca.shared.global [ %r46 + 0 ], [ %rd28 + 0 ], 0x4, %r4;\n"
        "cp.async.ca.shared.global [ %r47 + 0 ], [ %rd29 + 0 ], 0x4, %r4;\n"
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%r1], [%rd1, {%r2, %r3}], [%r4];\n"
    )
    assert vector_widths(pipelined) == {"cp.async 16B": 1, "cp.async 4B": 2, "tma": 1}


@pytest.mark.skipif(pl.device.triton_version() is None, reason="needs Triton")
def test_triton_gelu_compiles_for_sm90_with_16_byte_accesses():
    rep = inspect_variant(pl.ops.get("gelu"), "triton", torch.float32)
    [k] = rep["kernels"]
    assert k["memory_ops"].get("ld 16B", 0) >= 2 and k["memory_ops"].get("st 16B", 0) >= 2
    assert k["registers"] > 0 and k.get("spill_stores", 0) == 0
    assert k["elements_per_thread"] == 8
    assert ".target sm_90" in rep["ptx"]


@pytest.mark.slow
@pytest.mark.skipif(pl.device.triton_version() is None, reason="needs Triton")
def test_tf32_matmul_fills_shared_memory_16_bytes_at_a_time():
    """TF32 wgmma reads a shared-memory operand K-major only. The TF32 kernel takes the product
    as C^T = B^T A^T with a row-major B rounded in registers: every copy into shared memory is 16
    bytes; with B^T left a plain load (a shared-memory operand of the wrong layout), Triton
    gathers it 4 bytes at a time (0.38x cuBLAS on the H200, run25)."""
    import json
    import subprocess
    import sys

    rep = inspect_variant(pl.ops.get("matmul_relu"), "triton", torch.float32)
    [k] = rep["kernels"]
    assert k["memory_ops"].get("cp.async 16B", 0) > 0 and "cp.async 4B" not in k["memory_ops"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compile for the GPU, not the interpreter
    out = subprocess.run(
        [sys.executable, "-c", B_NOT_ROUNDED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]).get("cp.async 4B", 0) > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_gelu_report_lists_each_instantiation_for_the_dtype():
    rep = inspect_variant(pl.ops.get("gelu"), "cuda", torch.bfloat16)
    names = [k["name"] for k in rep["kernels"]]
    assert names and all("bfloat16" in n for n in names)
    assert any("16B" in n for n in rep["notes"])


def test_pytorch_variants_point_to_profile_and_bad_arch_is_rejected():
    with pytest.raises(AsmError, match="perfloop profile"):
        inspect_variant(pl.ops.get("gelu"), "naive")
    with pytest.raises(AsmError, match="--arch"):
        inspect_variant(pl.ops.get("gelu"), "triton", arch="hopper")
