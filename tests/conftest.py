"""Test set-up: Triton through its interpreter when there is no GPU; caches in tmp."""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # Before any Triton kernel module loads: kernels then run on the CPU, interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PERFLOOP_CACHE", tempfile.mkdtemp(prefix="perfloop-cache-"))
os.environ.setdefault("PERFLOOP_DB", os.path.join(tempfile.mkdtemp(prefix="perfloop-db-"), "t.db"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make gpu-check` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["pytester"]

# The C++ extensions tests/ops/test_native.py builds: a compiler parsing torch's headers, about
# 35 s a build on one core, while the suite leaves the second core mostly idle. Started as soon
# as the run is known to include those tests, in one low-priority process, into the same cache
# the tests build into; torch's build lock makes a test that gets there first wait for it, and
# a build that fails here fails again, with its message, in the test.
_NATIVE_OPS = ("layernorm", "swiglu", "attention", "cross_entropy")
_BUILD = """
import sys
from perfloop.ops import native
for op in sys.argv[1:]:
    try:
        native.build(op)
    except Exception:
        pass
"""
_builds = []


def pytest_collection_finish(session):
    import importlib.util
    import shutil
    import subprocess
    import sys

    if not any(item.path.name == "test_native.py" for item in session.items):
        return
    if importlib.util.find_spec("triton") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        return
    cmd = [sys.executable, "-c", _BUILD, *_NATIVE_OPS]
    out = subprocess.DEVNULL
    _builds.append(subprocess.Popen(cmd, stdout=out, stderr=out, preexec_fn=lambda: os.nice(10)))


def pytest_sessionfinish(session):
    for proc in _builds:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def train_gpt():
    """examples/train_gpt.py as a module: the GPT-2-style model, its training step, its FLOPs."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_gpt", mod)
    spec.loader.exec_module(mod)
    return mod
