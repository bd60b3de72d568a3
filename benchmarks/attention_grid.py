"""FlashAttention (Triton) against SDPA over issue 25's grid, every point recorded, and the guard
that fails when a point fell more than 10% since the last recorded run (35% for a point with a
time under 0.5 ms: such points moved 0.79-1.46x between two runs of unchanged code).

    PYTHONPATH=src python3 benchmarks/attention_grid.py --out $OUT                # record
    PYTHONPATH=src python3 benchmarks/attention_grid.py --out $OUT --check LAST.json   # and guard

Grid: batch {1,2,4,8} x heads {8,16,32} x tokens {512,1000,2047,3000,4096,8192} x head dim
{64,128} x mask {full,causal}, forward and forward + backward, bf16; points over --max-gib
skipped; `--batch/--heads/--tokens/--dims/--masks` run part of it, `--dtype` another dtype.
Each point is one interleaved `pl.compare` (SDPA the baseline), so its speed-up holds the
machine's pace out. Writes attention-grid.json (results.grid's recording; another dtype's
attention-grid-<dtype>.json), a heatmap and the ten worst points; with --check, exit 1 and the
drops listed when any point fell.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import perfloop as pl
from perfloop.ops.attention.triton_impl import flash_attention
from perfloop.results import grid

BATCH, HEADS, DIMS, MASKS = (1, 2, 4, 8), (8, 16, 32), (64, 128), ("full", "causal")
TOKENS = (512, 1000, 2047, 3000, 4096, 8192)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def point_gib(b: int, h: int, t: int, d: int, size: int = 2) -> float:
    """q, k, v, out and their gradients in elements of `size` bytes, and SDPA's log-sum-exp:
    what a point holds."""
    return (8 * b * h * t * d * size + b * h * t * 4) / 2**30


def measure(b: int, h: int, t: int, d: int, causal: bool, budget_s: float, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 1000003 + h * 1009 + t + d)
    q, k, v = (
        torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3)
    )
    dy = torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=g)
    fns = {
        "fwd": {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "triton": lambda: flash_attention(q, k, v, causal)[0],
        }
    }
    fns["fwd+bwd"] = {n: (lambda f=f: torch.autograd.grad(f(), (q, k, v), dy)) for n, f in fns["fwd"].items()}
    out = {}
    for mode, pair in fns.items():
        c = pl.compare(pair, baseline="sdpa", budget_s=budget_s)
        s = c.speedups["triton"]
        out[mode] = {
            "speedup": s.speedup,
            "ci": list(s.ci),
            "sdpa_ms": c.measurements["sdpa"].median_ms,
            "triton_ms": c.measurements["triton"].median_ms,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the recording, heatmap and worst points")
    ap.add_argument("--check", help="the last recorded run: exit 1 where a point fell more than --limit")
    ap.add_argument("--limit", type=float, default=0.10)
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of timing per point and mode")
    ap.add_argument("--max-gib", type=float, default=40.0)
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCH), help="the batch sizes to run (all)")
    ap.add_argument("--heads", type=int, nargs="+", default=list(HEADS), help="the head counts (all)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="the sequence lengths (all)")
    ap.add_argument("--dims", type=int, nargs="+", default=list(DIMS), help="the head dims (all)")
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS, help="full, causal (both)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="q, k, v's dtype (bfloat16)")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    if not torch.cuda.is_available():
        print("attention_grid: needs a CUDA GPU", file=sys.stderr)
        return 2
    last = grid.read(args.check) if args.check else None  # a bad recording stops before any timing
    if last is not None and last.get("dtype", "bfloat16") != args.dtype:
        print(
            f"attention_grid: --check {args.check} was recorded in {last.get('dtype', 'bfloat16')}, "
            f"this run is in {args.dtype} (--dtype)",
            file=sys.stderr,
        )
        return 2
    points = list(itertools.product(args.batch, args.heads, args.tokens, args.dims, args.masks))
    if last is not None:  # a run of part of the grid is checked on those points only
        keys = {f"b={b} h={h} t={t} d={d} mask={m}" for b, h, t, d, m in points}
        last = {**last, "points": {k: p for k, p in last["points"].items() if k.rsplit(" ", 1)[0] in keys}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = pl.env_fingerprint()
    rec = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": env.get("git"),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "points": {},
    }
    name = "attention-grid" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}")  # the guard reads bf16's
    t0 = time.perf_counter()
    for b, h, t, d, mask in points:
        keys = [f"b={b} h={h} t={t} d={d} mask={mask} mode={m}" for m in ("fwd", "fwd+bwd")]
        gib = point_gib(b, h, t, d, dtype.itemsize)
        if gib > args.max_gib:
            for key in keys:
                rec["points"][key] = {"error": f"skipped: {gib:.0f} GiB > --max-gib"}
            continue
        try:
            got = measure(b, h, t, d, mask == "causal", args.budget, dtype)
            for key, mode in zip(keys, ("fwd", "fwd+bwd"), strict=True):
                rec["points"][key] = got[mode]
        except Exception as exc:  # a point that fails costs only itself
            for key in keys:
                rec["points"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        torch.cuda.empty_cache()
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1))  # kept as it goes
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    grid.heatmap(
        rec,
        out / f"{name}.png",
        rows="b h",
        cols="t",
        panels="d mask mode",
        title=f"FlashAttention (Triton) / SDPA, {args.dtype}, {rec['device']}",
    )
    worst = grid.worst(rec, 10)
    (out / f"{name}-worst.txt").write_text("".join(f"{s:.3f}x  {k}\n" for k, s in worst))
    print("ten worst points:\n" + "".join(f"  {s:.3f}x  {k}\n" for k, s in worst), end="")
    if last is None:
        return 0
    found = grid.drops(last, rec, args.limit)
    for drop in found:
        print(f"DROP {drop}")
    print(
        f"{len(found)} point(s) fell more than {args.limit:.0%} ({grid.SHORT_LIMIT:.0%} under "
        f"{grid.SHORT_MS} ms) against {args.check}"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
