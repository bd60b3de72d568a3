"""SwiGLU written with PyTorch: naive (sigmoid, mul, mul), builtin (F.silu then mul),
compiled (torch.compile of the naive one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(a, b):
    return a * torch.sigmoid(a) * b


def naive(a, b):
    return _naive(a, b)


def builtin(a, b):
    return F.silu(a) * b


_compiled = compile_variant(_naive)


def compiled(a, b):
    return _compiled(a, b)
