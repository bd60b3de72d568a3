"""`perfloop history [KEY]`: each benchmark's median over the stored runs, commit by commit, and
the steps in it (change points) with their size, confidence and commit range."""

from __future__ import annotations

from perfloop.cli.args import UsageError, open_store
from perfloop.cli.output import console, emit_json


def register(verb) -> None:
    p = verb("history", "a benchmark's trend over the stored runs, and where it stepped", run, db=True)
    p.add_argument(
        "key",
        nargs="?",
        default="",
        help="part of a key, op/variant/shape/dtype/device (e.g. gelu/triton); none: every key",
    )
    p.add_argument("--last", type=int, default=12, help="runs shown per key in the terminal (default 12)")


def run(args) -> int:
    from perfloop.results.history import bisect_command, key_text, trends

    if args.last < 1:
        raise UsageError(f"--last: must be >= 1, got {args.last}")
    store = open_store(args, writing=False)
    found = trends(store, args.key, repo=".")
    if not found:
        raise UsageError(f"key: no stored benchmark matches {args.key!r}{_closest(trends(store), args.key)}")
    if args.json:
        emit_json({"trends": [t.to_dict() for t in found], "skipped": store.skipped})
        return 0
    out = console()
    for note in store.skipped:
        out.print(f"skipped: {note}", style="yellow", markup=False)
    for t in found:
        quiet = len(t.points) - len(t.left_out)
        out.print(f"{key_text(t.key)}: {len(t.points)} run(s), {quiet} fitted", style="bold", markup=False)
        shown = range(max(0, len(t.points) - args.last), len(t.points))
        for i in shown:
            p = t.points[i]
            lo, hi = p.ci_ms
            why = "  left out: contended" if i in t.left_out else ("  contended" if p.contended else "")
            out.print(
                f"  {p.created[:19]}  {p.commit or '(no commit)':<18} {p.median_ms:10.4f} ms  "
                f"[{lo:.4f}, {hi:.4f}]{why}",
                markup=False,
                highlight=False,
            )
        for c in t.changes:
            out.print(f"  step: {c}", style="red" if c.ratio > 1 else "green", markup=False)
        line = bisect_command(t)
        if line:
            out.print(f"  name the commit: {line} (what times it)", markup=False, highlight=False)
        if not t.changes and quiet >= 6:
            out.print("  no step: every fitted run within the line's noise", markup=False)
        for n in t.notes:
            out.print(f"  {n}", style="yellow", markup=False)
    return 0


def _closest(found, typed: str) -> str:
    """The stored keys closest to a key that matched none (difflib), or that the store is empty."""
    import difflib

    from perfloop.results.history import key_text

    keys = sorted({key_text(t.key) for t in found})
    if not keys:
        return " (the store is empty)"
    near = difflib.get_close_matches(typed, keys, n=5, cutoff=0.4)
    near += [k for k in keys if typed.lower() in k.lower() and k not in near]
    if near:
        return f"; did you mean: {', '.join(near[:5])}"
    return f"; {len(keys)} stored key(s), e.g. {', '.join(keys[:5])}"
