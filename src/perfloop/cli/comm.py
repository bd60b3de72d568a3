"""`perfloop comm`: collective bandwidth over torch.distributed (NCCL on GPUs, gloo on CPUs)."""

from __future__ import annotations

import os

from perfloop.cli.args import FAILED, UsageError, open_store, start_run
from perfloop.cli.output import emit_json, table


def register(verb) -> None:
    p = verb("comm", "collective bandwidth over torch.distributed (NCCL / gloo)", run, db=True)
    p.add_argument("--nproc", type=int, help="spawn this many ranks (else run under torchrun)")
    p.add_argument("--collective", action="append", help="repeatable; default: all five")
    p.add_argument("--sizes", nargs="+", help="bytes per rank (default 1 KB .. 1 GB, 16 MB on a CPU)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective fails")


def run(args) -> int:
    from perfloop.device import has_cuda
    from perfloop.workflows import comm

    sizes = [int(s) for s in args.sizes] if args.sizes else comm.default_sizes(has_cuda())
    names = args.collective or list(comm.COLLECTIVES)
    for n in names:
        if n not in comm.COLLECTIVES:
            raise UsageError(f"--collective: unknown {n!r}; valid: {', '.join(comm.COLLECTIVES)}")
    if any(s <= 0 for s in sizes):
        raise UsageError("--sizes: bytes per rank must be positive, e.g. --sizes 1024 1048576")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # under torchrun
        comm.init_from_env(args.timeout)
        import torch.distributed as dist

        rows = comm.run_collectives(sizes, names, args.iters)
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    elif args.nproc:
        try:
            rows = comm.spawn(
                args.nproc, "collectives_on_ranks", sizes, names, args.iters, timeout_s=args.timeout
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        raise UsageError(
            "world size 1: collectives need at least 2 ranks; run under "
            "`torchrun --nproc-per-node 2 -m perfloop comm` or add --nproc 2"
        )
    store = open_store(args)
    run_id = start_run(store)
    store.add_artifact(run_id, "comm", {"rows": rows}, op="comm")
    if args.json:
        emit_json({"run_id": run_id, "rows": rows})
    else:
        table(
            f"collectives on {rows[0]['ranks']} ranks ({rows[0]['backend']})",
            [
                "collective",
                "bytes (nccl-tests)",
                "time (slowest rank)",
                "algbw GB/s",
                "busbw GB/s",
                "correct",
            ],
            [
                [
                    r["collective"],
                    r["bytes"],
                    f"{r['time_ms']:.4f} ms",
                    f"{r['algbw_gbps']:.2f}",
                    f"{r['busbw_gbps']:.2f}",
                    "yes" if r["correct"] else "NO",
                ]
                for r in rows
            ],
        )
    return 0 if all(r["correct"] for r in rows) else FAILED
