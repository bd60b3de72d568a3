"""Matmul + ReLU with PyTorch: naive (two kernels) and compiled."""

from __future__ import annotations

import torch

from perfloop.ops.base import compile_variant


def _naive(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ b)


def naive(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return _naive(a, b)
    return torch.relu_(torch.matmul(a, b, out=out))


_compiled = compile_variant(_naive)


def compiled(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    y = _compiled(a, b)
    return y if out is None else out.copy_(y)
