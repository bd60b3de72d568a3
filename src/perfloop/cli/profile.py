"""`perfloop profile`: where the time goes -- kernels, launches, busy time, the diagnosis."""

from __future__ import annotations

import argparse
import contextlib
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
    p = verb(
        "profile",
        "where the time goes: kernels, launches, busy time, diagnosis; an op's variant, "
        "or a window of your own script (--script)",
        run,
        db=True,
    )
    p.add_argument("op", nargs="?", help="an op of the library (or --script instead)")
    p.add_argument("--variant", help="the op's variant (with OP)")
    p.add_argument("--shape", help="the op's input shape, e.g. 4096x4096 (default: its benchmark shape)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16 or bf16")
    p.add_argument("--calls", type=int, default=3, help="calls inside the profile (default 3)")
    p.add_argument("--top", type=int, default=10, help="rows shown per table (default 10)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace here")
    p.add_argument("--memory-snapshot", help="write a CUDA memory snapshot (pytorch.org/memory_viz)")
    p.add_argument("--nsys", action="store_true", help="run under Nsight Systems (needs nsys)")
    # set by --nsys for the process it runs under nsys: bracket the profiled calls for capture
    p.add_argument("--cuda-profiler-range", action="store_true", help=argparse.SUPPRESS)
    s = p.add_argument_group("a script (perfloop profile [flags] --script train.py [its arguments])")
    s.add_argument(
        "--script",
        help="run this Python script unchanged and profile a window of it; "
        "everything after its path goes to it",
    )
    s.add_argument(
        "--range",
        default=None,
        help="what one step is: optimizer.step (the work between two "
        "optimizer.step() calls), or a range's name: pl.annotate, record_function, NVTX, "
        "ProfilerStep (default: a range named step, optimizer.step, or -- a generation loop with "
        "neither -- one decode call of its model, one token a sequence, its prefill left out; "
        "whichever comes first)",
    )
    s.add_argument(
        "--skip",
        type=int,
        default=None,
        help="occurrences of the range to skip first, the warm-up (default 2, and more while the "
        "one before compiled under torch.compile; their pace is the wall time without the profiler)",
    )
    s.add_argument("--steps", type=int, default=2, help="occurrences to profile (default 2)")
    s.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens one occurrence makes or takes in (a generation step): read per token -- tokens/s, "
        "ms and bytes a token, the share of the copy ceiling (default: the embedding's input, else "
        "the KV cache's batch, one token a sequence)",
    )
    s.add_argument("--window", help="START:DURATION in seconds, for a script without ranges")
    s.add_argument(
        "--depth", type=int, default=3, help="module names rolled up to this many parts (default 3)"
    )
    s.add_argument("--no-count", action="store_true", help="do not count FLOPs and bytes (no roofline)")
    s.add_argument(
        "--exit-after",
        action="store_true",
        help="end the script once its profile is taken (its finally blocks run, its later "
        "steps do not); default: it runs to its end",
    )
    s.add_argument("--report", metavar="DIR", help="also write a report page there: roofline, modules, idle")
    p.add_argument(
        "--trace-file",
        help="read a Chrome trace torch.profiler wrote elsewhere "
        "(record_shapes=True for FLOPs and bytes) instead of running anything",
    )


