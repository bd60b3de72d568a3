"""Tuning the Triton row sum on the GPU at hand: tile and warps at 16384^2 fp32; `tune()`
writes the fastest to `tuned.json`, which the launcher reads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from perfloop.device import device_info
from perfloop.ops.tuning import fastest, load_table, save_table, time_candidates

SPACE = [(4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32)]  # (block, warps)
SHAPE = (16384, 16384)


def tune(write: bool = True, log: Callable[[str], None] = print) -> dict:
    """Time the space at SHAPE; return {"times", "table"}; needs a CUDA GPU."""
    from perfloop.ops.rowsum import triton_impl

    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU; the table is measured, never guessed")
    x = torch.randn(SHAPE, device="cuda")
    log("rowsum tune")
    cands = {f"{b},{w}": functools.partial(triton_impl.rowsum, x, block=b, num_warps=w) for b, w in SPACE}
    times = time_candidates(cands, log=log)
    table = load_table(Path(__file__).parent)
    if best := fastest(times):
        table["block"], table["num_warps"] = (int(s) for s in best.split(","))
    if write:
        save_table(Path(__file__).parent, table, device_info()["name"], f"tuning.tune() at {SHAPE} fp32")
    return {"times": times, "table": table}
