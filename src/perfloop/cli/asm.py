"""`perfloop asm`: PTX/SASS, registers, shared memory, spills, occupancy (no GPU needed)."""

from __future__ import annotations

from perfloop.cli.args import FAILED, UsageError, get_op, parse_dtype
from perfloop.cli.output import console, emit_json, table


def register(verb) -> None:
    p = verb("asm", "PTX/SASS, registers, shared memory, spills, occupancy", run)
    p.add_argument("op", help="an op of the library (perfloop list shows them)")
    p.add_argument("--variant", required=True, help="the variant whose code is shown (triton, cuda)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16 or bf16")
    p.add_argument("--arch", default="sm_90", help="target GPU (default sm_90: H100/H200)")
    p.add_argument("--show", choices=["ptx", "sass"], help="also print the PTX or SASS")


def run(args) -> int:
    from perfloop.analysis.asm import AsmError, inspect_variant

    op = get_op(args.op)
    if args.variant not in op.variants:
        raise UsageError(f"--variant: {op.name!r} has no {args.variant!r}; valid: {', '.join(op.variants)}")
    try:
        rep = inspect_variant(op, args.variant, parse_dtype(args.dtype), arch=args.arch)
    except AsmError as exc:
        console(True).print(str(exc), style="red")
        return FAILED
    if args.json:
        emit_json({k: v for k, v in rep.items() if k not in ("ptx", "sass")})
        return 0
    rows = []
    for k in rep["kernels"]:
        rows.append(
            [
                k["name"][:50],
                k.get("registers", "?"),
                k.get("smem_bytes", 0),
                k.get("spill_stores", 0),
                k.get("threads", "?"),
                f"{k['occupancy']:.0%}" if k.get("occupancy") is not None else "?",
                k.get("limited_by", ""),
            ]
        )
    table(
        f"{op.name}/{args.variant} for {args.arch}",
        ["kernel", "regs/thread", "smem B", "spill B", "threads", "occupancy", "limited by"],
        rows,
    )
    for note in rep["notes"]:
        console().print(f"- {note}")
    if args.show:
        console().print(rep.get(args.show) or f"no {args.show} available")
    return 0
