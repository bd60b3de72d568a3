"""`perfloop sweep`: time against size, with a fit of floor + c*size^k; on one device, or
sharded over ranks with --distributed."""

from __future__ import annotations

from perfloop.cli.args import (
    FAILED,
    UsageError,
    get_op,
    get_variants,
    open_store,
    parse_dtype,
    parse_shape,
    shape_errors,
    start_run,
)
from perfloop.cli.output import console, emit_json, progress, table


def register(verb) -> None:
    p = verb("sweep", "time against size, with a fit of floor + c*size^k", run, db=True)
    p.add_argument("op", help="an op of the library (perfloop list shows them)")
    p.add_argument("--shapes", nargs="+", required=True, help="e.g. 1024x1024 2048x2048 4096x4096")
    p.add_argument("--variant", action="append", help="variant (repeatable; default: all that run here)")
    p.add_argument("--plot", help="write a log-log plot (PNG)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16 or bf16")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per point (default 1)")
    p.add_argument("--distributed", action="store_true", help="shard the points across --nproc ranks")
    p.add_argument("--nproc", type=int, help="ranks for --distributed (one GPU each)")


def run(args) -> int:
    from perfloop.harness.measurement import fmt_fit, fmt_ms
    from perfloop.ops.base import dtype_name
    from perfloop.results.store import shape_str
    from perfloop.workflows.ops import sweep_points, sweep_series, sweep_variants

    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shapes = [parse_shape(s, "--shapes") for s in args.shapes]
    variants = get_variants(op, args.variant, timing=True, dtype=dtype)
    store = open_store(args)
    run_id = start_run(store)
    if args.distributed:
        return distributed(args, op, variants, shapes, dtype, store, run_id)
    with shape_errors("--shapes"), progress(args, len(shapes) * len(variants), "sweep") as step:
        results = sweep_variants(
            op,
            variants,
            shapes,
            dtype,
            budget_s=args.budget,
            store=store,
            run_id=run_id,
            on_point=lambda v, pt: step(f"{v} {shape_str(pt.size)}"),
        )
    if args.plot:
        from perfloop.results.plots import plot_lines

        try:
            plot_lines(args.plot, op.name, "elements", "median time (ms)", sweep_series(results))
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: cannot write ({exc})") from None
    if args.json:
        emit_json({"run_id": run_id, "sweeps": sweep_points(results)})
        return 0
    for v, s in results.items():
        rows = [
            [
                shape_str(p.size),
                fmt_ms(m.median_ms) if m else "error",
                f"{m.gbps:.3g}" if m and m.gbps else "-",
                f"{m.tflops:.3g}" if m and m.tflops else "-",
                p.error or "",
            ]
            for p in s.points
            for m in [p.measurement]
        ]
        table(f"{op.name}/{v} {dtype_name(dtype)}", ["shape", "median", "GB/s", "TFLOP/s", "error"], rows)
        if s.fit:
            console().print(fmt_fit(s.fit, size="elements"))
        elif s.fit_error:
            console().print(s.fit_error, style="yellow")
    console().print(f"stored as run {run_id}" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


def distributed(args, op, variants, shapes, dtype, store, run_id, entry="sweep_on_ranks") -> int:
    from perfloop.ops.base import dtype_name
    from perfloop.results.store import shape_str
    from perfloop.workflows import comm

    if not args.nproc:
        raise UsageError("--distributed: give --nproc N (ranks to spawn), one device each")
    with shape_errors("--shapes"):  # the ranks only report a bad point; say it before they start
        for s in shapes:
            op.check_shape(s, dtype)
    failure = None
    try:  # each rank stores its own points as it measures them
        res = comm.spawn(
            args.nproc, entry, op.name, variants, shapes, dtype_name(dtype), args.budget, store.path, run_id
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except RuntimeError as exc:  # a rank died: what the others measured is already stored
        failure = str(exc)
        res = {"points": [], "by_rank": {}}
    store.adopt_run(run_id)
    stored = {(r["variant"], r["shape"]): r for r in store.rows(run_id)}
    wanted = [(v, shape_str(s)) for v in variants for s in shapes]
    missing = [w for w in wanted if w not in stored]
    errors = [p for p in res["points"] if "error" in p]
    out = {
        "run_id": run_id,
        "stored": len(stored),
        "missing": missing,
        "errors": errors,
        "rank_failure": failure,
        "by_rank": res["by_rank"],
    }
    if args.json:
        emit_json(out)
    else:
        rows = [
            [v, s, f"{stored[(v, s)]['median_ms']:.4f} ms" if (v, s) in stored else "missing"]
            for v, s in wanted
        ]
        table(f"{op.name} sweep on {args.nproc} ranks (run {run_id})", ["variant", "shape", "median"], rows)
        for p in errors:
            console().print(f"{p['variant']} {p['shape']} on rank {p['rank']}: {p['error']}", style="yellow")
        if failure:
            console().print(f"{failure}; {len(missing)} points lost, {len(stored)} kept", style="red")
    return FAILED if (missing or errors) else 0
