"""`perfloop demo`: the whole loop on GELU, start to finish.

1. measure the naive GELU (and the machine's ceilings);
2. locate: profile it, diagnose it;
3. fix: check the fused variants this machine can run against float64;
4. measure again: time them interleaved with the naive one, speed-ups with CIs,
   and diff the profiles;
5. keep it: store every number, write the HTML report.
On a GPU at the lecture's size (16384^2); on a CPU at 2048^2, with Triton
checked through its interpreter but not timed (the interpreter is for
correctness, not speed).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from perfloop import ops
from perfloop.cli import bench_op, console, device, open_store, print_bench_rows, profile_op, status, table
from perfloop.device import ceilings, env_fingerprint
from perfloop.measurement import fmt_ms
from perfloop.ops.base import CheckFailed
from perfloop.profiling import diff
from perfloop.report import render_html


def run_demo(args) -> int:
    t0 = time.perf_counter()
    out = console()
    dev = device()
    op = ops.get("gelu")
    shape = op.bench_shape(dev)
    dtype = torch.float32
    env = env_fingerprint()
    out.rule("perfloop demo: GELU, measured, located, fixed, measured again")
    out.print(
        f"device: {env['device']['name']} | torch {env['torch']} | triton {env['triton'] or '-'}"
        f" | shape {shape[0]}x{shape[1]} fp32"
    )
    c = ceilings()
    out.print(f"measured ceilings: copy {c['copy_gbps']:.0f} GB/s, "
              f"fp32 matmul {c['matmul_fp32_tflops']:.1f} TFLOP/s")  # fmt: skip
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), env)

    out.rule("2. locate: profile the naive GELU")
    before, d = profile_op(op, "naive", shape, dtype)
    out.print(before.table())
    out.print(str(d))
    store.add_artifact(run_id, "profile", before.to_dict() | {"diagnosis": d.__dict__},
                       op="gelu", variant="naive")  # fmt: skip

    out.rule("3. fix: check every fused variant against the float64 reference")
    runnable, rows = [], []
    for name, v in op.variants.items():
        why = v.why_unavailable(dev)
        if why:
            rows.append([name, "unavailable", why])
            continue
        try:
            recs = op.check(name, dtypes=[dtype], shapes=op.test_shapes[2:5], seeds=1)
            note = "correct" + (" (Triton interpreter: not timed)" if v.interpreted else "")
            rows.append([name, "ok", f"{note}; {len(recs)} cases, max abs err "
                                     f"{max(r['max_abs'] for r in recs):.1e}"])  # fmt: skip
            if not v.interpreted:
                runnable.append(name)
        except CheckFailed as exc:
            rows.append([name, "FAIL", str(exc)[:200]])
    table(None, ["variant", "check", "detail"], rows)

    out.rule("1 + 4. measure, then measure again: interleaved, L2 flushed, 95% CIs")
    with status(args, "timing the variants, interleaved"):
        _, bench_rows = bench_op(args, op, runnable, shape, dtype, store, run_id, quiet=True)
    print_bench_rows(bench_rows, op.name, shape, "fp32")
    best = max((r for r in bench_rows if r["variant"] != "naive"), key=lambda r: r["speedup"],
               default=None)  # fmt: skip
    if best:
        after, d2 = profile_op(op, best["variant"], shape, dtype)
        store.add_artifact(run_id, "profile", after.to_dict() | {"diagnosis": d2.__dict__},
                           op="gelu", variant=best["variant"])  # fmt: skip
        out.print(f"naive -> {best['variant']}: what changed in the profile")
        out.print(str(diff(before, after)))
        out.print(
            f"{best['variant']} is {best['speedup']:.2f}x faster than naive "
            f"(95% CI {best['speedup_ci'][0]:.2f}-{best['speedup_ci'][1]:.2f}), "
            f"{fmt_ms(best['median_ms'])} per call"
            + (f", {100 * best['sol']:.0f}% of the measured copy ceiling" if best["sol"] else ""),
            style="bold",
        )
    report_dir = Path(args.out) if args.out else Path(store.path).parent / "report"
    page = render_html(store, report_dir, run_id)
    out.rule("5. kept")
    out.print(f"stored as run {run_id} in {store.path}")
    out.print(f"report: {page}")
    out.print(f"demo took {time.perf_counter() - t0:.0f} s")
    return 0
