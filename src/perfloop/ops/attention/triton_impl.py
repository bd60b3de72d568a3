"""FlashAttention-2 in Triton: forward and backward, wrapped in autograd.

Forward (one program per BLOCK_M queries of one (batch, head)): walk the keys in
BLOCK_N tiles; s = q k^T in registers; keep the running row max m and sum l of
exp(s - m), rescale the output accumulator when m grows; write O = acc / l and
the row log-sum-exp L = m + log(l).

Backward, with recomputation (nothing S x S was kept):
  D = rowsum(dO * O)                              (preprocess kernel)
  P = exp(q k^T * scale - L),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D)
  dK = dS^T q * scale        (one program per K/V tile, looping over queries)
  dQ = dS k * scale          (one program per query tile, looping over keys)
Two kernels instead of atomics: each output tile has exactly one writer. The
dK/dV kernel computes the transposed tiles P^T = exp(k q^T ...) and dS^T
directly, so they feed the next matmul as they are: transposing a tile held in
registers would cost a round trip through shared memory per step.

What keeps the inner loops short -- on Hopper the exponentials and the other
per-score work, not the matmuls, are the limit:
- exponentials in base 2 (exp2), with log2(e) folded into the scale, and the
  scale applied inside the exp2's argument as one fused multiply-add;
- masks only where they can change something: every loop over tiles is split
  into tiles that need no mask (wholly inside the sequence and, with `causal`,
  wholly below the diagonal) and the few that do (the diagonal band, a ragged
  last tile). Tiles wholly above the diagonal are never visited;
- causal forward programs start with the longest rows, so the short ones fill
  the tail of the launch.

Tiles, warps and stages per kernel come from `tuned.json` beside this file, written by
`tuning.py`; a config that does not fit the GPU's shared memory steps down (`_launch`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops import native
from perfloop.ops.attention import validate
from perfloop.ops.base import cdiv, dot_precision, interpreting, k_major_for_tf32, needs_grad, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(x) = log2(x) * LN2


@triton.jit
def _load(base, rows, n_rows, offs_d, stride_row, stride_d, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
          UPCAST: tl.constexpr, TRANS: tl.constexpr = False):  # fmt: skip
    """Rows `rows` (< n_rows) of a (seq, HEAD_DIM) matrix, as (rows, d) or, with TRANS,
    (d, rows); zeros outside. MASK=False: the caller knows every row and column is in bounds."""
    if TRANS:
        ptrs = base + rows[None, :] * stride_row + offs_d[:, None] * stride_d
        inside = (rows[None, :] < n_rows) & (offs_d[:, None] < HEAD_DIM)
    else:
        ptrs = base + rows[:, None] * stride_row + offs_d[None, :] * stride_d
        inside = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    if MASK:
        x = tl.load(ptrs, mask=inside, other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_tiles(q, k_base, v_base, m_i, l_i, acc, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, SK,
               SK_V, offs_m, offs_n, offs_d, lo, hi, MASK: tl.constexpr, MASK_D: tl.constexpr,
               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """Key tiles [lo, hi) into the running (m_i, l_i, acc); MASK where a tile can hold
    keys past SK or above the diagonal. V's rows are read up to SK_V (>= SK: zeros past SK)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = _load(
            k_base, cols, SK, offs_d, stride_kn, stride_kd, HEAD_DIM, MASK or MASK_D, UPCAST, TRANS=True
        )
        s = tl.dot(q, kt, input_precision=PRECISION)  # raw scores; the scale goes into exp2
        if MASK:
            valid = cols[None, :] < SK
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # log2 domain (scale > 0)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load(v_base, cols, SK_V, offs_d, stride_vn, stride_vd, HEAD_DIM, MASK or MASK_D, UPCAST)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _key_range(pid_m, SK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
    """(mid, hi) for query block pid_m: key tiles [0, mid) need no mask; [mid, hi) are the
    diagonal band (causal) and a ragged last tile. Causal tiles past the block's last query
    are never visited."""
    hi = SK
    mid = SK
    if not EVEN_N:
        mid = SK // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
        mid = tl.minimum(mid, (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
    return mid, hi


@triton.jit
def _fwd_kernel(
    Q, K, V, O, L, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, SQ, SK, SK_V,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: the short ones fill the launch's tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    q = _load(Q + b * stride_qb + h * stride_qh, offs_m, SQ, offs_d, stride_qm, stride_qd, HEAD_DIM,
              MASK_D or not EVEN_M, UPCAST)  # fmt: skip
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    mid, hi = _key_range(pid_m, SK, BLOCK_M, BLOCK_N, EVEN_N, CAUSAL)
    m_i, l_i, acc = _fwd_tiles(q, k_base, v_base, m_i, l_i, acc, qk_scale, stride_kn, stride_kd, stride_vn,
                               stride_vd, SK, SK_V, offs_m, offs_n, offs_d, 0, mid, MASK=False, MASK_D=MASK_D,
                               CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST, PRECISION=PRECISION,
                               BLOCK_N=BLOCK_N)  # fmt: skip
    m_i, l_i, acc = _fwd_tiles(q, k_base, v_base, m_i, l_i, acc, qk_scale, stride_kn, stride_kd, stride_vn,
                               stride_vd, SK, SK_V, offs_m, offs_n, offs_d, mid, hi, MASK=True, MASK_D=MASK_D,
                               CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST, PRECISION=PRECISION,
                               BLOCK_N=BLOCK_N)  # fmt: skip
    acc = acc / l_i[:, None]
    row_ok = offs_m < SQ
    tl.store(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(L + bh * SQ + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


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
def _rows(X, bh, offs, S, MASK: tl.constexpr):
    """Per-row values (L or D) of (B*H, S) at rows `offs`; zeros past the end."""
    if MASK:
        return tl.load(X + bh * S + offs, mask=offs < S, other=0.0)
    return tl.load(X + bh * S + offs)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q, DO, L, Dl, bh, SQ, offs_n, offs_d, lo, hi, qk_scale,
    MASK: tl.constexpr, MASK_D: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    q_base = Q + bh * SQ * HEAD_DIM
    do_base = DO + bh * SQ * HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(q_base, offs_m, SQ, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK or MASK_D, UPCAST)
        do = _load(do_base, offs_m, SQ, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK or MASK_D, UPCAST)
        lse2 = _rows(L, bh, offs_m, SQ, MASK) * LOG2E
        di = _rows(Dl, bh, offs_m, SQ, MASK)
        # the transposed tiles (keys x queries), so P^T and dS^T feed the matmuls as they are
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        pt = tl.exp2(st * qk_scale - lse2[None, :])
        if MASK:
            valid = offs_m[None, :] < SQ
            if CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(valid, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - di[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, L, Dl, DK, DV, sm_scale,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # all tensors contiguous (B*H, S, HEAD_DIM); one program per BLOCK_N keys, walking the queries
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    kv_base = bh * SK * HEAD_DIM
    k = _load(K + kv_base, offs_n, SK, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK_D or not EVEN_N, UPCAST)
    v = _load(V + kv_base, offs_n, SK, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK_D or not EVEN_N, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = sm_scale * LOG2E
    # query tiles: [lo, mid) the diagonal band (causal), [mid, m_even) no mask,
    # [max(mid, m_even), SQ) a ragged last tile; queries above the keys see none of them
    m_even = SQ
    if not EVEN_M:
        m_even = SQ // BLOCK_M * BLOCK_M
    lo = 0
    mid = 0
    if CAUSAL:
        lo = n0 // BLOCK_M * BLOCK_M
        mid = tl.maximum(lo, tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M) * BLOCK_M, m_even))
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, L, Dl, bh, SQ, offs_n, offs_d, lo, mid, qk_scale,
                             MASK=True, MASK_D=MASK_D, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST,
                             PRECISION=PRECISION, BLOCK_M=BLOCK_M)  # fmt: skip
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, L, Dl, bh, SQ, offs_n, offs_d, mid, m_even, qk_scale,
                         MASK=False, MASK_D=MASK_D, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST,
                         PRECISION=PRECISION, BLOCK_M=BLOCK_M)  # fmt: skip
    if not EVEN_M:
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, L, Dl, bh, SQ, offs_n, offs_d, tl.maximum(mid, m_even), SQ,
                             qk_scale, MASK=True, MASK_D=MASK_D, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM,
                             UPCAST=UPCAST, PRECISION=PRECISION, BLOCK_M=BLOCK_M)  # fmt: skip
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    kv_off = kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, di, K, V, bh, SK, SQ, offs_m, offs_d, lo, hi, qk_scale,
    MASK: tl.constexpr, MASK_D: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    k_base = K + bh * SK * HEAD_DIM
    v_base = V + bh * SK * HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load(k_base, offs_n, SK, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK or MASK_D, UPCAST, True)
        vt = _load(v_base, offs_n, SK, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK or MASK_D, UPCAST, True)
        s = tl.dot(q, kt, input_precision=PRECISION)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASK:
            valid = offs_n[None, :] < SK
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - di[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, L, Dl, DQ, sm_scale,
    H, SQ, SK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # one program per BLOCK_M queries, walking the keys
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    q_base = bh * SQ * HEAD_DIM
    q = _load(Q + q_base, offs_m, SQ, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK_D or not EVEN_M, UPCAST)
    do = _load(DO + q_base, offs_m, SQ, offs_d, HEAD_DIM, 1, HEAD_DIM, MASK_D or not EVEN_M, UPCAST)
    lse2 = _rows(L, bh, offs_m, SQ, not EVEN_M) * LOG2E
    di = _rows(Dl, bh, offs_m, SQ, not EVEN_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * LOG2E
    mid, hi = _key_range(pid_m, SK, BLOCK_M, BLOCK_N, EVEN_N, CAUSAL)
    dq = _dq_tiles(dq, q, do, lse2, di, K, V, bh, SK, SQ, offs_m, offs_d, 0, mid, qk_scale, MASK=False,
                   MASK_D=MASK_D, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST, PRECISION=PRECISION,
                   BLOCK_N=BLOCK_N)  # fmt: skip
    dq = _dq_tiles(dq, q, do, lse2, di, K, V, bh, SK, SQ, offs_m, offs_d, mid, hi, qk_scale, MASK=True,
                   MASK_D=MASK_D, CAUSAL=CAUSAL, HEAD_DIM=HEAD_DIM, UPCAST=UPCAST, PRECISION=PRECISION,
                   BLOCK_N=BLOCK_N)  # fmt: skip
    q_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)  # fmt: skip


# Tiles (BLOCK_M queries x BLOCK_N keys), warps and pipeline stages per kernel, by dtype (16-bit,
# fp32: twice the shared memory a stage) and head dim (<= 64, else 128).
TUNED = load_table(Path(__file__).parent)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def _precision(dtype: torch.dtype) -> str:
    """fp32 on tensor cores either way: TF32 where torch allows it, else tf32x3 (fp32's accuracy)."""
    return dot_precision(dtype, exact="tf32x3")


def _config(head_dim: int, kind: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile sizes and warps per kernel; small tiles in the interpreter (it is numpy)."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    row = TUNED["fp32" if dtype == torch.float32 else "16bit"][kind]
    return dict(zip(CONFIG_KEYS, row["64" if head_dim <= 64 else "128"], strict=True))


def _shape_consts(d: int, sq: int, sk: int, cfg: dict) -> dict:
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, next_pow2(d)),
        "EVEN_M": sq % cfg["BLOCK_M"] == 0,
        "EVEN_N": sk % cfg["BLOCK_N"] == 0,
    }


try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - very old Triton

    class OutOfResources(Exception):
        pass


_FITTED: dict = {}  # (kernel, head dim, dtype, device) -> the config that fit this GPU


def _smaller(cfg: dict) -> dict | None:
    """The next config to try when one does not fit: one pipeline stage fewer (down to 2),
    then the larger tile side halved (down to 16)."""
    if cfg["num_stages"] > 2:
        return {**cfg, "num_stages": cfg["num_stages"] - 1}
    side = "BLOCK_N" if cfg["BLOCK_N"] >= cfg["BLOCK_M"] else "BLOCK_M"
    if cfg[side] > 16:
        return {**cfg, side: cfg[side] // 2}
    return None


_PLANS: dict = {}  # (kind, head dim, sq, sk, dtype, device, consts) -> the launch's keyword arguments


def _fit(kind: str, d: int, sq: int, sk: int, q, consts: tuple, attempt) -> dict:
    """`attempt(meta, cfg)` (a launch, or a compile) with the table's config for this head dim
    and dtype, stepping down to smaller ones where it does not fit (an RTX card has ~100 KB of
    shared memory a block, the H200 227 KB); what fit is remembered, with the launch's other
    settings per shape. `consts`: (CAUSAL, UPCAST, PRECISION). Returns the settings."""
    key = (kind, d, q.dtype, q.device)
    cfg = _FITTED.get(key) or _config(d, kind, q.dtype)
    causal, upcast, precision = consts
    while True:
        meta = {
            "CAUSAL": causal,
            "UPCAST": upcast,
            "PRECISION": precision,
            **_shape_consts(d, sq, sk, cfg),
            **cfg,
        }
        try:
            attempt(meta, cfg)
        except OutOfResources:
            cfg = _smaller(cfg)
            if cfg is None:
                raise
            continue
        _FITTED[key] = cfg
        _PLANS[(kind, d, sq, sk, q.dtype, q.device, consts)] = meta
        return meta


def _launch(kernel, kind: str, cfg: dict | None, grid_of, args: tuple, consts: tuple, d, sq, sk, q) -> None:
    """Launch with the settings that fit this shape (`_fit`); an explicit `cfg` (tuning)
    launches as it is, or fails."""
    if cfg is not None:
        causal, upcast, precision = consts
        meta = {
            "CAUSAL": causal,
            "UPCAST": upcast,
            "PRECISION": precision,
            **_shape_consts(d, sq, sk, cfg),
            **cfg,
        }
        launch(kernel, grid_of(cfg), *args, **meta)
        return
    plan = _PLANS.get((kind, d, sq, sk, q.dtype, q.device, consts))
    if plan is not None:
        launch(kernel, grid_of(plan), *args, **plan)
        return
    _fit(kind, d, sq, sk, q, consts, lambda meta, cfg: launch(kernel, grid_of(cfg), *args, **meta))


def run_forward(q, k, v, causal: bool, scale: float, cfg: dict | None = None):
    """(o, lse); `cfg` overrides the table's tiles (tuning)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    o = q.new_empty((b, h, sq, d))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    precision = _precision(q.dtype)
    v_dots = k_major_for_tf32(v, precision)  # V is P V's second operand
    sk_v = sk if v_dots is v else v_dots.stride(-1)  # the copy's rows: padded with zeros
    args = (
        q,
        k,
        v_dots,
        o,
        lse,
        scale * LOG2E.value,
        *q.stride(),
        *k.stride(),
        *v_dots.stride(),
        *o.stride(),
        h,
        sq,
        sk,
        sk_v,
    )
    consts = (causal, interpreting(), precision)
    _launch(_fwd_kernel, "fwd", cfg, lambda c: (cdiv(sq, c["BLOCK_M"]), b * h), args, consts, d, sq, sk, q)
    return o, lse


def run_backward(q, k, v, o, lse, do, causal: bool, scale: float, cfgs: dict | None = None):
    """dq, dk, dv; `cfgs` ({"dkdv": cfg, "dq": cfg}) overrides the tiles (tuning)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    block_d = max(16, next_pow2(d))
    dl = torch.empty_like(lse)
    pre_m = TUNED["preprocess_block_m"]
    launch(
        _bwd_preprocess, (cdiv(sq, pre_m), b * h), o, do, dl, sq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    consts = (causal, interpreting(), _precision(q.dtype))
    cfgs = cfgs or {}
    _launch(
        _bwd_dkdv_kernel,
        "dkdv",
        cfgs.get("dkdv"),
        lambda c: (cdiv(sk, c["BLOCK_N"]), b * h),
        (q, k, v, do, lse, dl, dk, dv, scale, h, sq, sk),
        consts,
        d,
        sq,
        sk,
        q,
    )
    _launch(
        _bwd_dq_kernel,
        "dq",
        cfgs.get("dq"),
        lambda c: (cdiv(sq, c["BLOCK_M"]), b * h),
        (q, k, v, do, lse, dl, dq, scale, h, sq, sk),
        consts,
        d,
        sq,
        sk,
        q,
    )
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = run_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


_NATIVE: dict = {}  # (shapes, strides, dtype, causal, device) -> the C++ side's plan, or None


def _native_plan(q, k, v, causal: bool):
    """The four kernels, with the tiles that fit this GPU (`_fit`), compiled for this shape and
    layout and handed to native.cpp: the plan's index there, or None where the C++ Function
    cannot run them (native.why_not says why)."""
    ext = native.extension("attention")
    if ext is None:
        return None
    b, h, sq, d = q.shape
    sk = k.shape[2]
    bh, consts = b * h, (causal, False, _precision(q.dtype))
    t = torch.empty(16, dtype=q.dtype, device=q.device)  # warmup compiles for dtype and alignment
    f32 = torch.empty(16, dtype=torch.float32, device=q.device)
    scale = 1.0  # a float argument: its value is not compiled in
    strides = (*q.stride(), *k.stride(), *v.stride(), h * sq * d, sq * d, d, 1)  # o: contiguous
    pre_m = TUNED["preprocess_block_m"]
    kernels = {
        "fwd": (
            _fwd_kernel,
            lambda c: cdiv(sq, c["BLOCK_M"]),
            (t, t, t, t, f32, scale, *strides, h, sq, sk, sk),  # V's rows: sk (16-bit V is not copied)
        ),
        "dkdv": (
            _bwd_dkdv_kernel,
            lambda c: cdiv(sk, c["BLOCK_N"]),
            (t, t, t, t, f32, f32, t, t, scale, h, sq, sk),
        ),
        "dq": (_bwd_dq_kernel, lambda c: cdiv(sq, c["BLOCK_M"]), (t, t, t, t, f32, f32, t, scale, h, sq, sk)),
    }
    ids, grids = {}, {}
    for kind, (kernel, grid_x, args) in kernels.items():

        def attempt(meta, cfg, kernel=kernel, grid_x=grid_x, args=args, kind=kind):
            ids[kind] = native.add_kernel(
                ext, kernel, (grid_x(cfg), bh), *args, **meta
            )  # raises if it does not fit
            grids[kind] = grid_x(cfg)

        plan = _PLANS.get((kind, d, sq, sk, q.dtype, q.device, consts))
        if plan is not None:
            attempt(plan, plan)
        else:
            _fit(kind, d, sq, sk, q, consts, attempt)
    pre = native.add_kernel(
        ext,
        _bwd_preprocess,
        (cdiv(sq, pre_m), bh),
        t,
        t,
        f32,
        sq,
        HEAD_DIM=d,
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_M=pre_m,
    )
    return native.plan_of(
        "attention",
        ext,
        (ids["fwd"], pre, ids["dkdv"], ids["dq"]),
        grids["fwd"],
        cdiv(sq, pre_m),
        grids["dkdv"],
        grids["dq"],
    )


def _attention_function(q, k, v, causal: bool, scale: float):
    """(out, lse) through autograd: the C++ Function where it runs (16-bit inputs, 16-byte
    aligned), else the Python one."""
    if q.is_cuda and q.dtype != torch.float32 and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        dev = q.get_device()
        key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, causal, dev)
        plan = native.plan_for(_NATIVE, key, lambda: _native_plan(q, k, v, causal), q.device)
        if plan is not None:
            stream = torch._C._cuda_getCurrentRawStream(dev)
            o, lse = native.extension("attention").attention(q, k, v, scale, plan, stream)
            return o, lse
    return FlashAttention.apply(q, k, v, causal, scale)


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """(out, lse): FlashAttention-2 forward; `out.backward(...)` runs the Triton backward.

    >>> o, lse = flash_attention(q, k, v, causal=True)  # doctest: +SKIP
    """
    validate(q, k, v, causal)
    if q.numel() == 0 or k.shape[2] == 0:
        raise ValueError("q, k, v: empty sequence; attention needs at least one query and one key")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: need a finite number > 0 (default 1/sqrt(head_dim)), got {scale!r}")
    if needs_grad(q, k, v):
        return _attention_function(q, k, v, bool(causal), float(scale))
    return run_forward(q, k, v, bool(causal), float(scale))


def attention(q, k, v, causal=False, out=None):
    o, _ = flash_attention(q, k, v, causal)
    return o if out is None else out.copy_(o)


def kernels() -> dict:
    """The three jitted kernels and the launch-config lookup, for `perfloop asm` (asm_specs)."""
    return {"fwd": _fwd_kernel, "bwd_dkdv": _bwd_dkdv_kernel, "bwd_dq": _bwd_dq_kernel, "config": _config}
