"""Tuning the Triton FlashAttention's tiles on the GPU at hand: the search space, and `tune()`,
which times every config of each kernel against SDPA at bf16 B=4 H=16 S=4096 (head dims 64
and 128, causal and not) and writes the best per kernel and head dim to `tuned.json`, the
table `triton_impl` launches with.

The forward is timed against SDPA's forward; each backward kernel (the other at its table
config) against SDPA's backward (forward + backward minus forward). A config is kept only if
its output matches SDPA's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from perfloop.device import device_info
from perfloop.ops.tuning import load_table, save_table, time_candidates

# (BLOCK_M, BLOCK_N, warps, stages). At head dim 128 three stages of 64x128 K and V tiles
# fill half an SM's shared memory (one 4-warp block an SM); two stages fit two.
SPACE = {
    "fwd": [
        (64, 64, 4, 3),
        (64, 64, 4, 2),
        (128, 64, 8, 3),
        (128, 64, 8, 2),
        (128, 128, 8, 2),
        (64, 128, 4, 2),
        (64, 32, 4, 3),
        (128, 32, 4, 3),
        (64, 64, 4, 4),
        (64, 128, 4, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 3),
    ],
    "dkdv": [
        (32, 128, 4, 5),
        (32, 128, 4, 3),
        (64, 128, 8, 3),
        (64, 128, 4, 3),
        (32, 64, 4, 4),
        (64, 64, 4, 3),
        (16, 128, 4, 5),
        (32, 128, 8, 4),
        (64, 128, 8, 4),
        (64, 64, 4, 4),
    ],
    "dq": [
        (128, 32, 4, 5),
        (128, 32, 4, 3),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (64, 32, 4, 4),
        (128, 64, 4, 3),
        (128, 32, 8, 4),
        (64, 64, 4, 4),
        (128, 128, 8, 2),
    ],
}
CASES = [(4, 16, 4096, 4096, d, causal) for d in (64, 128) for causal in (False, True)]
KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def _sdpa_ms(q, k, v, causal: bool) -> tuple[float, float]:
    """SDPA's forward, and its backward (forward + backward minus forward), in ms."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return torch.autograd.grad(o, (qg, kg, vg), g)

    t = time_candidates({"fwd": fwd, "fwd+bwd": fwd_bwd}, budget_s=0.5)
    return t["fwd"], t["fwd+bwd"] - t["fwd"]


def _candidates(kind: str, q, k, v, causal: bool, ref) -> tuple[dict, dict, list]:
    """({label: call}, {label: config}, rows of forward configs whose output is wrong)."""
    from perfloop.ops.attention import triton_impl as ti

    d = q.shape[-1]
    scale = 1 / math.sqrt(d)
    o, lse = ti.run_forward(q, k, v, causal, scale)
    g = torch.randn_like(q)
    calls, cfg_of, wrong = {}, {}, []
    for c in SPACE[kind]:
        cfg = dict(zip(KEYS, c, strict=True))
        if kind == "fwd":
            try:
                err = (ti.run_forward(q, k, v, causal, scale, cfg)[0] - ref).abs().max().item()
                why = "" if err <= 2e-2 else f"max abs err {err:.3g} against SDPA"
            except ti.OutOfResources as exc:  # a config that does not fit this GPU is a row, not a stop
                why = f"{type(exc).__name__}: {str(exc)[:120]}"
            if why:
                wrong.append({"head_dim": d, "causal": causal, "kernel": kind, **cfg, "error": why})
                continue
            calls[str(c)] = functools.partial(ti.run_forward, q, k, v, causal, scale, cfg)
        else:
            calls[str(c)] = functools.partial(ti.run_backward, q, k, v, o, lse, g, causal, scale, {kind: cfg})
        cfg_of[str(c)] = cfg
    return calls, cfg_of, wrong


def _choose(rows: list[dict], kinds, table: dict) -> dict:
    """Per kernel and head dim, the config with the best geometric mean of its ratio to SDPA
    over the cases every candidate ran."""
    for kind in kinds:
        for dkey in ("64", "128"):
            scored: dict = {}
            for r in rows:
                if r["kernel"] == kind and str(r["head_dim"]) == dkey and "ratio" in r:
                    scored.setdefault(tuple(r[k] for k in KEYS), []).append(math.log(r["ratio"]))
            most = max(map(len, scored.values()), default=0)
            full = [c for c, v in scored.items() if len(v) == most]
            if full:
                table["16bit"][kind][dkey] = list(max(full, key=lambda c: sum(scored[c])))
    return table


def tune(
    kinds=("fwd", "dkdv", "dq"),
    cases=CASES,
    budget_s: float = 0.3,
    write: bool = True,
    log: Callable[[str], None] = print,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Time the search space; return {"rows": [...], "table": the chosen table} and, with
    `write`, save the table beside the kernel (16-bit rows only). Needs a CUDA GPU."""
    from perfloop.ops import attention

    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU; the table is measured, never guessed")
    if write and dtype == torch.float32:
        raise ValueError("tune: write=True chooses the 16-bit rows; time fp32 with write=False")
    rows = []
    for shape in cases:
        d, causal = shape[4], shape[5]
        q, k, v, _ = attention.make_inputs(shape, dtype=dtype, device="cuda", seed=9)
        sdpa_f, sdpa_b = _sdpa_ms(q, k, v, causal)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for kind in kinds:
            log(f"attention tune d={d} causal={causal} {kind}")
            calls, cfg_of, wrong = _candidates(kind, q, k, v, causal, ref)
            rows += wrong
            base = sdpa_f if kind == "fwd" else sdpa_b
            for label, ms in time_candidates(calls, budget_s, log).items():
                row = {"head_dim": d, "causal": causal, "kernel": kind, **cfg_of[label]}
                row |= (
                    {"ms": ms, "sdpa_ms": base, "ratio": base / ms}
                    if isinstance(ms, float)
                    else {"error": ms}
                )
                rows.append(row)
    table = _choose(rows, kinds, load_table(Path(__file__).parent))
    if write:
        save_table(
            Path(__file__).parent, table, device_info()["name"], "tuning.tune() over SPACE x CASES, bf16"
        )
    return {"rows": rows, "table": table}
