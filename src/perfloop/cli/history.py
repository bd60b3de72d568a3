"""`perfloop history [KEY]`: each benchmark's median over the stored runs, commit by commit, and
the steps in it (change points) with their size, confidence and commit range."""

from __future__ import annotations

import shlex

from perfloop.cli.args import UsageError, open_store
from perfloop.cli.output import console, emit_json


def register(verb) -> None:
    p = verb("history", "a benchmark's trend over the stored runs, and where it stepped", run, db=True)
    p.add_argument("key", nargs="?", default="", help="part of a key, op/variant/shape/dtype/device "
                   "(e.g. gelu/triton); none: every key")  # fmt: skip
    p.add_argument("--last", type=int, default=12, help="runs shown per key in the terminal (default 12)")


def run(args) -> int:
    from perfloop.results.history import trends

    if args.last < 1:
        raise UsageError(f"--last: must be >= 1, got {args.last}")
    store = open_store(args, writing=False)
    found = trends(store, args.key, repo=".")
    if not found:
        keys = sorted({"/".join(t.key) for t in trends(store)})
        hint = f"; stored keys: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else "") if keys else ""
        raise UsageError(f"key: no stored benchmark matches {args.key!r}{hint or ' (the store is empty)'}")
    if args.json:
        emit_json({"trends": [t.to_dict() for t in found]})
        return 0
    out = console()
    for t in found:
        out.print(f"{'/'.join(t.key)}: {len(t.points)} run(s)", style="bold", markup=False)
        for p in t.points[-args.last :]:
            lo, hi = p.ci_ms
            out.print(f"  {p.created[:19]}  {p.commit or '(no commit)':<18} {p.median_ms:10.4f} ms  "
                      f"[{lo:.4f}, {hi:.4f}]", markup=False, highlight=False)  # fmt: skip
        for c in t.changes:
            out.print(f"  step: {c}", style="red" if c.ratio > 1 else "green", markup=False)
        if t.changes and all(c.before and c.after for c in t.changes):
            key = shlex.quote("/".join(t.key).rstrip("/"))
            out.print(f"  name the commit: perfloop bisect --key {key} -- COMMAND (what times it)",
                      markup=False, highlight=False)  # fmt: skip
        if not t.changes and len(t.points) >= 6:
            out.print("  no step: every run within the line's noise", markup=False)
        for n in t.notes:
            out.print(f"  {n}", style="yellow", markup=False)
    return 0
