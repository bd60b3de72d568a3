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
