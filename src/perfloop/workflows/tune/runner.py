"""Running the child process (workflows.tune.child) and reading what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from perfloop.workflows.tune import scratch

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


CUT = "cut by the budget after {s:.0f} s (the time that was left)"  # not the script's failure


def run_child(spec: dict, timeout_s: float, log_dir: str) -> dict:
    """Run one child with `spec` (its `out` is set here), at most `timeout_s`; its output (the
    script's prints) goes to a log in `log_dir`. Always a dict with "ok" and "error"."""
    fd, out = tempfile.mkstemp(suffix=".json", dir=log_dir)
    os.close(fd)
    roots, skip = [os.path.dirname(os.path.abspath(spec["script"])), os.getcwd()], [log_dir]
    backup = out[: -len(".json")] + ".kept"
    os.mkdir(backup)
    spec = {
        **spec,
        "out": out,
        "keep": {"roots": roots, "skip": skip, "backup": backup, "manifest": backup + ".jsonl"},
    }
    before, capped = scratch.snapshot(scratch.checked(roots), skip)
    spec_path = out[: -len(".json")] + ".spec.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    log_path = out[: -len(".json")] + ".log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "w") as log:
        rc = _run_grouped(
            [sys.executable, "-m", "perfloop.workflows.tune.child", spec_path], log, env, timeout_s
        )
    _put_back(spec["keep"], before, capped)
    if rc is None:
        return {"ok": False, "error": CUT.format(s=timeout_s), "cut": True, "log": log_path}
    try:
        with open(out) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {
            "ok": False,
            "error": f"the run ended (exit {rc}) without a result; its output: {_tail(log_path)}",
        }
    result["log"] = log_path
    if not result.get("ok") and result.get("error"):
        result["error"] = _told(result["error"], log_path)
    return result


def _told(error: str, log_path: str) -> str:
    """A failed run's error with where its output is kept, and for an exit (argparse's, the
    script's sys.exit) the last line it printed: what it said."""
    said = _tail(log_path, 1) if "exited with" in error else ""
    said = f': "{said}"' if said and said != "(none)" else ""
    return f"{error}{said}; its output is in {log_path}"


def _put_back(kept: dict, before: dict, capped: bool) -> None:
    """What the run's processes wrote under the script's folder and the working directory put
    back (scratch), once they have all ended; what changed past the hooks said on stderr."""
    scratch.restore(kept["manifest"])
    shutil.rmtree(kept["backup"], ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(kept["manifest"])
    ours = {_inode(fd) for fd in (1, 2)}  # perfloop's own output, redirected into the folder
    after, _ = scratch.snapshot(scratch.checked(kept["roots"]), kept["skip"])
    lost = [p for p in scratch.changed(before, after) if _inode(p.rsplit(" (", 1)[0]) not in ours]
    if lost:
        print(
            "tune: the script's run changed files that tune could not put back (written past "
            f"Python's open and torch.save: C code, a subprocess): {', '.join(lost)}",
            file=sys.stderr,
        )
    if capped:
        print(
            f"tune: over {scratch.LIMIT} files under {' and '.join(kept['roots'])}: the first "
            f"{scratch.LIMIT} were checked for changes past the hooks",
            file=sys.stderr,
        )


def _inode(what) -> tuple[int, int] | None:
    try:
        st = os.fstat(what) if isinstance(what, int) else os.stat(what)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


GRACE_S = 3.0  # what a SIGTERM'd process (a script's handler saving its state) gets before SIGKILL


def _run_grouped(cmd: list[str], log, env: dict, timeout_s: float) -> int | None:
    """Run cmd in a process group of its own, at most `timeout_s` (None where it was cut), and end
    the whole group whichever way it ended: the script's subprocesses and DataLoader workers do
    not outlive its run. A Ctrl-C reaches perfloop only, which ends the run here."""
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        _end_group(proc.pid)
        proc.wait()


def _end_group(pgid: int) -> None:
    """SIGTERM to every process of the group, SIGKILL to those left after GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + GRACE_S
        while _alive_in(pgid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        else:
            return


def _alive_in(pgid: int) -> bool:
    """Whether a process of the group runs (a zombie does not: an init that never reaps keeps
    zombies in the group, and killpg(pgid, 0) still finds them)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return "(none)"
