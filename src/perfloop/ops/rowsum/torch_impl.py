"""Row sum with PyTorch: builtin and compiled."""

from __future__ import annotations

import torch

from perfloop.ops.base import compile_variant


def _rowsum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=-1)


def builtin(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    y = _rowsum(x)
    return y if out is None else out.copy_(y)


_compiled = compile_variant(_rowsum)


def compiled(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    y = _compiled(x)
    return y if out is None else out.copy_(y)
