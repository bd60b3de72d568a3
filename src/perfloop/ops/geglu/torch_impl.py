"""GeGLU written with PyTorch: naive (the tanh formula op by op), builtin (F.gelu then mul),
compiled (torch.compile of the naive one)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(a, b):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) * b


def naive(a, b):
    return _naive(a, b)


def builtin(a, b):
    return F.gelu(a, approximate="tanh") * b


_compiled = compile_variant(_naive)


def compiled(a, b):
    return _compiled(a, b)
