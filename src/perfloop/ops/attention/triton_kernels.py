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

The kernels only: triton_impl.py picks their tiles and launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def attn_fwd_kernel(
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
def attn_bwd_preprocess(O, DO, Dl, SQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
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
def attn_bwd_dkdv_kernel(
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
def attn_bwd_dq_kernel(
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
