"""FlashAttention-2 in Triton: forward and backward, wrapped in autograd.

Forward (one program per BLOCK_M queries of one (batch, head)): walk the keys in
BLOCK_N tiles; s = q k^T in registers; keep the running row max m and sum l of
exp(s - m), rescale the output accumulator when m grows; write O = acc / l and
the row log-sum-exp L = m + log(l). With `causal`, tiles wholly above the
diagonal are never visited (the loop stops at the block's last query).

Backward, with recomputation (nothing S x S was kept):
  D = rowsum(dO * O)                              (preprocess kernel)
  P = exp(q k^T * scale - L),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D)
  dK = dS^T q * scale        (one program per K/V tile, looping over queries)
  dQ = dS k * scale          (one program per query tile, looping over keys)
Two kernels instead of atomics: each output tile has exactly one writer.

Exponentials run in base 2 (exp2), with log2(e) folded into the scale: one
multiply fewer per score.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from perfloop.ops.attention import validate
from perfloop.ops.base import interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _fwd_tiles(
    q, k_base, v_base, m_i, l_i, acc, qk_scale, skn, skd, svn, svd, SK, offs_m, offs_n, offs_d,
    d_ok, lo, hi, MASK_CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = tl.load(  # k^T tile: (BLOCK_D, BLOCK_N)
            k_base + cols[None, :] * skn + offs_d[:, None] * skd,
            mask=(cols[None, :] < SK) & d_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 domain
        valid = cols[None, :] < SK
        if MASK_CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + cols[:, None] * svn + offs_d[None, :] * svd,
            mask=(cols[:, None] < SK) & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, K, V, O, L, qk_scale,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < SQ) & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: tiles wholly below the diagonal need no mask, tiles past the block's last
    # query are never visited, and only the band of tiles crossing the diagonal is masked.
    mid = SK
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
        mid = tl.minimum(hi, (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
    m_i, l_i, acc = _fwd_tiles(
        q, k_base, v_base, m_i, l_i, acc, qk_scale, skn, skd, svn, svd, SK, offs_m, offs_n, offs_d,
        d_ok, 0, mid, False, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    if CAUSAL:
        m_i, l_i, acc = _fwd_tiles(
            q, k_base, v_base, m_i, l_i, acc, qk_scale, skn, skd, svn, svd, SK, offs_m, offs_n,
            offs_d, d_ok, mid, hi, True, UPCAST, PRECISION, BLOCK_N,
        )  # fmt: skip
    acc = acc / l_i[:, None]
    row_ok = offs_m < SQ
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(L + bh * SQ + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _bwd_preprocess(O, DO, Dl, SQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # D = rowsum(dO * O); O and dO are contiguous (B*H, SQ, HEAD_DIM) here
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    base = bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + base, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + base, mask=mask, other=0.0).to(tl.float32)
    tl.store(Dl + bh * SQ + offs_m, tl.sum(o * do, axis=1), mask=offs_m < SQ)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, L, Dl, DK, DV, sm_scale,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # all tensors contiguous (B*H, S, HEAD_DIM); one program per BLOCK_N keys
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n[:, None] < SK) & d_ok[None, :]
    kv_off = bh * SK * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # queries above this key tile see none of it
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    qk_scale = sm_scale * 1.4426950408889634
    for start_m in range(lo, SQ, BLOCK_M):
        offs_m = start_m + offs_m0
        q_mask = (offs_m[:, None] < SQ) & d_ok[None, :]
        q_off = bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + q_off, mask=q_mask, other=0.0)
        do = tl.load(DO + q_off, mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(L + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
        di = tl.load(Dl + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s * qk_scale - lse[:, None] * 1.4426950408889634)
        valid = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - di[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, L, Dl, DQ, sm_scale,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = (offs_m[:, None] < SQ) & d_ok[None, :]
    q_off = bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(L + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    di = tl.load(Dl + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < SK) & d_ok[None, :]
        kv_off = bh * SK * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.exp2(s * qk_scale - lse[:, None] * 1.4426950408889634)
        valid = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - di[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _config(head_dim: int, kind: str) -> dict:
    """Tile sizes and warps per kernel; small tiles in the interpreter (it is numpy)."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if kind == "fwd":
        # measured on the H200 (benchmarks/results/2026-11-30-h200-attn-tune-experiments.json):
        # 64x64, 4 warps, 3 stages was best for head dims 64 and 128, causal or not
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if kind == "dkdv":
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}  # dq


def _precision(dtype: torch.dtype) -> str:
    # fp32 follows PyTorch's TF32 switch, as cuBLAS does; halves always use tensor cores
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _forward(q, k, v, causal: bool, scale: float, cfg: dict | None = None):
    b, h, sq, d = q.shape
    sk = k.shape[2]
    o = torch.empty((b, h, sq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    cfg = cfg or _config(d, "fwd")
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](
        q, k, v, o, lse, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        h, sq, sk,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=causal,
        UPCAST=interpreting(), PRECISION=_precision(q.dtype), **cfg,
    )  # fmt: skip
    return o, lse


def _backward(q, k, v, o, lse, do, causal: bool, scale: float):
    b, h, sq, d = q.shape
    sk = k.shape[2]
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    block_d = max(16, triton.next_power_of_2(d))
    dl = torch.empty_like(lse)
    _bwd_preprocess[(triton.cdiv(sq, 64), b * h)](o, do, dl, sq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, UPCAST=interpreting(),
                  PRECISION=_precision(q.dtype))  # fmt: skip
    cfg = _config(d, "dkdv")
    _bwd_dkdv_kernel[(triton.cdiv(sk, cfg["BLOCK_N"]), b * h)](
        q, k, v, do, lse, dl, dk, dv, scale, h, sq, sk, **common, **cfg
    )
    cfg = _config(d, "dq")
    _bwd_dq_kernel[(triton.cdiv(sq, cfg["BLOCK_M"]), b * h)](
        q, k, v, do, lse, dl, dq, scale, h, sq, sk, **common, **cfg
    )
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """(out, lse): FlashAttention-2 forward; `out.backward(...)` runs the Triton backward.

    >>> o, lse = flash_attention(q, k, v, causal=True)  # doctest: +SKIP
    """
    validate(q, k, v, causal)
    if q.numel() == 0 or k.shape[2] == 0:
        raise ValueError("q, k, v: empty sequence; attention needs at least one query and one key")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return FlashAttention.apply(q, k, v, bool(causal), float(scale))


def attention(q, k, v, causal=False, out=None):
    o, _ = flash_attention(q, k, v, causal)
    return o if out is None else out.copy_(o)