def run(args) -> int:
    from perfloop.device import default_device
    from perfloop.workflows.ops import profile_variant

    if args.script or args.trace_file:
        if args.op or args.variant or (args.script and args.trace_file):
            raise UsageError(
                "--script / --trace-file: give one of an op (with --variant), --script or --trace-file"
            )
        return run_step_profile(args)
    if not args.op or not args.variant:
        raise UsageError(
            "profile: give an op and --variant (perfloop profile gelu --variant triton), or --script train.py"
        )
    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shape = parse_shape(args.shape) if args.shape else op.bench_shape(default_device())
    [variant] = get_variants(op, [args.variant], timing=True, dtype=dtype) or [None]
    if variant is None:
        return FAILED
    if args.nsys:
        return run_nsys(args)
    store = open_store(args)
    try:
        with shape_errors(), status(args, f"profiling {op.name}/{variant}"):
            p, d = profile_variant(
                op,
                variant,
                shape,
                dtype,
                calls=args.calls,
                trace=args.trace,
                memory_snapshot=args.memory_snapshot,
                cuda_profiler_range=args.cuda_profiler_range,
            )
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    run_id = start_run(store)
    payload = p.to_dict() | {"diagnosis": d.to_dict()}
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
    cmd = [
        nsys,
        "profile",
        "-o",
        out,
        "--force-overwrite=true",
        "--trace=cuda,nvtx",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        sys.executable,
        "-m",
        "perfloop",
        "profile",
        args.op,
        "--variant",
        args.variant,
        "--calls",
        str(args.calls),
        "--cuda-profiler-range",
    ]
    if args.shape:
        cmd += ["--shape", args.shape]
    console().print("running: " + " ".join(cmd))
    return subprocess.call(cmd, env=dict(os.environ))


