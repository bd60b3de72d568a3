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

import argparse
import time
from pathlib import Path

from perfloop.cli.args import open_store, start_run
from perfloop.cli.output import console, print_bench_rows, status, table


def register(verb) -> None:
    p = verb("demo", "the whole loop on GELU, start to finish", run, db=True)
    p.add_argument("--out", help="folder for the HTML report (default: next to the database)")
    p.add_argument("--budget", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--no-flush", action="store_true", help=argparse.SUPPRESS)


def _check_variants(op, dtype, dev) -> tuple[list[str], list[list[str]]]:
    """(the variants to time, a table row per variant: its check and why not timed)."""
    from perfloop.ops.base import CheckFailed

    runnable, rows = [], []
    for name, v in op.variants.items():
        why = v.why_unavailable(dev)
        if why:
            rows.append([name, "unavailable", why])
            continue
        try:
            recs = op.check(name, dtypes=[dtype], shapes=op.test_shapes[2:5], seeds=1, seed=0)
            note = "correct" + (" (Triton interpreter: not timed)" if v.interpreted else "")
            rows.append(
                [name, "ok", f"{note}; {len(recs)} cases, max abs err {max(r['max_abs'] for r in recs):.1e}"]
            )
            if not v.interpreted:
                runnable.append(name)
        except CheckFailed as exc:
            rows.append([name, "FAIL", str(exc)[:200]])
    return runnable, rows


def _ceilings_said(c: dict) -> str:
    return ", ".join(
        f"{what} {c[key]:.{digits}f} {unit}" if (c.get(key) or 0) > 0 else f"{what} not measured"
        for what, key, unit, digits in (
            ("copy", "copy_gbps", "GB/s", 0),
            ("fp32 matmul", "matmul_fp32_tflops", "TFLOP/s", 2),
        )
    )


def run(args) -> int:
    import torch

    from perfloop import ops
    from perfloop.analysis.compare_profiles import diff
    from perfloop.device import default_device, env_fingerprint
    from perfloop.harness.ceilings import ceilings
    from perfloop.harness.measurement import fmt_ms
    from perfloop.results.report import render_html
    from perfloop.workflows.ops import bench_variants, profile_variant

    t0 = time.perf_counter()
    out = console()
    dev = default_device()
    op = ops.get("gelu")
    shape = op.bench_shape(dev)
    dtype = torch.float32
    env = env_fingerprint()
    out.rule("perfloop demo: GELU, measured, located, fixed, measured again")
    out.print(
        f"device: {env['device']['name']} | torch {env['torch']} | triton {env['triton'] or '-'}"
        f" | shape {shape[0]}x{shape[1]} fp32"
    )
    out.print(f"measured ceilings: {_ceilings_said(ceilings())}")
    store = open_store(args)
    run_id = start_run(store)

    out.rule("2. locate: profile the naive GELU")
    before, d = profile_variant(op, "naive", shape, dtype)
    out.print(before.table())
    out.print(str(d))
    store.add_artifact(
        run_id, "profile", before.to_dict() | {"diagnosis": d.to_dict()}, op="gelu", variant="naive"
    )

    out.rule("3. fix: check every fused variant against the float64 reference")
    runnable, rows = _check_variants(op, dtype, dev)
    table(None, ["variant", "check", "detail"], rows)

    out.rule("1 + 4. measure, then measure again: interleaved, L2 flushed, 95% CIs")
    with status(args, "timing the variants, interleaved"):
        _, bench_rows = bench_variants(
            op,
            runnable,
            shape,
            dtype,
            budget_s=args.budget,
            flush_l2=not args.no_flush,
            store=store,
            run_id=run_id,
        )
    print_bench_rows(bench_rows)
    best = max((r for r in bench_rows if r.variant != "naive"), key=lambda r: r.speedup, default=None)
    if best:
        after, d2 = profile_variant(op, best.variant, shape, dtype)
        store.add_artifact(
            run_id, "profile", after.to_dict() | {"diagnosis": d2.to_dict()}, op="gelu", variant=best.variant
        )
        out.print(f"naive -> {best.variant}: what changed in the profile")
        out.print(str(diff(before, after)))
        out.print(
            f"{best.variant} is {best.speedup:.2f}x faster than naive "
            f"(95% CI {best.speedup_ci[0]:.2f}-{best.speedup_ci[1]:.2f}), {fmt_ms(best.median_ms)} per call"
            + (f", {100 * best.sol:.0f}% of the measured copy ceiling" if best.sol else ""),
            style="bold",
        )
    report_dir = Path(args.out) if args.out else Path(store.path).parent / "report"
    page = render_html(store, report_dir, run_id)
    out.rule("5. kept")
    out.print(f"stored as run {run_id} in {store.path}")
    out.print(f"report: {page}")
    out.print(f"demo took {time.perf_counter() - t0:.0f} s")
    return 0
