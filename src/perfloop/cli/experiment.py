"""`perfloop experiment`: the lecture's scaling experiments and pitfalls, measured here."""

from __future__ import annotations

from perfloop.cli.args import UsageError, open_store, start_run
from perfloop.cli.output import console, emit_json, table


def register(verb) -> None:
    p = verb("experiment", "the lecture's scaling experiments and pitfalls", run, db=True)
    p.add_argument("name", nargs="?", help="experiment name (omit to list them)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller points")
    p.add_argument("--out", help="folder for plots (default: the current folder)")
    p.add_argument("--context", type=int, default=256, help="lm-step: context length (default 256)")
    p.add_argument("--memory-snapshot", help="lm-step: write a CUDA memory snapshot of one step")


def run(args) -> int:
    from perfloop import experiments

    if args.name in (None, "list"):
        table("experiments", ["name", "what"], [[n, d] for n, d in experiments.describe().items()])
        return 0
    try:
        exp = experiments.get(args.name)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    store = open_store(args)
    run_id = start_run(store)
    extra = {}
    if args.name == "lm-step":
        extra = {"context": args.context, "memory_snapshot": args.memory_snapshot}
    elif args.context != 256 or args.memory_snapshot:
        raise UsageError("--context/--memory-snapshot: only lm-step takes them")
    try:
        result = exp(quick=args.quick, store=store, run_id=run_id, out_dir=args.out, **extra)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        emit_json(result)
    else:
        t = result["table"]
        table(f"experiment {args.name}", t["headers"], t["rows"])
        console().print(result["conclusion"])
        for p in result.get("plot_paths", []):
            console().print(f"plot: {p}")
    return 0
