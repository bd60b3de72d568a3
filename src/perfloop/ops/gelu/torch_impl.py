"""GELU written with PyTorch: naive (the lecture's formula), builtin, compiled."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _write(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return y if out is None else out.copy_(y)


def _naive(x: torch.Tensor) -> torch.Tensor:
    # Eight ops, eight kernels, eight round trips through memory:
    # pow, mul, add, mul, tanh, add, mul, mul.
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def naive(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(_naive(x), out)


def builtin(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(F.gelu(x, approximate="tanh"), out)


_compiled = compile_variant(_naive)


def compiled(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(_compiled(x), out)