def _window(text: str | None):
    if text is None:
        return None
    try:
        start, duration = (float(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(
            f"--window: cannot read {text!r}; write START:DURATION in seconds, e.g. 5:2"
        ) from None
    return start, duration


def _progress_printer(path: str, quiet: bool):
    """progress(bytes read, size) that says every tenth of a large file read, on stderr."""
    said = [0]

    def progress(done: int, size: int) -> None:
        tenth = 10 * done // max(size, 1)
        if not quiet and tenth > said[0]:
            said[0] = tenth
            print(
                f"reading {path}: {done / 2**20:,.0f} of {size / 2**20:,.0f} MiB", file=sys.stderr, flush=True
            )

    return progress


def _taken_printer(args):
    """What to say once the profile is taken and the script runs on (nothing under --json)."""
    if args.json:
        return None

    def say():
        print(
            "perfloop: the profile is taken; the script runs on to its end (--exit-after ends it "
            "once the profile is taken)",
            file=sys.stderr,
            flush=True,
        )

    return say


def _perfloop_options_in(script_args: list[str]) -> list[str]:
    """perfloop's own options among the script's arguments (a script that failed may have been
    handed them by mistake)."""
    from perfloop.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ours = {o for a in sub.choices["profile"]._actions for o in a.option_strings} - {"-h", "--help"}
    return sorted({a.split("=")[0] for a in script_args if a.split("=")[0] in ours})


def run_step_profile(args) -> int:
    from perfloop.workflows.script import ScriptError

    window, range_name = _step_args(args)
    store = open_store(args)
    failed = None
    try:
        p = _take_profile(args, window, range_name)
    except ScriptError as exc:
        if exc.profile is None:
            return _script_failed(args, exc)
        p, failed = exc.profile, exc
    except (OSError, ValueError) as exc:
        text = str(exc)
        if (
            args.script
            and {"-h", "--help"} & set(args.script_args or [])
            and text.startswith("no step found")
        ):
            console(True).print(
                "perfloop profile: the script printed its own help and ended before a step: "
                "nothing profiled. perfloop's options: perfloop profile --help",
                style="yellow",
            )
            return 0
        raise UsageError(
            "--trace-file:" + text[len("trace:") :] if text.startswith("trace:") else text
        ) from None
    with status(args, "attributing and ranking"):
        tables = {"modules": p.breakdown("module", depth=args.depth), "ops": p.breakdown("op")}
        d, idle = p.diagnose(), p.idle()
        tokens = p.tokens(args.tokens) if (args.script or args.trace_file) else None
    if args.trace:
        p.export_trace(args.trace)
    range_name = p.step or range_name
    what = _what_was_profiled(args, p, range_name)
    payload = _step_payload(args, p, what, tables, d, idle) | {"tokens": tokens.to_dict() if tokens else None}
    run_id, name = _store_step(store, args, p, payload, range_name)
    page = None
    if args.report:
        from perfloop.results.report import render_html

        page = render_html(store, args.report, run_id)
    if args.json:
        emit_json(payload)
    else:
        _print_step(args, p, what, tables, d, idle, run_id, name, page, tokens)
    if failed is not None:
        console(True).print(
            f"--script: {failed}; the profile taken before it is kept (run {run_id})", style="yellow"
        )
        return failed.status
    return 0


def _step_args(args) -> tuple:
    """(window, range name) from the flags, checked; paths made absolute where the user ran
    perfloop (whatever the script's chdir); the report's folder made and checked writable."""
    from perfloop.results.store import IN_MEMORY
    from perfloop.workflows.script import AUTO

    if args.trace_file and args.trace:
        raise UsageError("--trace: a trace file is already a trace; open --trace-file in Perfetto")
    if args.range and args.window:
        raise UsageError("--range and --window: give one (a range's occurrences, or a time window)")
    if args.depth < 1:
        raise UsageError(f"--depth: must be >= 1, got {args.depth}")
    if args.tokens is not None and args.tokens < 1:
        raise UsageError(f"--tokens: must be >= 1 (the tokens one occurrence makes), got {args.tokens}")
    window = _window(args.window)
    range_name = None if window or args.trace_file else (args.range or AUTO)
    for name in ("report", "trace", "db"):
        if getattr(args, name, None) and getattr(args, name) != IN_MEMORY:
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if args.report:
        try:
            os.makedirs(args.report, exist_ok=True)
            if not os.access(args.report, os.W_OK):
                raise OSError("not writable")
        except OSError as exc:
            raise UsageError(
                f"--report: cannot write to {args.report} ({exc}); choose a writable folder"
            ) from None
    return window, range_name


def _take_profile(args, window, range_name):
    from perfloop.analysis.trace import from_trace
    from perfloop.workflows.script import profile_script

    with status(args, f"running {args.script}" if args.script else f"reading {args.trace_file}"):
        if args.trace_file:
            return from_trace(args.trace_file, progress=_progress_printer(args.trace_file, args.json))
        with _prints_to_stderr(args.json):
            return profile_script(
                args.script,
                args.script_args,
                range_name,
                skip=args.skip,
                steps=args.steps,
                window=window,
                count_work=not args.no_count,
                exit_after=args.exit_after,
                on_taken=_taken_printer(args),
            )


@contextlib.contextmanager
def _prints_to_stderr(json_out: bool):
    """Under --json standard output is the JSON's alone: the script's prints, its Python's and its
    child processes' (fd 1), go to standard error while it runs."""
    if not json_out:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if sys.__stdout__ is not None and not sys.__stdout__.closed:
            sys.__stdout__.flush()  # what the script wrote to the original stream, still to stderr
        os.dup2(saved, 1)
        os.close(saved)


def _script_failed(args, exc) -> int:
    if exc.code is None:
        import traceback

        traceback.print_exception(exc.original, file=sys.stderr)
    console(True).print(f"--script: {exc}; the profiler was stopped and nothing was stored", style="red")
    stray = _perfloop_options_in(args.script_args)
    if stray:
        console(True).print(
            f"--script: {', '.join(stray)} reached the script: everything after the "
            "script's path is the script's. Put perfloop's options before --script, "
            "or end them with -- (--script PATH OPTIONS -- SCRIPT-ARGS)",
            style="yellow",
        )
    return exc.status or FAILED


def _what_was_profiled(args, p, range_name) -> str:
    if args.trace_file:
        return f"its {p.calls} ProfilerStep range(s)" if p.step_ms else "the whole trace"
    what = f"{p.calls} occurrence(s) of {range_name!r}" if range_name else f"the window {args.window} s"
    said = _step_said(p)
    if said:  # the step perfloop chose where the script names none: which model, its prefill apart
        what = f"{p.calls} decode call(s) of {said.split(' of ', 1)[1].split(' (', 1)[0]}"
    if p.window_cut_s is not None:
        what += f" (cut short: the script ended {p.window_cut_s:.3g} s into it)"
    return what


def _step_said(p) -> str | None:
    """The line saying which model call a step is, where the model-call source chose it."""
    from perfloop.workflows.step_sources import MODEL_CALL, STEP_SAID

    return next((w for w in p.warnings if w.startswith(STEP_SAID)), None) if p.step == MODEL_CALL else None


def _step_payload(args, p, what: str, tables: dict, d, idle) -> dict:
    from perfloop.analysis.attribution import row_dict
    from perfloop.analysis.compilation import summary
    from perfloop.harness.ceilings import ceilings as measured_ceilings

    return p.to_dict() | {
        "script": args.script or args.trace_file,
        "script_args": args.script_args,
        "window": what,
        "modules": [row_dict(r) for r in tables["modules"]],
        "ops": [row_dict(r) for r in tables["ops"]],
        "idle": idle.__dict__ if idle else None,
        "diagnosis": d.to_dict(),
        "patch_sites": p.sites,
        "compilation": [c.__dict__ for c in summary(p.compile_metrics or [])],
        "ceilings": measured_ceilings(measure=False),
    }


def _store_step(store, args, p, payload: dict, range_name) -> tuple[str, str]:
    """The profile as a run's artifact, and its steps' own times as a line `history` follows."""
    run_id = start_run(store)
    name = f"{'script' if args.script else 'trace'}:{os.path.basename(args.script or args.trace_file)}"
    store.add_artifact(run_id, "profile", payload, op=name, variant=range_name or "window")
    if len(p.step_ms) >= 2:
        from perfloop.device import env_fingerprint
        from perfloop.harness.measurement import Measurement

        m = Measurement(samples_ms=tuple(p.step_ms), label=name, env=env_fingerprint())
        store.add(run_id, m, op=name, variant=f"{range_name or 'window'} (profiled step)", shape=(), dtype="")
    return run_id, name


def _print_step(args, p, what, tables, d, idle, run_id, name, page, tokens=None) -> None:
    from perfloop.analysis.attribution import table

    out = console()
    out.print(f"{args.script or args.trace_file}: profiled {what}", style="bold")
    if _step_said(p):
        out.print(_step_said(p), markup=False, highlight=False, soft_wrap=True)
    out.print(table(tables["modules"], p.calls, "module", top=args.top), markup=False, highlight=False)
    out.print(table(tables["ops"], p.calls, "op", top=args.top), markup=False, highlight=False)
    if idle is not None:
        causes = ", ".join(f"{c} {v / p.calls:.3f} ms" for c, v in idle.by_cause.items() if v)
        kind = "GPU idle" if idle.device == "GPU" else "no torch op running (the CPU is the device)"
        out.print(f"{kind} {idle.idle_share:.0%} of the window ({causes or 'none'})")
    from perfloop.analysis.compilation import gave_up, summary, summary_lines

    rows = summary(p.compile_metrics or [])
    for line in summary_lines(rows):
        out.print(line, markup=False, highlight=False)
    for line in gave_up(rows):
        out.print(line, style="yellow")
    out.print(str(d), markup=False, highlight=False)
    for line in tokens.lines() if tokens else []:
        out.print(line, markup=False, highlight=False)
    if p.sites:
        from perfloop.workflows.models_seen import patch_summary

        call = (
            "pl.patch(model, batch, measure=True, compiled=True)"
            if p.compiled_code()
            else "pl.patch(model, batch)"
        )
        said = f"{call} would check, each against float64 on your batch before swapping:"
        out.print(said, markup=False, highlight=False)
        for line in patch_summary(p.sites):
            out.print(f"  {line}", markup=False, highlight=False)
        from perfloop.ops.base import TRITON_MISSING, triton_installed

        if not triton_installed():  # it would keep every one: say why before the user tries
            out.print(f"  but here: {TRITON_MISSING}", style="yellow")
    for w in p.warnings:
        if w != _step_said(p):  # said in the heading
            out.print(w, style="yellow")
    out.print(f"stored as run {run_id} ({name}); compare two runs op by op: perfloop compare RUN_A RUN_B")
    if args.trace:
        out.print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    if page:
        out.print(f"report: {page}")
