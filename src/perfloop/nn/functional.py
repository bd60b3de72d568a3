"""Fused versions of the functional calls a model's own `forward` makes (`F.layer_norm`,
`F.rms_norm`, `F.cross_entropy`, `F.gelu` in both forms, and the SiLU / GELU gates), each with
torch's signature, and why a given call has no fused kernel. nn.reroute sends chosen call sites
of a model's code to them.

Each fused function runs torch's own where its kernels do not fit (an option they lack, a dtype,
a CPU tensor without the interpreter, under torch.compile), so whatever torch refuses is refused
with torch's error.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from perfloop.nn.modules import (
    autocast_on,
    kernel_here,
    why_not_gelu_options,
    why_not_loss_options,
    why_not_norm_options,
)
from perfloop.nn.registry import CALLS, GATES, dispatch
from perfloop.ops.base import autocast_fp32

_WHY: dict = {}  # the checks' answers by call signature: a step pays for them once


def _cached(key, check) -> str | None:
    if key not in _WHY:
        _WHY[key] = check()
    return _WHY[key]


def _here_why(x) -> str | None:
    """Why the kernels cannot run on x here (None: they can)."""
    if not isinstance(x, torch.Tensor):
        return "no tensor input"
    return _cached(("here", x.device), lambda: kernel_here(x))


def _norm_why(x, normalized_shape, weight) -> str | None:
    key = (
        "norm",
        x.device,
        x.dtype,
        x.shape[-1] if x.ndim else 0,
        autocast_on(x.device.type),
        tuple(normalized_shape),
        None if weight is None else (weight.shape, weight.dtype),
    )
    return _cached(key, lambda: why_not_norm(x, normalized_shape, weight))


def why_not_norm(x, normalized_shape, weight) -> str | None:
    from perfloop.ops.layernorm.triton_impl import supported

    why = why_not_norm_options(normalized_shape, weight)
    if why:
        return why
    if tuple(normalized_shape) != tuple(x.shape[-1:]):
        return f"normalized_shape {tuple(normalized_shape)} for rows of {tuple(x.shape[-1:])}"
    return supported(autocast_fp32(x), weight)


def _graph():
    from perfloop.nn import compiled

    return compiled


def _fused_norm(x, weight, bias, eps, rms: bool):
    from perfloop.ops.layernorm.triton_impl import fused_norm

    x = autocast_fp32(x)
    return fused_norm(x, weight, bias, eps if eps is not None else torch.finfo(x.dtype).eps, rms)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return dispatch(
        graph=lambda: _graph().graph_norm(
            "layer_norm", input, normalized_shape, weight, bias, eps, rms=False
        ),
        why=lambda: _here_why(input) or _norm_why(input, normalized_shape, weight),
        kernel=lambda: _fused_norm(input, weight, bias, eps, False),
        fallback=lambda why: F.layer_norm(input, normalized_shape, weight, bias, eps),
    )


def rms_norm(input, normalized_shape, weight=None, eps=None):
    return dispatch(
        graph=lambda: _graph().graph_norm("rms_norm", input, normalized_shape, weight, None, eps, rms=True),
        why=lambda: _here_why(input) or _norm_why(input, normalized_shape, weight),
        kernel=lambda: _fused_norm(input, weight, None, eps, True),
        fallback=lambda why: F.rms_norm(input, normalized_shape, weight, eps),
    )


def why_not_cross_entropy(input, target, weight, reduction, label_smoothing) -> str | None:
    from perfloop.ops.cross_entropy.triton_impl import supported

    return why_not_loss_options(weight, label_smoothing, reduction) or supported(input, target)


def cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    def why():
        if size_average is not None or reduce is not None or not isinstance(target, torch.Tensor):
            return "torch's own"
        key = (
            "ce",
            input.device,
            input.dtype,
            input.ndim,
            target.dtype,
            target.ndim,
            target.shape[:1] == input.shape[:1],
            weight is None,
            label_smoothing,
            reduction,
        )
        return _cached(key, lambda: why_not_cross_entropy(input, target, weight, reduction, label_smoothing))

    def kernel():
        from perfloop.ops.cross_entropy.triton_impl import fused_cross_entropy

        # under autocast torch's loss is fp32; else the logits' dtype (the kernel writes it so)
        dtype = torch.float32 if autocast_on(input.device.type) else input.dtype
        return fused_cross_entropy(input, target, ignore_index, dtype)

    def graph():
        if size_average is not None or reduce is not None:
            return None
        return _graph().graph_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)

    return dispatch(
        graph=graph,
        why=lambda: _here_why(input) or why(),
        kernel=kernel,
        fallback=lambda why: F.cross_entropy(
            input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
        ),
    )


def gelu(input, approximate="none"):
    ok = (torch.float32, torch.float16, torch.bfloat16)
    return dispatch(
        why=lambda: (
            why_not_gelu_options(approximate)
            or _here_why(input)
            or (None if input.dtype in ok else f"dtype {input.dtype}")
        ),
        kernel=lambda: _fused_gelu(input, approximate),
        fallback=lambda why: F.gelu(input, approximate=approximate),
    )


def _fused_gelu(input, approximate: str):
    from perfloop.ops.gelu.triton_impl import gelu as fused

    if not input.ndim:
        return fused(input.reshape(1), approximate=approximate).reshape(())
    # the output in the input's memory order (a transposed input gives a transposed output, as
    # torch's does): the kernel runs on the input seen in that order, then it is turned back
    order = sorted(range(input.ndim), key=lambda d: -input.stride(d))
    if order == list(range(input.ndim)):
        return fused(input, approximate=approximate)
    back = sorted(range(input.ndim), key=order.__getitem__)
    return fused(input.permute(order), approximate=approximate).permute(back)


def _gate_why(a, b, approximate="none") -> str | None:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return "operands of different shapes or dtypes (a broadcast)"
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {a.dtype}"
    return why_not_gelu_options(approximate)


def silu_gate(a, b):
    """F.silu(a) * b in one kernel each way (SwiGLU)."""

    def kernel():
        from perfloop.ops.swiglu.triton_impl import swiglu

        return swiglu(a, b)

    return dispatch(
        why=lambda: _here_why(a) or _gate_why(a, b), kernel=kernel, fallback=lambda why: F.silu(a) * b
    )


def gelu_gate(a, b, approximate="none"):
    """F.gelu(a, approximate=...) * b in one kernel each way (GeGLU)."""

    def kernel():
        from perfloop.ops.swiglu.triton_impl import geglu

        return geglu(a, b, approximate=approximate)

    return dispatch(
        why=lambda: _here_why(a) or _gate_why(a, b, approximate),
        kernel=kernel,
        fallback=lambda why: F.gelu(a, approximate=approximate) * b,
    )


# registry.OPS' functions defined here, by name
FUSED = {n: f for n, f in globals().items() if n in {*CALLS, *GATES.values()}}
TORCH = {  # torch's own of each gate (the others are torch.nn.functional's of the same name)
    "silu_gate": lambda a, b: F.silu(a) * b,
    "gelu_gate": lambda a, b, approximate="none": F.gelu(a, approximate=approximate) * b,
}


def torch_function(name: str):
    """Torch's own version of a fused function (a gate: the activation times b)."""
    return TORCH.get(name) or getattr(F, name)


