"""The attention backward's two forms on the GPU, through the op's autograd Function: dQ added up
by the dK/dV kernel (fp32 atomics; the default for 16-bit) against dQ from a pass of its own (what
`torch.use_deterministic_algorithms(True)` gets), each against SDPA's forward + backward, in one
interleaved `pl.compare` a point. With --tune, first `tuning.tune` over the "dkdvq" space at its
four cases, writing the chosen tiles into tuned.json (copied to OUT) before the points are timed
in a process of their own.

    PYTHONPATH=src python3 benchmarks/attention_bwd.py OUT [--tune] [--points B,H,T,D,causal|full ...]

Writes attention-bwd.json (and attention-bwd-tune.json with --tune).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

POINTS = [(4, 16, 4096, d, m) for d in (64, 128) for m in ("full", "causal")] + [
    (2, 8, 1000, 128, "causal"), (2, 16, 3000, 128, "full"), (1, 32, 2047, 128, "causal"),
    (8, 32, 3000, 128, "causal"), (2, 8, 3000, 64, "causal"), (2, 16, 512, 64, "full"),
]  # fmt: skip


def measure(b: int, h: int, t: int, d: int, mask: str, budget_s: float) -> dict:
    import perfloop as pl
    from perfloop.ops.attention.triton_impl import flash_attention

    causal = mask == "causal"
    g = torch.Generator(device="cuda").manual_seed(b * 1000003 + h * 1009 + t + d)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))  # fmt: skip
    dy = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def ours(deterministic: bool):
        def step():
            torch.use_deterministic_algorithms(deterministic)
            try:
                return torch.autograd.grad(flash_attention(q, k, v, causal)[0], (q, k, v), dy)
            finally:
                torch.use_deterministic_algorithms(False)

        return step

    def sdpa():
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dy)

    fns = {"sdpa": sdpa, "atomic": ours(False), "dq pass": ours(True)}
    c = pl.compare(fns, baseline="sdpa", budget_s=budget_s)
    row = {"point": f"b={b} h={h} t={t} d={d} mask={mask}", "sdpa_ms": c.measurements["sdpa"].median_ms}
    for name in ("atomic", "dq pass"):
        s = c.speedups[name]
        row[name] = {"speedup": s.speedup, "ci": list(s.ci), "ms": c.measurements[name].median_ms}
    grads = [ours(det)() for det in (False, True)]
    row["max_rel_diff"] = {  # the two forms' gradients: dK, dV bit for bit, dQ within rounding
        n: ((a.float() - z.float()).abs().max() / z.float().abs().max()).item()
        for n, a, z in zip(("dq", "dk", "dv"), *grads, strict=True)
    }
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tune", action="store_true", help="tune the dkdvq tiles first (writes tuned.json)")
    ap.add_argument("--points", nargs="+", help="B,H,T,D,full|causal (default: a mixed dozen)")
    ap.add_argument("--budget", type=float, default=0.4)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # timing the kernels, not NaN fills
    if args.tune:
        from perfloop.ops.attention import triton_impl, tuning

        got = tuning.tune(kinds=("dkdvq",), write=True)
        (out / "attention-bwd-tune.json").write_text(json.dumps(got, indent=1))
        shutil.copy(Path(triton_impl.__file__).parent / "tuned.json", out / "tuned.json")
        cmd = [sys.executable, __file__, str(out), "--budget", str(args.budget)]
        return subprocess.call(cmd + (["--points", *args.points] if args.points else []))  # the new table
    points = [tuple(p.split(",")) for p in args.points] if args.points else POINTS
    rows = []
    for b, h, t, d, mask in points:
        rows.append(measure(int(b), int(h), int(t), int(d), mask, args.budget))
        r = rows[-1]
        print(f"{r['point']:36} atomic {r['atomic']['speedup']:.3f}x  dq pass {r['dq pass']['speedup']:.3f}x "
              f"(SDPA {r['sdpa_ms']:.3f} ms)  diff {r['max_rel_diff']}", flush=True)  # fmt: skip
    (out / "attention-bwd.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                       indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
