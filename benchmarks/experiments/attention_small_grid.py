"""Why attention loses on small grids, and which tiles win there (issue 25, item 2): for the
worst points of the last recorded grid, the forward against SDPA with the table's tiles and with
smaller ones, each timed two ways in one interleaved comparison -- as a call (events around it:
the host's pace where the host is the limit) and as device time alone (the kernels' own time
from the profiler) -- so a point says whether the kernel or the host is behind, and which tile
shape fills a GPU that the table's tiles leave half idle.

    PYTHONPATH=src python3 benchmarks/experiments/attention_small_grid.py --out $OUT \
        [--grid LAST.json] [--points 10]

Writes attention-small-grid.json; needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import perfloop as pl
from perfloop.ops.attention import triton_impl as at
from perfloop.results import grid

# (BLOCK_M, BLOCK_N, num_warps, num_stages): smaller query tiles put more programs on the SMs
CANDIDATES = [(64, 64, 4, 3), (32, 64, 4, 3), (32, 32, 2, 3), (16, 64, 2, 3), (64, 32, 4, 2), (128, 64, 8, 3)]


def latest_grid() -> Path | None:
    root = Path(__file__).resolve().parents[1] / "results"
    found = sorted(root.glob("*/attention-grid.json"))
    return found[-1] if found else None


def parse(key: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S+)", key))


def device_ms(fn) -> float:
    """The kernels' own time per call (the profiler's device time: the host's pace left out)."""
    return pl.profile(fn, calls=5, count_work=False).device_ms_per_call


def point(b: int, h: int, t: int, d: int, causal: bool, budget_s: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 1000003 + h * 1009 + t + d)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    scale = d**-0.5
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "table": lambda: at.flash_attention(q, k, v, causal)[0],
    }
    for c in CANDIDATES:
        cfg = dict(zip(at.CONFIG_KEYS, c, strict=True))
        fns["x".join(map(str, c))] = lambda cfg=cfg: at.run_forward(q, k, v, causal, scale, cfg=cfg)[0]
    out = {
        "programs_at_table_tiles": -(-t // at._config(d, "fwd")["BLOCK_M"]) * b * h,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "variants": {},
    }
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
            ok[name] = fn
        except Exception as exc:  # a tile that does not fit costs only itself
            out["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    c = pl.compare(ok, baseline="sdpa", budget_s=budget_s)
    for name, fn in ok.items():
        out["variants"][name] = {
            "call_ms": c.measurements[name].median_ms,
            "device_ms": device_ms(fn),
            "speedup": c.speedups[name].speedup if name != "sdpa" else 1.0,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--grid", help="a recorded attention-grid.json (default: the newest under results/)")
    ap.add_argument("--points", type=int, default=10, help="how many of its worst forward points")
    ap.add_argument("--budget", type=float, default=0.3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_small_grid: needs a CUDA GPU", file=sys.stderr)
        return 2
    src = Path(args.grid) if args.grid else latest_grid()
    if src is None:
        print(
            "attention_small_grid: no recorded grid (benchmarks/attention_grid.py writes one)",
            file=sys.stderr,
        )
        return 2
    rec = grid.read(src)
    worst = [(k, s) for k, s in grid.worst(rec, 4 * args.points) if k.endswith("mode=fwd")][: args.points]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"grid": str(src), "device": torch.cuda.get_device_name(), "points": {}}
    for key, recorded in worst:
        p = parse(key)
        got = point(int(p["b"]), int(p["h"]), int(p["t"]), int(p["d"]), p["mask"] == "causal", args.budget)
        got["recorded_speedup"] = recorded
        res["points"][key] = got
        best = max((v["speedup"], n) for n, v in got["variants"].items() if "speedup" in v and n != "sdpa")
        table = got["variants"].get("table", {})
        sdpa_us = got["variants"]["sdpa"]["device_ms"] * 1e3
        print(
            f"{key}: recorded {recorded:.2f}x, table {table.get('speedup', float('nan')):.2f}x "
            f"(device {table.get('device_ms', float('nan')) * 1e3:.0f} us against SDPA's {sdpa_us:.0f}), "
            f"best {best[1]} {best[0]:.2f}x",
            flush=True,
        )
        (out_dir / "attention-small-grid.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
