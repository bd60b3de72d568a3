"""Attention with PyTorch: naive, builtin (SDPA), compiled, and FlashAttention-2 tiled
in plain PyTorch -- the algorithm at a readable pace, not a fast kernel."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from perfloop.ops.base import compile_variant


def _write(y, out):
    return y if out is None else out.copy_(y)


def _naive(q, k, v, causal: bool):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk): in memory
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def naive(q, k, v, causal=False, out=None):
    return _write(_naive(q, k, v, causal), out)


def builtin(q, k, v, causal=False, out=None):
    return _write(F.scaled_dot_product_attention(q, k, v, is_causal=causal), out)


_compiled = compile_variant(_naive)


def compiled(q, k, v, causal=False, out=None):
    return _write(_compiled(q, k, v, causal), out)


def flash_torch(q, k, v, causal=False, out=None, block_n: int = 64):
    """FlashAttention-2's forward, one K/V tile at a time, in PyTorch ops.

    For each tile of keys: scores s = q k^T (only Sq x block_n of them), a running
    row max m, a running sum (mass) of exp(s - m), and an output accumulator rescaled
    by exp(m_old - m_new) whenever the max grows. Nothing S x S is ever held.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.float() * scale
    sq, sk = q.shape[-2], k.shape[-2]
    m = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)  # (B, H, Sq, 1)
    mass = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)  # (B, H, Sq, D)
    rows = torch.arange(sq, device=q.device)[:, None]
    for start in range(0, sk, block_n):
        kt, vt = k[..., start : start + block_n, :].float(), v[..., start : start + block_n, :].float()
        s = qf @ kt.transpose(-1, -2)  # (B, H, Sq, block_n)
        if causal:
            cols = torch.arange(start, start + kt.shape[-2], device=q.device)[None, :]
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # a row that has seen only masked keys keeps m = -inf: no rescale, no mass
        alpha = torch.where(m_new == float("-inf"), 1.0, torch.exp(m - m_new))
        p = torch.where(m_new == float("-inf"), 0.0, torch.exp(s - m_new))
        mass = mass * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ vt
        m = m_new
    return _write((acc / mass).to(q.dtype), out)
