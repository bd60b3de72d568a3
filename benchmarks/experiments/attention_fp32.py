"""fp32 FlashAttention against SDPA in fp32, per tl.dot precision (ieee, tf32x3, tf32): time
(forward, forward + backward) and the error against an fp64 reference, SDPA's own error beside.

    PYTHONPATH=src python3 benchmarks/experiments/attention_fp32.py OUT_DIR

Writes attention-fp32.json (one row per shape, precision and mode) and prints each row.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import perfloop as pl
from perfloop.ops.attention import triton_impl as ti

SHAPES = [(4, 16, t, d, causal) for d in (64, 128) for t in (1000, 4096) for causal in (True, False)]
PRECISIONS = ("tf32x3", "tf32", "ieee")


def _with_precision(p: str):
    ti._precision = lambda dtype: p if dtype == torch.float32 else "tf32"


def _errors(run, q, k, v, dy, ref, ref_grads) -> dict:
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = run(qg, kg, vg)
    grads = torch.autograd.grad(o, (qg, kg, vg), dy)
    scale = ref.abs().max().item()
    out = {"out_err": (o.double() - ref).abs().max().item() / scale}
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        out[f"{name}_err"] = (g.double() - r).abs().max().item() / r.abs().max().item()
    return out


def _timed(sdpa, ours, q, k, v, dy) -> dict:
    """{"fwd": ..., "fwd+bwd": ...}: ours against SDPA, interleaved."""
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    fwd = {"sdpa": lambda: sdpa(qg, kg, vg), "ours": lambda: ours(qg, kg, vg)}
    both = {n: (lambda f=f: torch.autograd.grad(f(), (qg, kg, vg), dy)) for n, f in fwd.items()}
    out = {}
    for mode, fns in (("fwd", fwd), ("fwd+bwd", both)):
        c = pl.compare(fns, baseline="sdpa", budget_s=0.2)
        out[mode] = {
            "speedup": c.speedups["ours"].speedup,
            "sdpa_ms": c.measurements["sdpa"].median_ms,
            "ours_ms": c.measurements["ours"].median_ms,
        }
    return out


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b, h, t, d, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(t + d)
        q, k, v, dy = (torch.randn(b, h, t, d, device="cuda", generator=g) for _ in range(4))
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dy.double())
        ref = ref.detach()

        def sdpa(q, k, v, causal=causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def ours(q, k, v, causal=causal):
            return ti.flash_attention(q, k, v, causal)[0]

        shape = {"b": b, "h": h, "t": t, "d": d, "causal": causal}
        rows.append({**shape, "impl": "sdpa", **_errors(sdpa, q, k, v, dy, ref, ref_grads)})
        print(json.dumps(rows[-1]), flush=True)
        for p in PRECISIONS:
            if p == "ieee" and (d > 64 or t > 1000):
                continue  # 20-130 ms a call at d=128 (run24)
            _with_precision(p)
            row = {**shape, "impl": f"triton-{p}"}
            try:
                row |= _errors(ours, q, k, v, dy, ref, ref_grads)
                row |= _timed(sdpa, ours, q, k, v, dy)
            except Exception as exc:  # one precision's failure costs only its row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "attention-fp32.json").write_text(
                json.dumps(
                    {
                        "device": torch.cuda.get_device_name(),
                        "date": time.strftime("%Y-%m-%d"),
                        "torch": torch.__version__,
                        "rows": rows,
                    },
                    indent=1,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out"))
