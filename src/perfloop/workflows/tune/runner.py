"""Running the child process (workflows.tune.child) and reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_child(spec: dict, timeout_s: float, log_dir: str) -> dict:
    """Run one child with `spec` (its `out` is set here), at most `timeout_s`; its output (the
    script's prints) goes to a log in `log_dir`. Always a dict with "ok" and "error"."""
    fd, out = tempfile.mkstemp(suffix=".json", dir=log_dir)
    os.close(fd)
    spec = {**spec, "out": out}
    spec_path = out[: -len(".json")] + ".spec.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    log_path = out[: -len(".json")] + ".log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "perfloop.workflows.tune.child", spec_path],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=timeout_s,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return {
                "ok": False,
                "error": f"stopped after {timeout_s:.0f} s (the budget left)",
                "log": log_path,
            }
    try:
        with open(out) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {
            "ok": False,
            "error": f"the run ended (exit {rc}) without a result; its output: {_tail(log_path)}",
        }
    result["log"] = log_path
    return result


def _tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return "(none)"
