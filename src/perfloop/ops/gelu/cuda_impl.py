"""GELU in CUDA C++ (kernel.cu), built once with torch.utils.cpp_extension."""

from __future__ import annotations

from pathlib import Path

import torch

from perfloop.ops.base import check_tensor
from perfloop.ops.cuda_build import build
from perfloop.ops.tuning import load_table

KERNEL = Path(__file__).with_name("kernel.cu")
UNROLL = load_table(Path(__file__).parent)["cuda"]  # per element size (tuning.py)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

BINDING = r"""
#include <torch/extension.h>
extern "C" int perfloop_gelu(const void* x, void* y, int64_t n, int dtype, int unroll,
                             void* stream);
int64_t gelu(torch::Tensor x, torch::Tensor y, int64_t dtype, int64_t unroll, int64_t stream) {
  return perfloop_gelu(x.data_ptr(), y.data_ptr(), x.numel(), (int)dtype, (int)unroll,
                       (void*)stream);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gelu", &gelu); }
"""


def gelu(x: torch.Tensor, out: torch.Tensor | None = None, *, unroll: int | None = None) -> torch.Tensor:
    check_tensor("x", x)
    if not x.is_cuda:
        raise ValueError(f"x: the CUDA C++ variant needs a CUDA tensor, got device {x.device}")
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: need a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    if x.numel() == 0:
        return out
    ext = build("gelu", str(KERNEL), BINDING)
    unroll = unroll or UNROLL["fp32" if x.element_size() == 4 else "16bit"]
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"unroll: must be 1, 2, 4 or 8 (16-byte vectors per thread), got {unroll}")
    err = ext.gelu(x, out, DTYPE_CODE[x.dtype], unroll, torch.cuda.current_stream().cuda_stream)
    if err != 0:
        raise RuntimeError(f"gelu CUDA kernel launch failed: cudaError {err}")
    return out


THREADS_PER_BLOCK = 256  # kThreads in kernel.cu
