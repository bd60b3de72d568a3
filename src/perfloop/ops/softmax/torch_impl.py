"""Softmax with PyTorch: naive (five ops), builtin, compiled."""

from __future__ import annotations

import torch

from perfloop.ops.base import compile_variant


def _write(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return y if out is None else out.copy_(y)


def _naive(x: torch.Tensor) -> torch.Tensor:
    # reads x: max, sub; writes z; exp reads z writes e; sum reads e; div reads e, writes y
    m = x.max(dim=-1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def naive(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(_naive(x), out)


def builtin(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(torch.softmax(x, dim=-1), out)


_compiled = compile_variant(_naive)


def compiled(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _write(_compiled(x), out)
