"""Tuning GELU's launches on the GPU at hand: the Triton kernel's block and warps, the CUDA
C++ kernel's unroll, each per element size at 16384^2; `tune()` writes the fastest to
`tuned.json`, which the launchers read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from perfloop.device import device_info
from perfloop.ops.tuning import fastest, load_table, save_table, time_candidates

SPACE = {
    "triton": {
        "fp32": [(1024, 4), (2048, 4), (2048, 8), (4096, 8)],
        "16bit": [(2048, 4), (4096, 4), (4096, 8), (8192, 8)],
    },  # (block, warps)
    "cuda": {"fp32": [1, 2, 4, 8], "16bit": [1, 2, 4, 8]},  # unroll
}
SHAPE = (16384, 16384)


def tune(write: bool = True, log: Callable[[str], None] = print) -> dict:
    """Time the space at SHAPE (fp32 and bf16); return {"times", "table"}; needs a CUDA GPU."""
    from perfloop.ops.gelu import cuda_impl, triton_impl

    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU; the table is measured, never guessed")
    table = load_table(Path(__file__).parent)
    times = {}
    for key, dtype in (("fp32", torch.float32), ("16bit", torch.bfloat16)):
        x = torch.randn(SHAPE, device="cuda").to(dtype)
        log(f"gelu tune triton {key}")
        cands = {
            f"{b},{w}": functools.partial(triton_impl.gelu, x, block=b, num_warps=w)
            for b, w in SPACE["triton"][key]
        }
        t = time_candidates(cands, log=log)
        times[f"triton {key}"] = t
        if best := fastest(t):
            table["triton"][key] = [int(s) for s in best.split(",")]
        log(f"gelu tune cuda {key}")
        cands = {str(u): functools.partial(cuda_impl.gelu, x, unroll=u) for u in SPACE["cuda"][key]}
        t = time_candidates(cands, log=log)
        times[f"cuda {key}"] = t
        if best := fastest(t):
            table["cuda"][key] = int(best)
    if write:
        save_table(Path(__file__).parent, table, device_info()["name"], f"tuning.tune() at {SHAPE}")
    return {"times": times, "table": table}
