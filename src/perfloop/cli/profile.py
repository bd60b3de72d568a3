"""`perfloop profile`: where the time goes -- kernels, launches, busy time, the diagnosis."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

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
from perfloop.cli.output import console, emit_json, status


def register(verb) -> None:
    p = verb("profile", "where the time goes: kernels, launches, busy time, diagnosis", run, db=True)
    p.add_argument("op")
    p.add_argument("--variant", required=True)
    p.add_argument("--shape")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--calls", type=int, default=3, help="calls inside the profile (default 3)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--trace", help="write a Chrome/Perfetto trace here")
    p.add_argument("--memory-snapshot", help="write a CUDA memory snapshot (pytorch.org/memory_viz)")
    p.add_argument("--nsys", action="store_true", help="run under Nsight Systems (needs nsys)")
    # set by --nsys for the process it runs under nsys: bracket the profiled calls for capture
    p.add_argument("--cuda-profiler-range", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    from perfloop.device import default_device
    from perfloop.workflows.ops import profile_variant

    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shape = parse_shape(args.shape) if args.shape else op.bench_shape(default_device())
    [variant] = get_variants(op, [args.variant], timing=True) or [None]
    if variant is None:
        return FAILED
    if args.nsys:
        return run_nsys(args)
    store = open_store(args)
    try:
        with shape_errors(), status(args, f"profiling {op.name}/{variant}"):
            p, d = profile_variant(op, variant, shape, dtype, calls=args.calls, trace=args.trace,
                                   memory_snapshot=args.memory_snapshot,
                                   cuda_profiler_range=args.cuda_profiler_range)  # fmt: skip
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    run_id = start_run(store)
    payload = p.to_dict() | {"diagnosis": {"bound": d.bound, "evidence": d.evidence, "advice": d.advice}}
    store.add_artifact(run_id, "profile", payload, op=op.name, variant=variant)
    if args.json:
        emit_json(payload)
        return 0
    console().print(p.table(top=args.top))
    console().print(str(d))
    if p.peak_memory_bytes is not None:
        console().print(f"peak memory per call: {p.peak_memory_bytes / 2**20:.1f} MiB")
    for w in p.warnings:
        console().print(f"{w}", style="yellow")
    if args.trace:
        console().print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.memory_snapshot:
        console().print(f"memory snapshot: {args.memory_snapshot} (https://pytorch.org/memory_viz)")
    return 0


def run_nsys(args) -> int:
    nsys = shutil.which("nsys")
    if nsys is None:
        console(True).print(
            "--nsys: Nsight Systems (`nsys`) is not on PATH. Install it from the CUDA "
            "toolkit, or profile without --nsys (torch.profiler, with --trace for Perfetto).",
            style="red",
        )
        return FAILED
    out = args.trace or f"perfloop-{args.op}-{args.variant}"
    cmd = [nsys, "profile", "-o", out, "--force-overwrite=true", "--trace=cuda,nvtx",
           "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
           sys.executable, "-m", "perfloop", "profile", args.op, "--variant", args.variant,
           "--calls", str(args.calls), "--cuda-profiler-range"]  # fmt: skip
    if args.shape:
        cmd += ["--shape", args.shape]
    console().print("running: " + " ".join(cmd))
    return subprocess.call(cmd, env=dict(os.environ))
