"""LayerNorm written with PyTorch: naive (mean, var, normalize, scale as separate ops),
builtin (F.layer_norm), compiled (torch.compile of the naive one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(x, weight, bias, eps: float = 1e-5):
    # in fp32, as composite norms are written (in bf16, x - mean alone loses the rows' detail)
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    var = (xc * xc).mean(-1, keepdim=True)
    return (xc * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def naive(x, weight, bias, eps: float = 1e-5):
    return _naive(x, weight, bias, eps)


def builtin(x, weight, bias, eps: float = 1e-5):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


_compiled = compile_variant(_naive)


def compiled(x, weight, bias, eps: float = 1e-5):
    return _compiled(x, weight, bias, eps)
