"""The `perfloop` command. Every verb has --help; --json where a program reads the output.

Exit codes: 0 success, 1 a check or a regression failed, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

USAGE_ERROR = 2
FAILED = 1


class UsageError(Exception):
    """Bad input from the command line; printed without a traceback, exit 2."""


def _prepare_triton() -> None:
    # Without a GPU, Triton kernels can only run in its interpreter, and the switch
    # must be set before Triton is imported. Say so rather than fail.
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


# ------------------------------------------------------------------ output helpers


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped into a file or a log, rich would wrap tables at 80 columns: give them room.
    width = None if stream.isatty() else 160
    # markup=False: kernel names like "elementwise[tanh]" must print as they are
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width, markup=False)


@contextmanager
def progress(args, total: int, what: str):
    """A progress bar on stderr, only for a person at a terminal (not with --json)."""
    show = sys.stderr.isatty() and not getattr(args, "json", False)
    if not show:
        yield lambda *a, **k: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console(True)
    ) as p:
        task = p.add_task(what, total=total)
        yield lambda desc=None: p.update(task, advance=1, description=desc or what)


@contextmanager
def status(args, text: str):
    """A spinner on stderr for a step that takes seconds (only at a terminal, not with --json)."""
    if sys.stderr.isatty() and not getattr(args, "json", False):
        with console(True).status(text):
            yield
    else:
        yield


def table(title: str | None, headers: list[str], rows: list[list]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        cells = [str(r[i]) for r in rows if i < len(r)]
        numeric = cells and all(c[:1].isdigit() or c in ("-", "") for c in cells)
        t.add_column(h, justify="right" if numeric else "left")
    for r in rows:
        t.add_row(*[str(c) for c in r])
    console().print(t)


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=1, default=str))


# ------------------------------------------------------------------ parsing


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x") if s != "")
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"--shape: cannot read {text!r}; write sizes joined by x, e.g. 4096x4096")
    return shape


def parse_dtype(text: str):
    from perfloop.ops.base import parse_dtype as pd

    try:
        return pd(text)
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None


def get_op(name: str):
    from perfloop import ops

    try:
        return ops.get(name)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def get_variants(op, names: list[str] | None, device: str, timing: bool) -> list[str]:
    """The variants asked for (or all that can run here); unknown names are usage errors."""
    chosen = names or list(op.variants)
    for n in chosen:
        if n not in op.variants:
            raise UsageError(f"--variant: {op.name!r} has no {n!r}; valid: {', '.join(op.variants)}")
    out = []
    for n in chosen:
        v = op.variant(n)
        why = v.why_unavailable(device)
        if why:
            if names:
                console(True).print(f"skip {op.name}/{n}: {why}", style="yellow")
            continue
        if timing and v.interpreted:
            console(True).print(
                f"skip timing {op.name}/{n}: Triton runs in its interpreter here "
                "(correct, not fast); `perfloop check` tests it",
                style="yellow",
            )
            continue
        out.append(n)
    return out


def open_store(args):
    from perfloop.store import Store, StoreError

    try:
        return Store(args.db)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ verbs


def cmd_env(args) -> int:
    from perfloop.device import ceilings, env_fingerprint

    info = env_fingerprint()
    if args.ceilings:
        info["ceilings"] = ceilings(refresh=args.refresh)
    if args.json:
        emit_json(info)
        return 0
    d = info["device"]
    rows = [
        ["python", info["python"]],
        ["torch", info["torch"]],
        ["triton", info["triton"] or "not installed (Triton variants unavailable)"],
        ["cuda", info["cuda"] or "none (CPU build)"],
        ["device", d["name"]],
    ]
    if d["kind"] == "cuda":
        rows += [
            ["capability", d["capability"]],
            ["SMs", d["sms"]],
            ["L2", f"{d['l2_bytes'] / 2**20:.0f} MiB"],
            ["memory", f"{d['memory_bytes'] / 2**30:.1f} GiB"],
            ["driver", d["driver"]],
        ]
    else:
        rows += [["cores", d["cores"]], ["torch threads", d["torch_threads"]]]
    rows += [[f"precision: {k}", v] for k, v in info["precision"].items()]
    rows.append(["git", info["git"] or "-"])
    if args.ceilings:
        c = info["ceilings"]
        rows.append(["ceiling: copy", f"{c['copy_gbps']:.0f} GB/s (read + write)"])
        for k, v in c.items():
            if k.startswith("matmul_") and k.endswith("_tflops"):
                name = k[len("matmul_") : -len("_tflops")]
                rows.append([f"ceiling: {name} matmul", f"{v:.1f} TFLOP/s"])
    table("perfloop env", ["what", "value"], rows)
    return 0


def cmd_list(args) -> int:
    from perfloop import ops

    out = []
    for name in ops.names():
        op = ops.get(name)
        for vname, v in op.variants.items():
            why = v.why_unavailable(device())
            here = "yes" if not why else f"no: {why}"
            if not why and v.interpreted:
                here = "interpreted (correctness only)"
            out.append({"op": name, "variant": vname, "runs_here": here, "what": v.doc})
    if args.json:
        emit_json(out)
    else:
        table(
            "ops and variants",
            ["op", "variant", "runs here", "what"],
            [list(r.values()) for r in out],
        )
    return 0


def cmd_check(args) -> int:
    from perfloop import ops
    from perfloop.ops.base import CheckFailed

    names = [args.op] if args.op else ops.names()
    results, failed = [], False
    todo = []
    for name in names:
        op = get_op(name)
        for v in get_variants(op, args.variant, device(), timing=False):
            todo.append((op, v))
    dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
    with progress(args, len(todo), "checking") as step:
        for op, v in todo:
            step(f"check {op.name}/{v}")
            try:
                recs = op.check(v, dtypes=dtypes, seeds=args.seeds)
                results.append({"op": op.name, "variant": v, "ok": True, "cases": len(recs),
                                "max_abs_err": max(r["max_abs"] for r in recs)})  # fmt: skip
            except CheckFailed as exc:
                failed = True
                results.append({"op": op.name, "variant": v, "ok": False, "error": str(exc)})
    if args.json:
        emit_json(results)
    else:
        rows = [
            [r["op"], r["variant"], "ok" if r["ok"] else "FAIL",
             f"{r['cases']} cases, max abs err {r['max_abs_err']:.2g}" if r["ok"] else r["error"]]
            for r in results
        ]  # fmt: skip
        table("check against the float64 reference", ["op", "variant", "result", "detail"], rows)
    return FAILED if failed else 0


def bench_op(args, op, variants, shape, dtype, store=None, run_id=None, quiet=False):
    """Check, then time the variants interleaved; store each row. Returns (Comparison, rows)."""
    import perfloop as pl
    from perfloop.ops.base import dtype_name

    dev = device()
    for v in variants:  # never time a wrong answer
        op.check(v, dtypes=[dtype], shapes=op.test_shapes[2:4], seeds=1)
    inputs = op.make_inputs(shape, dtype=dtype, device=dev, seed=0)
    if op.validate:
        op.validate(*inputs)
    work = op.work(shape, dtype)
    fns = {v: (lambda var=op.variant(v): var(*inputs)) for v in variants}
    baseline = op.baseline if op.baseline in fns else variants[0]
    c = pl.compare(fns, baseline=baseline, work=work, flush_l2=not args.no_flush, budget_s=args.budget)
    graph = {}
    if getattr(args, "graph", False):
        for v in variants:
            try:
                graph[v] = pl.bench(fns[v], work=work, graph=True, flush_l2=not args.no_flush)
            except ValueError as exc:
                console(True).print(f"{op.name}/{v}: {exc}", style="yellow")
    rows = []
    for v, m in c.measurements.items():
        sp = c.speedups.get(v)
        row = {
            "op": op.name, "variant": v, "shape": list(shape), "dtype": dtype_name(dtype),
            "median_ms": m.median_ms, "ci95_ms": list(m.ci95_ms), "gbps": m.gbps,
            "tflops": m.tflops, "sol": m.sol, "speedup": sp.speedup if sp else 1.0,
            "speedup_ci": list(sp.ci) if sp else [1.0, 1.0],
            "significant": sp.significant if sp else None, "baseline": baseline,
            "warnings": list(m.warnings),
        }  # fmt: skip
        if v in graph:
            row["graph_median_ms"] = graph[v].median_ms
            row["graph_kernel_ms"] = graph[v].meta.get("graph_kernel_ms")
            row["warnings"] += [f"graph: {w}" for w in graph[v].warnings]
        rows.append(row)
        if store is not None:
            store.add(run_id, m, op=op.name, variant=v, shape=shape, dtype=dtype_name(dtype),
                      speedup=sp, baseline=baseline)  # fmt: skip
            if v in graph:
                store.add(run_id, graph[v], op=op.name, variant=v, shape=shape,
                          dtype=dtype_name(dtype))  # fmt: skip
    if not quiet and not args.json:
        print_bench_rows(rows, op.name, shape, dtype_name(dtype))
    return c, rows


def _num(v) -> str:
    """A rate with sensible digits: 4239, 52.1, 0.0123."""
    if not v:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def print_bench_rows(rows, op, shape, dtype):
    from perfloop.measurement import fmt_ms

    headers = ["variant", "dtype", "median", "95% CI", "GB/s", "TFLOP/s", "% SOL", "speed-up"]
    has_graph = any("graph_median_ms" in r for r in rows)
    if has_graph:
        headers += ["graph replay", "its kernels"]
    out = []
    for r in rows:
        sig = "" if r["significant"] in (None, True) else " (n.s.)"
        line = [
            r["variant"], r["dtype"], fmt_ms(r["median_ms"]),
            f"{fmt_ms(r['ci95_ms'][0])}..{fmt_ms(r['ci95_ms'][1])}",
            _num(r["gbps"]),
            _num(r["tflops"]),
            f"{100 * r['sol']:.0f}%" if r["sol"] is not None else "-",
            f"{r['speedup']:.2f}x [{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}]{sig}",
        ]  # fmt: skip
        if has_graph:
            line.append(fmt_ms(r["graph_median_ms"]) if "graph_median_ms" in r else "-")
            line.append(fmt_ms(r["graph_kernel_ms"]) if r.get("graph_kernel_ms") else "-")
        out.append(line)
    shape_s = "x".join(map(str, shape))
    table(f"{op} {shape_s} {dtype} (speed-up vs {rows[0]['baseline']})", headers, out)
    for r in rows:
        for w in r["warnings"]:
            console().print(f"{r['variant']}: {w}", style="yellow")


def cmd_bench(args) -> int:
    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shape = parse_shape(args.shape) if args.shape else op.bench_shape(device())
    variants = get_variants(op, args.variant, device(), timing=True)
    if not variants:
        raise UsageError(f"--variant: none of the asked variants of {op.name} can be timed here")
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), _env())
    with status(args, f"checking, then timing {len(variants)} variants of {op.name} interleaved"):
        _, rows = bench_op(args, op, variants, shape, dtype, store, run_id, quiet=True)
    if not args.json:
        print_bench_rows(rows, op.name, shape, rows[0]["dtype"])
    if args.json:
        emit_json({"run_id": run_id, "rows": rows})
    else:
        console().print(f"stored as run {run_id} in {store.path}")
    return 0


def _env():
    from perfloop.device import env_fingerprint

    return env_fingerprint()


def profile_op(op, variant, shape, dtype, calls=3, trace=None, snapshot=None):
    import perfloop as pl

    inputs = op.make_inputs(shape, dtype=dtype, device=device(), seed=0)
    v = op.variant(variant)
    p = pl.profile(lambda: v(*inputs), calls=calls, work=op.work(shape, dtype),
                   memory_snapshot=snapshot)  # fmt: skip
    if trace:
        p.export_trace(trace)
    return p, p.diagnose()


def cmd_profile(args) -> int:
    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shape = parse_shape(args.shape) if args.shape else op.bench_shape(device())
    [variant] = get_variants(op, [args.variant], device(), timing=True) or [None]
    if variant is None:
        return FAILED
    if args.nsys:
        return run_nsys(args)
    try:
        with status(args, f"profiling {op.name}/{variant}"):
            p, d = profile_op(op, variant, shape, dtype, args.calls, args.trace, args.memory_snapshot)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), _env())
    payload = p.to_dict() | {"diagnosis": {"bound": d.bound, "evidence": d.evidence,
                                           "advice": d.advice}}  # fmt: skip
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
           "--calls", str(args.calls)]  # fmt: skip
    if args.shape:
        cmd += ["--shape", args.shape]
    console().print("running: " + " ".join(cmd))
    return subprocess.call(cmd, env={**os.environ, "PERFLOOP_NSYS": "1"})


def cmd_asm(args) -> int:
    from perfloop.asm import AsmError, inspect_variant

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
        rows.append([k["name"][:50], k.get("registers", "?"), k.get("smem_bytes", 0),
                     k.get("spill_stores", 0), k.get("threads", "?"),
                     f"{k['occupancy']:.0%}" if k.get("occupancy") is not None else "?",
                     k.get("limited_by", "")])  # fmt: skip
    table(f"{op.name}/{args.variant} for {args.arch}",
          ["kernel", "regs/thread", "smem B", "spill B", "threads", "occupancy", "limited by"],
          rows)  # fmt: skip
    for note in rep["notes"]:
        console().print(f"- {note}")
    if args.show:
        console().print(rep.get(args.show) or f"no {args.show} available")
    return 0


def cmd_sweep(args) -> int:
    import perfloop as pl
    from perfloop.ops.base import dtype_name
    from perfloop.report import numel
    from perfloop.store import shape_str

    op = get_op(args.op)
    dtype = parse_dtype(args.dtype)
    shapes = [parse_shape(s) for s in args.shapes]
    variants = get_variants(op, args.variant, device(), timing=True)
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), _env())
    if args.distributed:
        return distributed_sweep_cli(args, op, variants, shapes, dtype, store, run_id)
    results = {}
    with progress(args, len(shapes) * len(variants), "sweep") as step:
        for v in variants:
            var = op.variant(v)

            def factory(shape, var=var):
                inputs = op.make_inputs(shape, dtype=dtype, device=device(), seed=0)
                return lambda: var(*inputs)

            def on_point(pt, v=v):
                step(f"{v} {shape_str(pt.size)}")
                if pt.measurement is not None:  # stored at once: Ctrl-C keeps it
                    store.add(run_id, pt.measurement, op=op.name, variant=v, shape=pt.size,
                              dtype=dtype_name(dtype))  # fmt: skip

            results[v] = pl.sweep(factory, shapes, work=lambda s: op.work(s, dtype),
                                  size_of=lambda s: float(numel(shape_str(s))),
                                  on_point=on_point, budget_s=args.budget)  # fmt: skip
    out = {
        v: {"points": [{"shape": list(p.size), "median_ms": p.measurement.median_ms if p.measurement
                        else None, "error": p.error} for p in s.points], "fit": s.fit}
        for v, s in results.items()
    }  # fmt: skip
    for v, s in results.items():
        if s.fit:
            store.add_artifact(run_id, "sweep_fit", {"variant": v, **s.fit}, op=op.name, variant=v)
    if args.plot:
        plot_sweep(results, args.plot, op.name)
    if args.json:
        emit_json({"run_id": run_id, "sweeps": out})
        return 0
    from perfloop.measurement import fmt_ms

    for v, s in results.items():
        m = [p.measurement for p in s.points]
        rows = [[shape_str(p.size), fmt_ms(mi.median_ms) if mi else "error",
                 f"{mi.gbps:.3g}" if mi and mi.gbps else "-", f"{mi.tflops:.3g}" if mi and mi.tflops else "-",
                 p.error or ""] for p, mi in zip(s.points, m, strict=True)]  # fmt: skip
        table(f"{op.name}/{v} {dtype_name(dtype)}", ["shape", "median", "GB/s", "TFLOP/s", "error"], rows)
        if s.fit:
            f = s.fit
            knee = f"{f['knee']:.3g}" if f.get("knee") else "n/a"
            console().print(
                f"fit: time = {fmt_ms(f['floor'])} + c*n^{f['exponent']:.2f}; work dominates "
                f"above ~{knee} elements (R^2 {f['r2']:.3f})"
            )
    console().print(f"stored as run {run_id}" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


def distributed_sweep_cli(args, op, variants, shapes, dtype, store, run_id, entry="sweep_on_ranks") -> int:
    from perfloop import comm
    from perfloop.ops.base import dtype_name
    from perfloop.store import shape_str

    if not args.nproc:
        raise UsageError("--distributed: give --nproc N (ranks to spawn), one device each")
    failure = None
    try:  # each rank stores its own points as it measures them
        res = comm.spawn(args.nproc, entry, op.name, variants, shapes, dtype_name(dtype), args.budget,
                         store.path, run_id)  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except RuntimeError as exc:  # a rank died: what the others measured is already stored
        failure = str(exc)
        res = {"points": [], "by_rank": {}}
    stored = {(r["variant"], r["shape"]): r for r in store.rows(run_id)}
    wanted = [(v, shape_str(s)) for v in variants for s in shapes]
    missing = [w for w in wanted if w not in stored]
    errors = [p for p in res["points"] if "error" in p]
    out = {"run_id": run_id, "stored": len(stored), "missing": missing, "errors": errors,
           "rank_failure": failure, "by_rank": res["by_rank"]}  # fmt: skip
    if args.json:
        emit_json(out)
    else:
        rows = [[v, s, f"{stored[(v, s)]['median_ms']:.4f} ms" if (v, s) in stored else "missing"]
                for v, s in wanted]  # fmt: skip
        table(f"{op.name} sweep on {args.nproc} ranks (run {run_id})", ["variant", "shape", "median"], rows)
        for p in errors:
            console().print(f"{p['variant']} {p['shape']} on rank {p['rank']}: {p['error']}", style="yellow")
        if failure:
            console().print(f"{failure}; {len(missing)} points lost, {len(stored)} kept", style="red")
    return FAILED if (missing or errors) else 0


def plot_sweep(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from perfloop.report import numel
    from perfloop.store import shape_str

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for v, s in results.items():
        pts = [(numel(shape_str(p.size)), p.measurement.median_ms) for p in s.points if p.measurement]
        if pts:
            ax.loglog(*zip(*pts, strict=True), "o-", label=v)
    ax.set_xlabel("elements")
    ax.set_ylabel("median time (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write ({exc})") from None
    finally:
        plt.close(fig)


def cmd_report(args) -> int:
    from perfloop.measurement import fmt_ms
    from perfloop.report import fmt_rate, fmt_speedup, latest_rows, render_html
    from perfloop.store import StoreError

    store = open_store(args)
    run_id = None
    if args.run:
        try:
            run_id = store.resolve_run(args.run)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
    if args.csv:
        _write(args.csv, store.export_csv(run_id))
    if args.export_json:
        _write(args.export_json, store.export_json(run_id))
    if args.html:
        try:
            page = render_html(store, args.html, run_id)
        except OSError as exc:
            raise UsageError(str(exc)) from None
        console().print(f"report: {page}")
    rows = latest_rows(store.rows(run_id))
    if args.json:
        emit_json(rows)
    elif not (args.html or args.csv or args.export_json):
        if not rows:
            console().print(f"no results in {store.path} yet: try `perfloop demo`")
        table(f"results in {store.path}", ["op", "variant", "shape", "dtype", "median", "rate",
              "speed-up", "device"],
              [[r["op"], r["variant"] + (" (graph)" if r["graph"] else ""), r["shape"], r["dtype"],
                fmt_ms(r["median_ms"]), fmt_rate(r), fmt_speedup(r), r["device"] or ""]
               for r in rows])  # fmt: skip
    return 0


def _write(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc}") from None


def parse_percent(text: str) -> float:
    try:
        v = float(text.rstrip("%"))
    except ValueError:
        raise UsageError(f"--fail-above: {text!r} is not a percentage; e.g. --fail-above 5%") from None
    if v < 0:
        raise UsageError(f"--fail-above: must be >= 0, got {text}")
    return v


def cmd_compare(args) -> int:
    from perfloop import stats
    from perfloop.measurement import fmt_ms
    from perfloop.store import StoreError

    store = open_store(args)
    try:
        a, b = store.resolve_run(args.run_a), store.resolve_run(args.run_b)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    limit = parse_percent(args.fail_above) if args.fail_above is not None else None

    def key(r):
        return (r["op"], r["variant"], r["shape"], r["dtype"], r["graph"])

    ra = {key(r): r for r in store.rows(a)}
    rb = {key(r): r for r in store.rows(b)}
    common = [k for k in ra if k in rb]
    if not common:
        raise UsageError(f"runs {a} and {b} share no (op, variant, shape, dtype) to compare")
    out, regressed = [], False
    for k in common:
        s = stats.independent_ratio(ra[k]["samples"], rb[k]["samples"])
        sig = s["p_value"] < 0.01 and not (s["ci"][0] <= 1.0 <= s["ci"][1])
        if not sig:
            verdict = "same (noise)"
        elif abs(s["ratio"] - 1) < 0.01:
            verdict = "same (<1%)"  # statistically detectable, practically nothing
        else:
            verdict = "slower" if s["ratio"] > 1 else "faster"
        fail = bool(limit is not None and sig and s["ratio"] > 1 + limit / 100)
        regressed |= fail
        out.append({"op": k[0], "variant": k[1], "shape": k[2], "dtype": k[3], "graph": bool(k[4]),
                    "a_ms": ra[k]["median_ms"], "b_ms": rb[k]["median_ms"], "ratio": s["ratio"],
                    "ci": s["ci"], "p_value": s["p_value"], "significant": sig,
                    "verdict": verdict, "regression": fail})  # fmt: skip
    if args.json:
        emit_json({"run_a": a, "run_b": b, "rows": out, "regressed": regressed})
    else:
        table(f"{b} against {a} (time ratio b/a; >1 is slower)",
              ["op", "variant", "shape", "dtype", "a", "b", "ratio [95% CI]", "p", "verdict"],
              [[r["op"], r["variant"], r["shape"], r["dtype"], fmt_ms(r["a_ms"]), fmt_ms(r["b_ms"]),
                f"{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]", f"{r['p_value']:.2g}",
                r["verdict"] + (" REGRESSION" if r["regression"] else "")] for r in out])  # fmt: skip
        if regressed:
            console().print(f"significant slowdown beyond {limit:g}%", style="red")
    return FAILED if regressed else 0


def cmd_comm(args) -> int:
    from perfloop import comm

    sizes = [int(s) for s in args.sizes] if args.sizes else comm.default_sizes(_cuda())
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
            rows = comm.spawn(args.nproc, "collectives_on_ranks", sizes, names, args.iters,
                              timeout_s=args.timeout)  # fmt: skip
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        raise UsageError(
            "world size 1: collectives need at least 2 ranks; run under "
            "`torchrun --nproc-per-node 2 -m perfloop comm` or add --nproc 2"
        )
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), _env())
    store.add_artifact(run_id, "comm", {"rows": rows}, op="comm")
    if args.json:
        emit_json({"run_id": run_id, "rows": rows})
    else:
        table(f"collectives on {rows[0]['ranks']} ranks ({rows[0]['backend']})",
              ["collective", "bytes (nccl-tests)", "time (slowest rank)", "algbw GB/s", "busbw GB/s",
               "correct"],
              [[r["collective"], r["bytes"], f"{r['time_ms']:.4f} ms", f"{r['algbw_gbps']:.2f}",
                f"{r['busbw_gbps']:.2f}", "yes" if r["correct"] else "NO"] for r in rows])  # fmt: skip
    return 0 if all(r["correct"] for r in rows) else FAILED


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_demo(args) -> int:
    from perfloop.demo import run_demo

    return run_demo(args)


def cmd_experiment(args) -> int:
    from perfloop import experiments

    if args.name in (None, "list"):
        table("experiments", ["name", "what"], [[n, d] for n, d in experiments.describe().items()])
        return 0
    try:
        exp = experiments.get(args.name)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    store = open_store(args)
    run_id = store.new_run(" ".join(sys.argv), _env())
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


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="perfloop",
        description="GPU performance engineering in PyTorch: measure, locate, fix, measure again.",
    )
    sub = ap.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name, help_, fn, db=False, js=True):
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        if js:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if db:
            p.add_argument("--db", help="results database (default: $PERFLOOP_DB or the user data dir)")
        return p

    p = verb("env", "what this machine is, and what it can do", cmd_env)
    p.add_argument("--ceilings", action="store_true", help="also measure (or read the cached) ceilings")
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again")

    verb("list", "ops and their variants, and which can run here", cmd_list)

    p = verb("check", "correctness against the float64 reference", cmd_check)
    p.add_argument("op", nargs="?", help="op name (default: all)")
    p.add_argument("--variant", action="append", help="variant (repeatable; default: all)")
    p.add_argument("--dtype", action="append", help="fp32, fp16, bf16 (repeatable; default: all)")
    p.add_argument("--seeds", type=int, default=2, help="fresh random inputs per case (default 2)")

    def timing_flags(p):
        p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16 or bf16")
        p.add_argument("--budget", type=float, default=2.0, help="seconds per comparison (default 2)")
        p.add_argument("--no-flush", action="store_true", help="keep the L2 warm between samples")

    p = verb("bench", "time an op's variants, interleaved, with speed-ups and CIs", cmd_bench, db=True)
    p.add_argument("op")
    p.add_argument("--variant", action="append", help="variant (repeatable; default: all that run here)")
    p.add_argument("--shape", help="e.g. 4096x4096 (default: the op's benchmark shape)")
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    timing_flags(p)

    p = verb("profile", "where the time goes: kernels, launches, busy time, diagnosis", cmd_profile,
             db=True)  # fmt: skip
    p.add_argument("op")
    p.add_argument("--variant", required=True)
    p.add_argument("--shape")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--calls", type=int, default=3, help="calls inside the profile (default 3)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--trace", help="write a Chrome/Perfetto trace here")
    p.add_argument("--memory-snapshot", help="write a CUDA memory snapshot (pytorch.org/memory_viz)")
    p.add_argument("--nsys", action="store_true", help="run under Nsight Systems (needs nsys)")

    p = verb("asm", "PTX/SASS, registers, shared memory, spills, occupancy", cmd_asm)
    p.add_argument("op")
    p.add_argument("--variant", required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--arch", default="sm_90", help="target GPU (default sm_90: H100/H200)")
    p.add_argument("--show", choices=["ptx", "sass"], help="also print the PTX or SASS")

    p = verb("sweep", "time against size, with a fit of floor + c*size^k", cmd_sweep, db=True)
    p.add_argument("op")
    p.add_argument("--shapes", nargs="+", required=True, help="e.g. 1024x1024 2048x2048 4096x4096")
    p.add_argument("--variant", action="append")
    p.add_argument("--plot", help="write a log-log plot (PNG)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per point (default 1)")
    p.add_argument("--distributed", action="store_true", help="shard the points across --nproc ranks")
    p.add_argument("--nproc", type=int, help="ranks for --distributed (one GPU each)")

    p = verb("report", "tables and plots from stored results", cmd_report, db=True)
    p.add_argument("--html", metavar="DIR", help="write a static HTML report into DIR")
    p.add_argument("--csv", metavar="FILE", help="export the rows as CSV")
    p.add_argument("--export-json", metavar="FILE", help="export the rows as JSON")
    p.add_argument("--run", help="only this run (an id, a prefix, or 'latest')")

    p = verb("compare", "what got faster or slower between two runs, and whether it is noise",
             cmd_compare, db=True)  # fmt: skip
    p.add_argument("run_a", help="run id (or 'previous')")
    p.add_argument("run_b", help="run id (or 'latest')")
    p.add_argument("--fail-above", metavar="PCT", help="exit 1 on a significant slowdown beyond PCT")

    p = verb("comm", "collective bandwidth over torch.distributed (NCCL / gloo)", cmd_comm, db=True)
    p.add_argument("--nproc", type=int, help="spawn this many ranks (else run under torchrun)")
    p.add_argument("--collective", action="append", help="repeatable; default: all five")
    p.add_argument("--sizes", nargs="+", help="bytes per rank (default 1 KB .. 1 GB, 16 MB on a CPU)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective fails")

    p = verb("demo", "the whole loop on GELU, start to finish", cmd_demo, db=True)
    p.add_argument("--out", help="folder for the HTML report (default: next to the database)")
    p.add_argument("--budget", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--no-flush", action="store_true", help=argparse.SUPPRESS)

    p = verb("experiment", "the lecture's scaling experiments and pitfalls", cmd_experiment, db=True)
    p.add_argument("name", nargs="?", help="experiment name (omit to list them)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller points")
    p.add_argument("--out", help="folder for plots (default: the current folder)")
    p.add_argument("--context", type=int, default=256, help="lm-step: context length (default 256)")
    p.add_argument("--memory-snapshot", help="lm-step: write a CUDA memory snapshot of one step")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)  # unknown verbs/flags: usage + the choices, exit 2
    for name in ("calls", "top", "seeds"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            ap.error(f"--{name}: must be >= 1")
    if getattr(args, "budget", 1.0) <= 0:
        ap.error("--budget: must be > 0 seconds")
    _prepare_triton()
    try:
        return args.fn(args)
    except UsageError as exc:
        print(f"perfloop {args.verb}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted: results already stored are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
