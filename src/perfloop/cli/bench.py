"""`perfloop bench`: an op's variants, checked, then timed interleaved with speed-ups and CIs."""

from __future__ import annotations

from perfloop.cli.args import (
    UsageError,
    get_op,
    get_variants,
    open_store,
    parse_dtype,
    parse_shape,
    shape_errors,
    start_run,
)
from perfloop.cli.output import console, emit_json, print_bench_rows, status


def timing_flags(p) -> None:
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16 or bf16")
    p.add_argument("--budget", type=float, default=2.0, help="seconds per comparison (default 2)")
    p.add_argument("--no-flush", action="store_true", help="keep the L2 warm between samples")


def register(verb) -> None:
    p = verb("bench", "time an op's variants, interleaved, with speed-ups and CIs", run, db=True)
    p.add_argument("op", help="an op of the library (perfloop list shows them)")
    p.add_argument("--variant", action="append", help="variant (repeatable; default: all that run here)")
    p.add_argument("--shape", help="e.g. 4096x4096 (default: the op's benchmark shape)")
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    timing_flags(p)


def run(args) -> int:
    from perfloop.device import default_device
    from perfloop.workflows.ops import bench_variants

    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shape = parse_shape(args.shape) if args.shape else op.bench_shape(default_device())
    variants = get_variants(op, args.variant, timing=True, dtype=dtype)
    if not variants:
        raise UsageError(f"--variant: none of the asked variants of {op.name} can be timed here")
    store = open_store(args)
    run_id = start_run(store)
    with (
        shape_errors(),
        status(args, f"checking, then timing {len(variants)} variants of {op.name} interleaved"),
    ):
        _, rows = bench_variants(
            op,
            variants,
            shape,
            dtype,
            budget_s=args.budget,
            flush_l2=not args.no_flush,
            graph=args.graph,
            store=store,
            run_id=run_id,
        )
    if args.json:
        from perfloop.device import env_fingerprint

        env = env_fingerprint()
        emit_json(
            {"run_id": run_id, "commit": env.get("git"), "env": env, "rows": [r.to_dict() for r in rows]}
        )
    else:
        print_bench_rows(rows)
        console().print(f"stored as run {run_id} in {store.path}")
    return 0
