"""Tuning the Triton softmax's launches on the GPU at hand: the one-block-a-row kernel's warps
at 16384x4096, the split kernel's chunk and warps at 1024x262144 (fp32); `tune()` writes the
fastest to `tuned.json`, which the launchers read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from perfloop.device import device_info
from perfloop.ops.tuning import fastest, load_table, save_table, time_candidates

SPACE = {
    "row_warps": [4, 8, 16],  # at 4096 columns
    "split": [(4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)],
}
SHAPES = {"row": (16384, 4096), "split": (1024, 262144)}


def tune(write: bool = True, log: Callable[[str], None] = print) -> dict:
    """Time the space; return {"times", "table"}; needs a CUDA GPU."""
    from perfloop.ops.softmax import triton_impl

    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU; the table is measured, never guessed")
    table = load_table(Path(__file__).parent)
    x = torch.randn(SHAPES["row"], device="cuda") * 4
    log("softmax tune: one block a row")
    cands = {str(w): functools.partial(triton_impl.softmax, x, num_warps=w) for w in SPACE["row_warps"]}
    row = time_candidates(cands, log=log)
    x = torch.randn(SHAPES["split"], device="cuda") * 4
    log("softmax tune: split rows")
    cands = {
        f"{b},{w}": functools.partial(triton_impl.softmax_split, x, block=b, num_warps=w)
        for b, w in SPACE["split"]
    }
    split = time_candidates(cands, log=log)
    if best := fastest(split):
        table["split"] = [int(s) for s in best.split(",")]
    if write:
        save_table(Path(__file__).parent, table, device_info()["name"], f"tuning.tune() at {SHAPES} fp32")
    return {"times": {"row_warps": row, "split": split}, "table": table}
