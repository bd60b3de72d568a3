"""The fixes perfloop tune tries, one module each, listed once here. A new fix is one file and
one line below; `--try module:NAME` loads one from outside perfloop (a Candidate object)."""

from __future__ import annotations

import importlib
import os
import sys

from perfloop.workflows.tune.candidates.autocast import AUTOCAST_BF16
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.candidates.compile import COMPILE, COMPILE_CUDA_GRAPHS, COMPILE_MAX_AUTOTUNE
from perfloop.workflows.tune.candidates.conv import CHANNELS_LAST, CUDNN_BENCHMARK
from perfloop.workflows.tune.candidates.fused_optimizer import FUSED_OPTIMIZER
from perfloop.workflows.tune.candidates.patch import PATCH
from perfloop.workflows.tune.candidates.pinned import PINNED_MEMORY
from perfloop.workflows.tune.candidates.sdpa import SDPA_NO_CUDNN
from perfloop.workflows.tune.candidates.tf32 import TF32
from perfloop.workflows.tune.candidates.weights import BF16_WEIGHTS

CANDIDATES: list[Candidate] = [
    TF32,
    FUSED_OPTIMIZER,
    PATCH,
    CHANNELS_LAST,
    CUDNN_BENCHMARK,
    PINNED_MEMORY,
    SDPA_NO_CUDNN,
    COMPILE,
    COMPILE_CUDA_GRAPHS,
    COMPILE_MAX_AUTOTUNE,
    AUTOCAST_BF16,
    BF16_WEIGHTS,
]

__all__ = ["CANDIDATES", "Candidate", "Numerics", "get"]


def get(name: str) -> Candidate:
    """The candidate called `name`, or one named by its import path ("package.module:NAME")."""
    if ":" in name:
        module, _, attr = name.partition(":")
        if os.getcwd() not in sys.path:  # found as `python -m` finds a module: from here too
            sys.path.append(os.getcwd())
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--try {name}: cannot load it ({exc}); give package.module:NAME") from None
        except Exception as exc:  # the module's own code failed on import: its error, named
            raise ValueError(f"--try {name}: cannot load it ({type(exc).__name__}: {exc})") from None
        if not isinstance(found, Candidate):
            raise ValueError(f"--try {name}: {type(found).__name__} is not a perfloop tune Candidate")
        return found
    for c in CANDIDATES:
        if c.name == name:
            return c
    known = ", ".join(c.name for c in CANDIDATES)
    raise ValueError(f"--try {name}: no such candidate; known: {known} (or package.module:NAME)")
