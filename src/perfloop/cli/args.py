"""Reading the command line: shapes, dtypes, ops, variants, the store; and turning the
library's errors (which name its arguments) into the flags a user typed."""

from __future__ import annotations

import sys
from contextlib import contextmanager

USAGE_ERROR = 2
FAILED = 1
CANNOT_JUDGE = 3  # under --strict: a comparison the gate could not judge


class UsageError(Exception):
    """Bad input from the command line; printed without a traceback, exit 2."""


def as_flag(exc: Exception, flag: str, arg: str | None = None) -> UsageError:
    """A library error ("dtype: unknown ...") in the flag's words ("--dtype: unknown ...")."""
    from perfloop.errors import ArgumentError

    if isinstance(exc, ArgumentError):
        return UsageError(f"{flag}: {exc.detail}")
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    arg = arg or flag.lstrip("-").replace("-", "_")
    if text.startswith(f"{arg}:"):
        text = text[len(arg) + 1 :].lstrip()
    return UsageError(f"{flag}: {text}")


def parse_shape(text: str, flag: str = "--shape") -> tuple[int, ...]:
    """'4096x4096' -> (4096, 4096); every part a positive integer ('12xx3' is refused)."""
    parts = text.strip().lower().replace(",", "x").split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"{flag}: cannot read {text!r}; write positive sizes joined by x, e.g. 4096x4096")
    return tuple(int(p) for p in parts)


@contextmanager
def shape_errors(flag: str = "--shape"):
    """The library's "shape: ..." errors (a rank the op does not take, too large for memory) as
    usage errors naming `flag`; other errors pass on."""
    from perfloop.errors import ArgumentError

    try:
        yield
    except ArgumentError as exc:
        if exc.argument == "shape":
            raise as_flag(exc, flag) from None
        raise


def parse_dtype(text: str):
    from perfloop.ops.base import parse_dtype

    try:
        return parse_dtype(text)
    except ValueError as exc:
        raise as_flag(exc, "--dtype") from None


def parse_percent(text: str) -> float:
    try:
        v = float(text.rstrip("%"))
    except ValueError:
        raise UsageError(f"--fail-above: {text!r} is not a percentage; e.g. --fail-above 5%") from None
    if v < 0:
        raise UsageError(f"--fail-above: must be >= 0, got {text}")
    return v


def get_op(name: str):
    from perfloop import ops

    try:
        return ops.get(name)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def get_variants(op, names: list[str] | None, timing: bool, dtype=None) -> list[str]:
    """The variants asked for (or all that can run here, in `dtype` where given); says which it
    skips and why. A dtype none of them takes is a usage error naming --dtype."""
    from perfloop.cli.output import warn
    from perfloop.ops.base import dtype_name
    from perfloop.workflows.ops import runnable_variants

    try:
        chosen, skipped = runnable_variants(op, names, timing)
    except ValueError as exc:
        raise as_flag(exc, "--variant", "variants") from None
    if dtype is not None:
        takes = {n for n in op.variants if dtype in op.variant(n).dtypes}
        if not takes:
            known = sorted({dtype_name(d) for n in op.variants for d in op.variant(n).dtypes})
            raise UsageError(
                f"--dtype: no variant of {op.name} takes {dtype_name(dtype)}; use one of {', '.join(known)}"
            )
        skipped |= {n: f"does not take {dtype_name(dtype)}" for n in chosen if n not in takes}
        chosen = [n for n in chosen if n in takes]
    for n, why in skipped.items():
        if names or "interpreter" in why:
            warn(f"skip {'timing ' if timing and 'interpreter' in why else ''}{op.name}/{n}: {why}")
    return chosen


def open_store(args, writing: bool = True):
    """The results store named by --db; for a command that will write, checked writable
    before anything is measured."""
    from pathlib import Path

    from perfloop.results.store import IN_MEMORY, Store, StoreError, default_path

    path = Path(args.db) if args.db else default_path()
    if not writing and str(path) != IN_MEMORY and not path.exists():
        raise UsageError(
            f"--db: {path} does not exist: nothing is stored there yet (bench, sweep, demo, "
            "profile and pytest --perfloop-db write it); check the path"
        )
    try:
        store = Store(args.db)
        if writing:
            store.check_writable()
            if store.path == IN_MEMORY:
                from perfloop.cli.output import warn

                warn("--db :memory:: SQLite's database in memory; nothing is kept after this command")
        return store
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def start_run(store) -> str:
    from perfloop.workflows.runs import start_run

    return start_run(store, " ".join(sys.argv))
