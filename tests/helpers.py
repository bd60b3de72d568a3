"""Helpers shared by the tests."""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parent / "build" / "test-artifacts"
# a test file's head for the pytest plugin's tests: work that takes `ms` of a busy core
BUSY = """
import time

def busy(ms):
    def f():
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass
    return f
"""
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def others_busy_cores(seconds: float = 0.5) -> float:
    """How many cores other processes keep busy (this one sleeps meanwhile), from /proc/stat;
    0.0 where there is no /proc."""

    def busy_jiffies():
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, *rest = (int(v) for v in f.readline().split()[1:])
        return user + nice + system + sum(rest[:3]), user + nice + system + idle + iowait + sum(rest[:3])

    try:
        b0, t0 = busy_jiffies()
        time.sleep(seconds)
        b1, t1 = busy_jiffies()
    except OSError:
        return 0.0
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


@contextlib.contextmanager
def one_core_loaded():
    """A context in which another process keeps one core busy: its own spinning process, unless
    one already does (a loaded run of the suite), so the load is one core either way."""
    spin = [sys.executable, "-c", "while True: pass"]
    hog = None if others_busy_cores() >= 0.7 else subprocess.Popen(spin)
    try:
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """torch.backends.cuda.matmul.allow_tf32 set to `on` inside, as it was after."""
    import torch

    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def busy(ms: float):
    """A function that spins for `ms` milliseconds: a workload of known cost."""

    def f():
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    return f


def chromium() -> str:
    """Headless Chromium's path; a skip where it is missing (a failure on CI, where `make test`
    installs it)."""
    import pytest

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: `make test` should have installed it")
        pytest.skip("chromium not installed (make test installs Debian's package)")
    return exe


def open_in_chromium(
    page: Path, profile: Path, shot: Path | None = None, width: int = 1200
) -> dict[str, int]:
    """The data-* numbers the page's load handler set on <body>, as real Chromium rendered it in
    a window `width` pixels wide; with `shot`, a screenshot of it too."""
    exe = chromium()
    args = [f"--user-data-dir={profile / 'u1'}", "--virtual-time-budget=5000", f"--window-size={width},1800"]
    args += ["--dump-dom", page.as_uri()]
    dom = subprocess.run([exe, *CHROMIUM_FLAGS, *args], capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    if shot is not None:
        shot.parent.mkdir(parents=True, exist_ok=True)
        args = [f"--user-data-dir={profile / 'u2'}", f"--screenshot={shot}", f"--window-size={width},1800"]
        subprocess.run([exe, *CHROMIUM_FLAGS, *args, page.as_uri()], capture_output=True, timeout=120)
    return {k: int(v) for k, v in re.findall(r'(data-[\w-]+)="(\d+)"', body[1])}


_SM90_PTX = """
import importlib, json, sys
from perfloop.analysis.asm import compile_spec

module, name, spec = json.loads(sys.stdin.read())
spec["kernel"] = getattr(importlib.import_module(module), name)
print(json.dumps(compile_spec(spec).asm["ptx"]))
"""


def sm90_ptx(kernel, args: tuple, meta: dict) -> str:
    """The PTX Triton makes of `kernel` for an H100/H200 (sm_90) when launched with these
    arguments: specialized as a launch would (a 16-byte aligned pointer and an integer divisible
    by 16 marked so, an integer equal to 1 made a constant). Any machine compiles it; in a
    process of its own, out of the interpreter."""
    import json

    import torch

    from perfloop.analysis.asm import TRITON_TYPES

    types = {**TRITON_TYPES, torch.int64: "i64", torch.int32: "i32"}
    fn = getattr(kernel, "fn", kernel)
    names = list(kernel.arg_names)
    spec = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    constexprs = {k: v for k, v in meta.items() if k not in spec}
    signature, aligned = {}, []
    for i, (name, value) in enumerate(zip(names, args, strict=False)):
        if hasattr(value, "data_ptr"):
            signature[name] = "*" + types[value.dtype]
            aligned += [i] if value.data_ptr() % 16 == 0 else []
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            aligned += [i] if value % 16 == 0 else []
    signature.update({k: "constexpr" for k in constexprs})
    spec.update(signature=signature, constexprs=constexprs, aligned=aligned)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps([fn.__module__, fn.__name__, spec])
    proc = subprocess.run(
        [sys.executable, "-c", _SM90_PTX], input=job, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def example(name: str):
    """examples/NAME.py imported as the module NAME (a patched model pickles by reference)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_script(tmp_path, text, name="s.py"):
    """A script for script mode's tests, dedented, in tmp_path."""
    import textwrap

    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def assert_no_profiling_left():
    """What script mode leaves after a script: no profiler on, no range watcher."""
    import torch

    from perfloop.analysis import annotate

    assert not torch.autograd.profiler._is_profiler_enabled
    assert annotate.RANGE_WATCHERS == []
