"""Cross entropy written with PyTorch: naive (the logits to fp32, then F.cross_entropy, as
training scripts do under autocast), builtin (F.cross_entropy on the logits as they are),
compiled (torch.compile of the naive one)."""

from __future__ import annotations

import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _naive(logits, target, ignore_index: int = -100):
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index).to(logits.dtype)


def naive(logits, target, ignore_index: int = -100):
    return _naive(logits, target, ignore_index)


def builtin(logits, target, ignore_index: int = -100):
    return F.cross_entropy(logits, target, ignore_index=ignore_index)


_compiled = compile_variant(_naive)


def compiled(logits, target, ignore_index: int = -100):
    return _compiled(logits, target, ignore_index)
