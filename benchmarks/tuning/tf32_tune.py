"""TF32 matmul + ReLU against cuBLAS + ReLU: the kernel's tiles for 32-bit operands, timed
interleaved in one run, with B K-major (copied once, outside the timing), with the copy in the
call (the op's path), and with the operands swapped (C^T = B^T A^T, no copy).

`--swap`: the swapped form with B^T as the dot's first operand taken from registers (rounded to
TF32 there, so it is not a plain load: Hopper's wgmma reads a 32-bit operand of any layout from
registers, K-major only from shared memory), A^T K-major from shared memory as it lies: no copy
(the op's `matmul_relu_tf32_kernel` since run25) over its tiles.

    PYTHONPATH=src python3 benchmarks/tuning/tf32_tune.py OUT_DIR [SIZE ...] [--op-only|--swap]
        (default sizes 4096 6144)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import perfloop as pl
from perfloop.ops.base import cdiv
from perfloop.ops.matmul_relu import triton_impl as T

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps); 32-bit operands: a stage of (BM + BN) x BK
# takes twice the shared memory of a bf16 one, so BK 32 where bf16 takes 64
CANDIDATES = [
    (128, 256, 32, 8, 3, 8),
    (128, 256, 32, 8, 4, 8),
    (256, 128, 32, 8, 3, 8),
    (256, 128, 32, 8, 4, 8),
    (128, 128, 32, 8, 4, 4),
    (128, 128, 32, 8, 5, 8),
    (128, 256, 16, 8, 5, 8),
    (128, 128, 64, 8, 3, 8),
    (64, 256, 32, 8, 4, 4),
    (128, 256, 32, 16, 4, 8),
    (128, 256, 32, 4, 4, 8),
]


def launch(a, b, c, cfg, m, n, k):
    bm, bn, bk, g, stages, warps = cfg
    T.matmul_relu_kernel[(cdiv(m, bm) * cdiv(n, bn),)](
        a,
        b,
        c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=g,
        PRECISION="tf32",
        num_stages=stages,
        num_warps=warps,
    )
    return c


SWAP_CANDIDATES = [  # (BLOCK_N, BLOCK_M, BLOCK_K, GROUP_N, stages, warps); the op's first (run25) first
    (128, 256, 32, 8, 4, 8),
    (128, 256, 32, 4, 4, 8),
    (128, 256, 32, 16, 4, 8),
    (128, 256, 32, 32, 4, 8),
    (128, 256, 16, 8, 6, 8),
    (128, 256, 16, 8, 8, 8),
    (128, 256, 32, 8, 3, 8),
    (128, 128, 32, 8, 4, 4),
]


def launch_swapped(a, b, c, cfg, round_: bool = True):
    bn, bm, bk, g, stages, warps = cfg
    (m, k), n = a.shape, b.shape[1]
    T.matmul_relu_tf32_kernel[(cdiv(n, bn) * cdiv(m, bm),)](
        a,
        b,
        c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_N=bn,
        BLOCK_M=bm,
        BLOCK_K=bk,
        GROUP_N=g,
        ROUND=round_,
        num_stages=stages,
        num_warps=warps,
    )
    return c


def swap_size(s: int, res: dict) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randn(s, s, device=DEV, generator=g)
    b = torch.randn(s, s, device=DEV, generator=g) / s**0.5
    c = torch.empty(s, s, device=DEV)
    want = torch.relu(a.double() @ b.double()).float()
    fns = {"cublas+relu": lambda: torch.relu(a @ b), "op": lambda: T.matmul_relu(a, b)}
    errors = {
        "cublas+relu": float((torch.relu(a @ b) - want).abs().max()),
        "op": float((T.matmul_relu(a, b) - want).abs().max()),
    }
    # every tile rounded in registers; the first also as a plain load (the 4-byte gather it avoids)
    for cfg, round_ in [(cand, True) for cand in SWAP_CANDIDATES] + [(SWAP_CANDIDATES[0], False)]:
        name = f"swapped {'registers' if round_ else 'plain'} " + "x".join(map(str, cfg))
        try:
            errors[name] = float((launch_swapped(a, b, c, cfg, round_) - want).abs().max())
        except Exception as e:  # out of shared memory, a layout the compiler refuses: said, not timed
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        fns[name] = lambda cfg=cfg, round_=round_: launch_swapped(a, b, c, cfg, round_)
    _timed(fns, errors, s, res)


def one_size(s: int, res: dict, op_only: bool) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randn(s, s, device=DEV, generator=g)
    b = torch.randn(s, s, device=DEV, generator=g) / s**0.5
    bk_major = b.t().contiguous().t()
    c, ct = torch.empty(s, s, device=DEV), torch.empty(s, s, device=DEV)
    want = torch.relu(a @ b)
    fns = {"cublas+relu": lambda: torch.relu(a @ b), "op": lambda: T.matmul_relu(a, b)}
    errors = {}
    for cfg in CANDIDATES if not op_only else []:
        name = "tile " + "x".join(map(str, cfg))
        try:
            got = launch(a, bk_major, c, cfg, s, s, s)
        except Exception as e:  # out of shared memory: said, not timed
            errors[name] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        errors[name] = float((got - want).abs().max())
        fns[name] = lambda cfg=cfg: launch(a, bk_major, c, cfg, s, s, s)
    best = (128, 256, 32, 8, 4, 8)
    if op_only:
        return _timed(fns, errors, s, res)
    fns["tile 128x256x32 + copy"] = lambda: launch(a, b.t().contiguous().t(), c, best, s, s, s)
    fns["torch copy alone"] = lambda: b.t().contiguous()
    # C^T = B^T A^T written through C's transpose: A^T is K-major as it lies, no copy
    fns["swapped 128x256x32, no copy"] = lambda: launch(b.t(), a.t(), ct.t(), best, s, s, s)
    fns["swapped 128x256x32, no copy"]()
    errors["swapped 128x256x32, no copy"] = float((ct - want).abs().max())
    _timed(fns, errors, s, res)


def _timed(fns: dict, errors: dict, s: int, res: dict) -> None:
    work = pl.Work(flops=2 * s**3, dtype="tf32")
    cmp = pl.compare(fns, baseline="cublas+relu", budget_s=4.0, work=work)
    base = cmp.measurements["cublas+relu"].median_ms
    for name, m in cmp.measurements.items():
        row = {
            "size": s,
            "variant": name,
            "ms": m.median_ms,
            "vs_cublas": base / m.median_ms,
            "max_err": errors.get(name),
        }
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    for name, e in errors.items():
        if isinstance(e, str):
            res["rows"].append({"size": s, "variant": name, "error": e})
            print(name, e, flush=True)


def main(out: Path, sizes: list[int], op_only: bool = False, swap: bool = False) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    res = {"device": pl.env_fingerprint(), "rows": []}
    for s in sizes:
        if swap:
            swap_size(s, res)
        else:
            one_size(s, res, op_only)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tf32-tune.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("sizes", type=int, nargs="*", default=[4096, 6144])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--op-only", action="store_true", help="the op against cuBLAS + ReLU only")
    mode.add_argument("--swap", action="store_true", help="the swapped form's tiles (B^T from registers)")
    args = ap.parse_args()
    main(args.out, args.sizes, op_only=args.op_only, swap=args.swap)
