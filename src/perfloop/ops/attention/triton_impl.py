"""FlashAttention-2 in Triton, launched: the kernels of triton_kernels.py (the algorithm is
said there) given their tiles and wrapped in autograd.

Tiles, warps and stages per kernel come from `tuned.json` beside this file, written by
`tuning.py`; a config that does not fit the GPU's shared memory steps down (`_launch`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from perfloop.ops import native
from perfloop.ops.attention import validate
from perfloop.ops.attention.triton_kernels import (
    LOG2E,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess,
    attn_fwd_kernel,
)
from perfloop.ops.base import cdiv, dot_precision, interpreting, k_major_for_tf32, needs_grad, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

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
    _launch(
        attn_fwd_kernel, "fwd", cfg, lambda c: (cdiv(sq, c["BLOCK_M"]), b * h), args, consts, d, sq, sk, q
    )
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
        attn_bwd_preprocess,
        (cdiv(sq, pre_m), b * h),
        o,
        do,
        dl,
        sq,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=pre_m,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    consts = (causal, interpreting(), _precision(q.dtype))
    cfgs = cfgs or {}
    _launch(
        attn_bwd_dkdv_kernel,
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
        attn_bwd_dq_kernel,
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
            attn_fwd_kernel,
            lambda c: cdiv(sq, c["BLOCK_M"]),
            (t, t, t, t, f32, scale, *strides, h, sq, sk, sk),  # V's rows: sk (16-bit V is not copied)
        ),
        "dkdv": (
            attn_bwd_dkdv_kernel,
            lambda c: cdiv(sk, c["BLOCK_N"]),
            (t, t, t, t, f32, f32, t, t, scale, h, sq, sk),
        ),
        "dq": (
            attn_bwd_dq_kernel,
            lambda c: cdiv(sq, c["BLOCK_M"]),
            (t, t, t, t, f32, f32, t, scale, h, sq, sk),
        ),
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
        attn_bwd_preprocess,
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
    return {
        "fwd": attn_fwd_kernel,
        "bwd_dkdv": attn_bwd_dkdv_kernel,
        "bwd_dq": attn_bwd_dq_kernel,
        "config": _config,
    }