def why_not_call(name: str, args: tuple, kwargs: dict) -> str | None:
    """Why a recorded functional call has no fused kernel (None: it has), by its arguments."""

    try:
        bound = inspect.signature(FUSED[name]).bind(*args, **kwargs)
    except TypeError as exc:
        return f"arguments torch's signature takes but these do not ({exc})"
    a = bound.arguments
    if name in TORCH:
        x = a["a"]
        if not isinstance(x, torch.Tensor):
            return "no tensor input"
        return kernel_here(x) or _gate_why(x, a["b"], a.get("approximate", "none"))
    x = a.get("input")
    if not isinstance(x, torch.Tensor):
        return "no tensor input"
    if kernel_here(x):
        return kernel_here(x)
    if name in ("layer_norm", "rms_norm"):
        return why_not_norm(x, a.get("normalized_shape", ()), a.get("weight"))
    if name == "cross_entropy":
        if a.get("size_average") is not None or a.get("reduce") is not None:
            return "size_average= or reduce= (deprecated forms)"
        return why_not_cross_entropy(
            x, a.get("target"), a.get("weight"), a.get("reduction", "mean"), a.get("label_smoothing", 0.0)
        )
    why = why_not_gelu_options(a.get("approximate", "none"))
    if why:
        return why
    return None if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else f"dtype {x.dtype}"
