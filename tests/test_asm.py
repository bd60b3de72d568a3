import shutil

import pytest
import torch

import perfloop as pl
from perfloop.asm import AsmError, inspect_variant, occupancy, vector_widths


def test_occupancy_follows_the_sm90_limits():
    assert occupancy(32, 256, 0) == (1.0, "threads")  # 8 blocks x 256 threads = 2048
    occ, by = occupancy(255, 256, 0)  # 256 regs x 256 threads = the whole file: one block
    assert occ == pytest.approx(256 / 2048) and by == "registers"
    occ, by = occupancy(32, 128, 100 * 1024)  # two 100 KiB blocks fit in 228 KiB
    assert occ == pytest.approx(2 * 128 / 2048) and by == "shared memory"


def test_vector_widths_reads_ptx():
    ptx = "ld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1];\nst.global.b16 [%rd2], %rs1;\n"
    assert vector_widths(ptx) == {"ld 16B": 1, "st 2B": 1}


@pytest.mark.skipif(pl.device.triton_version() is None, reason="needs Triton")
def test_triton_gelu_compiles_for_sm90_with_16_byte_accesses():
    rep = inspect_variant(pl.ops.get("gelu"), "triton", torch.float32)
    [k] = rep["kernels"]
    assert k["memory_ops"].get("ld 16B", 0) >= 2 and k["memory_ops"].get("st 16B", 0) >= 2
    assert k["registers"] > 0 and k.get("spill_stores", 0) == 0
    assert k["elements_per_thread"] == 8
    assert ".target sm_90" in rep["ptx"]


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
