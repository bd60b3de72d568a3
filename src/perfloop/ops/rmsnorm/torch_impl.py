"""RMSNorm written with PyTorch: naive, builtin (F.rms_norm), compiled."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(x, weight, eps: float = 1e-6):
    xf = x.float()  # in fp32, as composite norms are written
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def naive(x, weight, eps: float = 1e-6):
    return _naive(x, weight, eps)


def builtin(x, weight, eps: float = 1e-6):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


_compiled = compile_variant(_naive)


def compiled(x, weight, eps: float = 1e-6):
    return _compiled(x, weight, eps)
