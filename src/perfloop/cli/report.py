"""`perfloop report`: stored results as a table, an HTML page with plots, CSV or JSON."""

from __future__ import annotations

from pathlib import Path

from perfloop.cli.args import UsageError, open_store
from perfloop.cli.output import console, emit_json, table


def register(verb) -> None:
    p = verb("report", "tables and plots from stored results", run, db=True)
    p.add_argument("--html", metavar="DIR", help="write a static HTML report into DIR")
    p.add_argument("--csv", metavar="FILE", help="export the rows as CSV")
    p.add_argument("--export-json", metavar="FILE", help="export the rows as JSON")
    p.add_argument("--run", help="only this run (an id, a prefix, or 'latest')")
    p.add_argument("--force", action="store_true", help="overwrite an existing file that is not an export")


def _check_target(flag: str, path: str, store, force: bool) -> None:
    """Refuse to write an export over the database itself, or over a file that is not an
    export of ours (unless --force): either would destroy data."""
    from perfloop.results.store import IN_MEMORY, is_our_export

    target = Path(path)
    if store.path != IN_MEMORY and target.exists() and target.resolve() == Path(store.path).resolve():
        raise UsageError(
            f"{flag} {path}: that is the database itself; writing there would destroy it. "
            "Choose another file, e.g. results.csv"
        )
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file path")
    if target.exists() and target.stat().st_size and not is_our_export(target) and not force:
        raise UsageError(
            f"{flag} {path}: exists and is not a perfloop export; it was left as it is. "
            "Choose another file, or add --force to replace it"
        )


def _write(flag: str, path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write ({exc})") from None


def _profile_table(profiles: list[dict]) -> None:
    from perfloop.harness.measurement import fmt_ms

    def top(p: dict, what: str) -> str:
        best = max(p.get(what) or [], key=lambda r: r.get("device_ms", 0.0), default=None)
        return f"{best['name'][:40]} ({fmt_ms(best['device_ms'] / (p.get('calls') or 1))})" if best else ""

    table(
        "stored profiles",
        ["run", "source", "window", "calls", "wall/call", "device/call", "top op", "top module"],
        [
            [
                a["run_id"],
                a["op"] or "",
                a["variant"] or "",
                a["payload"].get("calls", ""),
                fmt_ms(a["payload"]["wall_ms_per_call"]) if a["payload"].get("wall_ms_per_call") else "",
                fmt_ms(a["payload"]["device_ms_per_call"]) if a["payload"].get("device_ms_per_call") else "",
                top(a["payload"], "ops"),
                top(a["payload"], "modules"),
            ]
            for a in profiles
        ],
    )


def run(args) -> int:
    from perfloop.harness.measurement import fmt_ms
    from perfloop.results.report import fmt_rate, fmt_speedup, latest_rows, render_html
    from perfloop.results.store import StoreError

    store = open_store(args, writing=False)
    run_id = None
    if args.run:
        try:
            run_id = store.resolve_run(args.run)
        except StoreError as exc:
            raise UsageError(f"--run: {exc}") from None
    for flag, path in (("--csv", args.csv), ("--export-json", args.export_json)):
        if path:
            _check_target(flag, path, store, args.force)
    if args.csv:
        _write("--csv", args.csv, store.export_csv(run_id))
    if args.export_json:
        _write("--export-json", args.export_json, store.export_json(run_id))
    if args.html:
        try:
            page = render_html(store, args.html, run_id)
        except OSError as exc:
            raise UsageError(
                f"--html {args.html}: {str(exc).removeprefix(f'out_dir {args.html}: ')}"
            ) from None
        console().print(f"report: {page}")
    rows = latest_rows(store.rows(run_id))
    profiles = store.artifacts(run_id, kind="profile")
    for why in store.skipped:
        console(True).print(f"skipped a stored row that cannot be read: {why}", style="yellow")
    if args.json:
        emit_json(rows if not profiles else {"measurements": rows, "profiles": profiles})
    elif not (args.html or args.csv or args.export_json):
        if not rows and not profiles:
            console().print(f"no results in {store.path} yet: try `perfloop demo`")
        if profiles:
            _profile_table(profiles)
        if not rows:
            return 0
        table(
            f"results in {store.path}",
            ["op", "variant", "shape", "dtype", "median", "rate", "speed-up", "device"],
            [
                [
                    r["op"],
                    r["variant"] + (" (graph)" if r["graph"] else ""),
                    r["shape"],
                    r["dtype"],
                    fmt_ms(r["median_ms"]),
                    fmt_rate(r),
                    fmt_speedup(r),
                    r["device"] or "",
                ]
                for r in rows
            ],
        )
    return 0
