"""Fused drop-in modules, and `patch`, which puts them into a model only where they are proven
equal on it (a layer beside workflows: it uses the op library's kernels and the harness)."""

from perfloop.nn.modules import (
    GELU,
    CrossEntropyLoss,
    GeGLU,
    LayerNorm,
    LinearCrossEntropy,
    RMSNorm,
    RoPE,
    SwiGLU,
    fused_like,
)
from perfloop.nn.patch import PatchReport, patch

__all__ = [
    "GELU",
    "CrossEntropyLoss",
    "GeGLU",
    "LayerNorm",
    "LinearCrossEntropy",
    "PatchReport",
    "RMSNorm",
    "RoPE",
    "SwiGLU",
    "fused_like",
    "patch",
]
