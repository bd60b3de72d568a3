"""RoPE written with PyTorch the way model code writes it: naive (`rotate_half`, in x's dtype),
fp32 (the same upcast to fp32 and cast back, as Llama's reference code does), compiled
(torch.compile of the naive one)."""

from __future__ import annotations

import torch

from perfloop.ops.base import compile_variant


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _written(x, cos, sin, interleaved: bool = False):
    if interleaved:  # neighbouring pairs: the complex product
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(pairs * torch.complex(cos.float(), sin.float())).flatten(-2)
        return out.to(x.dtype)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return x * cos + rotate_half(x) * sin


def naive(x, cos, sin, interleaved: bool = False):
    return _written(x, cos, sin, interleaved)


def fp32(x, cos, sin, interleaved: bool = False):
    return _written(x.float(), cos.float(), sin.float(), interleaved).to(x.dtype)


_compiled = compile_variant(_written)


def compiled(x, cos, sin, interleaved: bool = False):
    return _compiled(x, cos, sin, interleaved)
