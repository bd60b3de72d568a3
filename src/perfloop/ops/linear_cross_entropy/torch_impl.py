"""Linear then cross entropy with PyTorch: naive (the logits to fp32 first, as scripts do under
autocast), builtin (F.cross_entropy on the logits as they are), compiled (torch.compile of the
naive one). Each holds the whole (N, V) logits, and their gradient."""

from __future__ import annotations

import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(h, weight, target, ignore_index: int = -100):
    return F.cross_entropy(F.linear(h, weight).float(), target, ignore_index=ignore_index).to(h.dtype)


def naive(h, weight, target, ignore_index: int = -100):
    return _naive(h, weight, target, ignore_index)


def builtin(h, weight, target, ignore_index: int = -100):
    return F.cross_entropy(F.linear(h, weight), target, ignore_index=ignore_index)


_compiled = compile_variant(_naive)


def compiled(h, weight, target, ignore_index: int = -100):
    return _compiled(h, weight, target, ignore_index)
