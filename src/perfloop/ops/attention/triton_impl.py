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
def _tile(X, bh, S, offs, offs_d, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `offs` of X viewed as contiguous (B*H, S, HEAD_DIM); zeros past the edges."""
    mask = (offs[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(X + bh * S * HEAD_DIM + offs[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _p_and_ds(q, k, v, do, lse, di, offs_m, offs_n, SQ, SK, qk_scale,
              CAUSAL: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Recompute P = exp(q k^T * scale - L) for a (BLOCK_M, BLOCK_N) tile, and
    dS = P * (dO V^T - D): what both backward kernels need."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    p = tl.exp2(s * qk_scale - lse[:, None] * 1.4426950408889634)
    valid = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - di[:, None])


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
    offs_d = tl.arange(0, BLOCK_D)
    k = _tile(K, bh, SK, offs_n, offs_d, HEAD_DIM, UPCAST)
    v = _tile(V, bh, SK, offs_n, offs_d, HEAD_DIM, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # queries above this key tile see none of it
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    qk_scale = sm_scale * 1.4426950408889634
    for start_m in range(lo, SQ, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _tile(Q, bh, SQ, offs_m, offs_d, HEAD_DIM, UPCAST)
        do = _tile(DO, bh, SQ, offs_m, offs_d, HEAD_DIM, UPCAST)
        lse = tl.load(L + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
        di = tl.load(Dl + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
        p, ds = _p_and_ds(q, k, v, do, lse, di, offs_m, offs_n, SQ, SK, qk_scale, CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    kv_off = bh * SK * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, L, Dl, DQ, sm_scale,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # one program per BLOCK_M queries, walking the keys
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _tile(Q, bh, SQ, offs_m, offs_d, HEAD_DIM, UPCAST)
    do = _tile(DO, bh, SQ, offs_m, offs_d, HEAD_DIM, UPCAST)
    lse = tl.load(L + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    di = tl.load(Dl + bh * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(K, bh, SK, offs_n, offs_d, HEAD_DIM, UPCAST)
        v = _tile(V, bh, SK, offs_n, offs_d, HEAD_DIM, UPCAST)
        _, ds = _p_and_ds(q, k, v, do, lse, di, offs_m, offs_n, SQ, SK, qk_scale, CAUSAL, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    q_off = bh * SQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
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


def asm_specs(ty: str) -> list[dict]:
    """The three kernels of a call at head_dim 128, causal, as the GPU compiles them: the
    head-dim strides are 1, which Triton's runtime turns into constants (so loads vectorize)."""
    ptr = f"*{ty}"
    strides = {}
    for t, seq in (("q", "m"), ("k", "n"), ("v", "n"), ("o", "m")):
        strides |= {f"s{t}b": "i32", f"s{t}h": "i32", f"s{t}{seq}": "i32", f"s{t}d": "constexpr"}
    sizes = {"H": "i32", "SQ": "i32", "SK": "i32"}
    fwd_sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "L": "*fp32", "qk_scale": "fp32", **strides, **sizes}
    unit = {"sqd": 1, "skd": 1, "svd": 1, "sod": 1}
    common = {"HEAD_DIM": 128, "BLOCK_D": 128, "CAUSAL": True, "UPCAST": False, "PRECISION": "tf32"}
    bwd_sig = {"Q": ptr, "K": ptr, "V": ptr, "DO": ptr, "L": "*fp32", "Dl": "*fp32"}
    specs = []
    for kernel, kind, sig, aligned in (
        # pointers, and every stride and size that is a multiple of 16 (as at S=4096, D=128)
        (_fwd_kernel, "fwd", fwd_sig, [i for i, (n, t) in enumerate(fwd_sig.items())
                                       if t != "constexpr" and n not in ("qk_scale", "H")]),
        (_bwd_dkdv_kernel, "dkdv", {**bwd_sig, "DK": ptr, "DV": ptr, "sm_scale": "fp32", **sizes},
         list(range(8))),
        (_bwd_dq_kernel, "dq", {**bwd_sig, "DQ": ptr, "sm_scale": "fp32", **sizes}, list(range(7))),
    ):  # fmt: skip
        cfg = _config(128, kind)
        consts = {**common, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
        if kind == "fwd":
            consts |= unit
        specs.append({"kernel": kernel, "signature": sig, "aligned": aligned, "constexprs": consts,
                      "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})  # fmt: skip
    return specs
