"""`perfloop check`: every variant against the op's float64 reference."""

from __future__ import annotations

from perfloop.cli.args import FAILED, as_flag, get_op, get_variants, parse_dtype
from perfloop.cli.output import emit_json, progress, table


def register(verb) -> None:
    p = verb("check", "correctness against the float64 reference", run)
    p.add_argument("op", nargs="?", help="op name (default: all)")
    p.add_argument("--variant", action="append", help="variant (repeatable; default: all)")
    p.add_argument("--dtype", action="append", help="fp32, fp16, bf16 (repeatable; default: all)")
    p.add_argument("--seeds", type=int, default=2, help="fresh random inputs per case (default 2)")
    p.add_argument(
        "--seed", type=int, help="the first case's seed, as a failure printed it (default: fresh each run)"
    )


def run(args) -> int:
    from perfloop import ops
    from perfloop.ops.base import CheckFailed, check_seed

    try:
        check_seed(args.seed, args.seeds)
    except ValueError as exc:
        raise as_flag(exc, "--seed") from None
    names = [args.op] if args.op else ops.names()
    results, failed = [], False
    todo = []
    for name in names:
        op = get_op(name)
        for v in get_variants(op, args.variant, timing=False):
            todo.append((op, v))
    dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
    with progress(args, len(todo), "checking") as step:
        for op, v in todo:
            step(f"check {op.name}/{v}")
            try:
                recs = op.check(v, dtypes=dtypes, seeds=args.seeds, seed=args.seed)
                results.append(
                    {
                        "op": op.name,
                        "variant": v,
                        "ok": True,
                        "cases": len(recs),
                        "max_abs_err": max(r["max_abs"] for r in recs),
                        "of_tolerance": max(r["of_tolerance"] for r in recs),
                    }
                )
            except CheckFailed as exc:
                failed = True
                results.append({"op": op.name, "variant": v, "ok": False, "error": str(exc)})
    if args.json:
        emit_json(results)
    else:
        rows = [
            [
                r["op"],
                r["variant"],
                "ok" if r["ok"] else "FAIL",
                f"{r['cases']} cases, max abs err {r['max_abs_err']:.2g}, worst at {r['of_tolerance']:.2f} "
                "of the tolerance"
                if r["ok"]
                else r["error"],
            ]
            for r in results
        ]
        table("check against the float64 reference", ["op", "variant", "result", "detail"], rows)
    return FAILED if failed else 0
