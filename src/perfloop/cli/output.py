"""How the CLI prints: rich tables and progress on a terminal, plain JSON for programs."""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped into a file or a log, rich would wrap tables at 80 columns: give them room.
    width = None if stream.isatty() else 160
    # markup=False: kernel names like "elementwise[tanh]" must print as they are
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width, markup=False)


def warn(text: str) -> None:
    console(True).print(text, style="yellow")


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
    """obj as strict JSON: a figure that is not finite (NaN, inf) is null, never a bare NaN."""
    print(json.dumps(_finite(obj), indent=1, default=str, allow_nan=False))


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def num(v) -> str:
    """A rate with sensible digits: 4239, 52.1, 0.0123."""
    if not v:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def print_bench_rows(rows) -> None:
    """A comparison's rows (workflows.BenchRow) as one table, then their warnings."""
    from perfloop.harness.measurement import OVER_CEILING, fmt_ms

    headers = ["variant", "dtype", "median", "95% CI", "GB/s", "TFLOP/s", "% SOL", "speed-up"]
    has_graph = any(r.graph_median_ms is not None for r in rows)
    if has_graph:
        headers += ["graph replay", "its kernels"]
    out = []
    for r in rows:
        sig = "" if r.significant in (None, True) else " (n.s.)"
        line = [
            r.variant,
            r.dtype,
            fmt_ms(r.median_ms),
            f"{fmt_ms(r.ci95_ms[0])}..{fmt_ms(r.ci95_ms[1])}",
            num(r.gbps),
            num(r.tflops),
            "-" if r.sol is None else f"{100 * r.sol:.0f}%" + ("?" if r.sol > OVER_CEILING else ""),
            f"{r.speedup:.2f}x [{r.speedup_ci[0]:.2f}, {r.speedup_ci[1]:.2f}]{sig}",
        ]
        if has_graph:
            line.append(fmt_ms(r.graph_median_ms) if r.graph_median_ms is not None else "-")
            line.append(fmt_ms(r.graph_kernel_ms) if r.graph_kernel_ms else "-")
        out.append(line)
    shape_s = "x".join(map(str, rows[0].shape))
    table(f"{rows[0].op} {shape_s} {rows[0].dtype} (speed-up vs {rows[0].baseline})", headers, out)
    for r in rows:
        for w in r.warnings:
            console().print(f"{r.variant}: {w}", style="yellow")
