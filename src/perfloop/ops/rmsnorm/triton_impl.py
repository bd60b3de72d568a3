"""RMSNorm in Triton: LayerNorm's forward and backward kernels without the mean and the bias
(ops/layernorm/triton_impl.py)."""

from __future__ import annotations

from perfloop.ops.layernorm.triton_impl import norm


def rms_norm(x, weight, eps: float = 1e-6):
    return norm(x, weight, None, eps, rms=True)
