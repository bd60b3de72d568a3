"""Script mode on compiled code: Dynamo's compile-start callback (which steps compiled), torch's
warning about perfloop's own global hooks kept quiet, and what the report says of compiling steps."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def compile_callbacks(on_start):
    """Dynamo's compile-start callback, where this torch has one."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        callback_handler = None
    if not hasattr(callback_handler, "remove_start_callback"):  # torch versions without it: no callbacks
        yield
        return
    callback_handler.register_start_callback(on_start)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(on_start)


def say_compiled(w) -> None:
    """The warnings that say which of the window's occurrences compiled, and what was done."""
    if not w.range_name or not w.compiled:
        return
    more = w.first_timed - (w.skip + 1)
    if w.retaken:
        dropped = ", ".join(map(str, w.retaken))
        w.warnings.append(
            f"occurrence(s) {dropped} of {w.range_name!r} compiled while profiled: dropped, "
            "and the window opened again past them"
        )
    if more > 0:
        w.warnings.append(
            f"skipped {more} more occurrence(s) of {w.range_name!r} than --skip {w.skip}: "
            "the one before each compiled (Dynamo); the profiled ones start at the first after "
            "a step that compiled nothing"
        )
    timed = [n for n in w.compiled if w.first_timed <= n < w.first_timed + w.steps]
    if timed:
        w.warnings.append(
            f"profiled occurrence(s) {', '.join(map(str, timed))} of {w.range_name!r} compiled "
            "(Dynamo, Inductor): the compile time is in their wall time, ranked as its own "
            "finding"
        )
