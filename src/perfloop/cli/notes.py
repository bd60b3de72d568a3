"""The warnings raised during a command, said once each at its end as notes labelled with
whoever raised them: the script's (`note (the script's UserWarning, train.py:12): ...`), a
library's (`note (torch FutureWarning): ...`), or perfloop's own."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

PERFLOOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
WARNINGS = os.path.abspath(warnings.__file__)


@contextlib.contextmanager
def recording(script: str | None = None):
    """Within: the warnings raised, as (WarningMessage, origin) in the list yielded; `script`:
    the script run (`profile --script`), whose folder's files are the script's."""
    folder = None
    if script:
        folder = os.path.abspath(
            script if os.path.isdir(script) else os.path.dirname(os.path.abspath(script))
        )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")

        def showwarning(message, category, filename, lineno, file=None, line=None):
            w = warnings.WarningMessage(message, category, filename, lineno, file, line)
            seen.append((w, _origin(w, _raiser(sys._getframe(1)), folder)))

        warnings.showwarning = showwarning  # catch_warnings puts the one before back
        yield seen


def _raiser(frame) -> str:
    """The file of the code that called warnings.warn (not the line it names, which stacklevel
    moves to the caller): for a function marked @deprecated (typing_extensions', warnings'), the
    deprecated function's own file."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and (
            code.co_filename == WARNINGS or "typing_extensions" in code.co_filename
        ):
            marked = getattr(frame.f_locals.get("arg"), "__code__", None)
            if marked is not None:
                return marked.co_filename
        if os.path.abspath(code.co_filename) != WARNINGS and "typing_extensions" not in code.co_filename:
            return code.co_filename
        frame = frame.f_back
    return ""


def _package(path: str) -> str | None:
    if "site-packages" + os.sep in path:
        return path.split("site-packages" + os.sep)[-1].split(os.sep)[0].removesuffix(".py")
    return "perfloop" if os.path.abspath(path).startswith(PERFLOOP) else None


def _the_scripts(path: str, folder: str | None) -> str | None:
    """`path` relative to the script's folder, where it is one of the script's files."""
    path = os.path.abspath(path)
    if folder is None or _package(path) or not path.startswith(folder + os.sep):
        return None
    return os.path.relpath(path, folder)


def _origin(w, raiser: str, folder: str | None) -> str:
    """`the script's UserWarning, train.py:12`, `torch FutureWarning`, `perfloop RuntimeWarning`:
    whose code raised it (else whose line it names), and the script's line it names."""
    where = _the_scripts(w.filename, folder)
    mine = _the_scripts(raiser, folder) is not None or (not _package(raiser) and where is not None)
    who = "the script's" if mine else _package(raiser) or _package(w.filename) or "python"
    return f"{who} {w.category.__name__}" + (f", {where}:{w.lineno}" if where else "")


def say(seen: list) -> None:
    """Each warning once, as a note on stderr; a library's own deprecation notices (torch's about
    its internals, Triton's), which the user cannot act on, only with PERFLOOP_VERBOSE=1."""
    said = set()
    verbose = os.environ.get("PERFLOOP_VERBOSE", "") not in ("", "0")
    for item in seen:  # a bare WarningMessage where the script put showwarning back itself
        w, origin = item if isinstance(item, tuple) else (item, _origin(item, "", None))
        text = str(w.message).strip().splitlines()[0]
        if text in said:
            continue
        said.add(text)
        internal = _package(w.filename) in ("torch", "triton") and issubclass(
            w.category, (DeprecationWarning, FutureWarning)
        )
        if internal and not verbose:
            continue
        print(f"note ({origin}): {text}", file=sys.stderr)
