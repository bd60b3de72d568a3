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
