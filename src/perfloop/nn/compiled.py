"""The fused kernels as torch.library custom ops, so torch.compile puts them in its graph (no
graph break): each op with its autograd formula and a fake-tensor rule for tracing. Eager calls
use the autograd functions of the op library instead (less host time a call); both run the
same kernels through the same `forward_parts`/`backward_parts`.

Which ops go into a compiled graph is `in_graph(names)`'s choice, within it (names of
nn.functional's fused functions that have a graph op: registry.GRAPH_OPS). As shipped, the head
(nn.LinearCrossEntropy, which a model uses by name) alone: it never holds the logits (a GPT-2
loss in 0.29 GiB where compile's takes 1.63) at compile's time (1.02x, benchmarks/NOTES.md).
The others stay out: on the H200 the fused cross entropy in the graph ran GPT-2 small 0.995x and
the Llama-style model 0.990x of torch.compile's own, the norms 0.95x and 0.75x, so under
torch.compile a patched model runs the graph Inductor makes of the model's own code. GELU and the
gates never go in: they are elementwise, and Inductor fuses those into their neighbours.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch
from torch import Tensor

from perfloop.nn.registry import DEFAULT_IN_GRAPH, GRAPH_OPS
from perfloop.ops.base import autocast_fp32 as _autocast_fp32
from perfloop.ops.base import autocast_on, triton_installed
from perfloop.ops.layernorm import MAX_N

_TRITON = triton_installed()  # a constant where Dynamo reads it


def _kernels(op: str):
    """The op's Triton module, imported at its first call (Triton is optional: without it no
    graph op takes a call, `_here`)."""
    return importlib.import_module(f"perfloop.ops.{op}.triton_impl")


# which fused functions a compiled graph takes as perfloop's ops, in this context
_IN_GRAPH: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "perfloop_in_graph", default=DEFAULT_IN_GRAPH
)


@contextlib.contextmanager
def in_graph(names):
    """Within (this thread or task): the fused functions `names` go into a graph torch.compile
    traces as perfloop's ops, the others as torch's own code. A graph traced before keeps its
    choice: call torch.compiler.reset() (or compile anew) for one traced within."""
    names = frozenset(names)
    if not names <= GRAPH_OPS:
        raise ValueError(
            f"names: {sorted(names - GRAPH_OPS)} have no graph op; those with one: {sorted(GRAPH_OPS)}"
        )
    token = _IN_GRAPH.set(names)
    try:
        yield
    finally:
        _IN_GRAPH.reset(token)


def all_in_graph():
    """Within: every fused function goes into a graph captured as perfloop's op (nn.rewrite's
    captures, which run eager: the fused modules inside keep their kernels)."""
    return in_graph(GRAPH_OPS)


@torch.compiler.assume_constant_result
def taken(name: str) -> bool:
    """Whether fused function `name` goes into the graph being traced (read once, at tracing)."""
    return name in _IN_GRAPH.get()


# ------------------------------------------------------------------ cross entropy


@torch.library.custom_op("perfloop::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels("cross_entropy").forward_parts(logits, target, ignore_index)


@_cross_entropy.register_fake
def _(logits, target, ignore_index):
    f32 = torch.float32
    loss, lse = logits.new_empty((), dtype=f32), logits.new_empty(logits.shape[:1], dtype=f32)
    return loss, lse, target.new_empty(())


@torch.library.custom_op("perfloop::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(
    logits: Tensor, target: Tensor, lse: Tensor, n_valid: Tensor, dloss: Tensor, ignore_index: int
) -> Tensor:
    return _kernels("cross_entropy").backward_parts(logits, target, lse, n_valid, dloss, ignore_index)


@_cross_entropy_backward.register_fake
def _(logits, target, lse, n_valid, dloss, ignore_index):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, target, ignore_index = inputs
    ctx.save_for_backward(logits, target, output[1], output[2])
    ctx.ignore_index = ignore_index


def _ce_backward(ctx, dloss, _dlse, _dn):
    logits, target, lse, n_valid = ctx.saved_tensors
    return _cross_entropy_backward(logits, target, lse, n_valid, dloss, ctx.ignore_index), None, None


_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Mean cross entropy (fp32) of (N, C) logits, as one node of a compiled graph."""
    return _cross_entropy(logits, target, ignore_index)[0]


# ------------------------------------------------------------------ linear + cross entropy


@torch.library.custom_op("perfloop::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    h: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    kernels = _kernels("linear_cross_entropy")
    chunk = chunk or kernels.chunk_rows(h.shape[0], weight.shape[0], h.element_size())
    return kernels.forward_parts(h, weight, target, ignore_index, chunk)


@_linear_cross_entropy.register_fake
def _(h, weight, target, ignore_index, chunk):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape), weight.new_empty(weight.shape)


def _lce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _lce_backward(ctx, dloss, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    return dh * dloss.to(dh.dtype), dw * dloss.to(dw.dtype), None, None, None


_linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(h: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk: int) -> Tensor:
    """Mean cross entropy (fp32) of h @ weight.T, the logits never whole, as one graph node."""
    return _linear_cross_entropy(h, weight, target, ignore_index, chunk)[0]


# ------------------------------------------------------------------ layer norm, RMS norm


@torch.library.custom_op("perfloop::norm", mutates_args=())
def _norm_op(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> tuple[Tensor, Tensor]:
    return _kernels("layernorm").forward_parts(x, weight, bias, eps, rms)


@_norm_op.register_fake
def _(x, weight, bias, eps, rms):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape), x.new_empty((2, rows), dtype=torch.float32)


@torch.library.custom_op("perfloop::norm_backward", mutates_args=())
def _norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, stats: Tensor, has_bias: bool, rms: bool
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _kernels("layernorm").backward_parts(dy, x, weight, stats, has_bias, rms)
    return dx, dw, db.clone() if db is not None else dw.new_empty(0)  # dw, db: one storage, two outputs


@_norm_backward.register_fake
def _(dy, x, weight, stats, has_bias, rms):
    db = weight.new_empty(weight.shape if has_bias else 0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _eps, rms = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_bias, ctx.rms = bias is not None, rms


def _norm_grad(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw, db = _norm_backward(dy, x, weight, stats, ctx.has_bias, ctx.rms)
    return dx, dw, (db if ctx.has_bias else None), None, None


_norm_op.register_autograd(_norm_grad, setup_context=_norm_setup)


def norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """LayerNorm (or RMSNorm) of x over its last dimension, as one node of a compiled graph."""
    return _norm_op(x, weight, bias, eps, rms)[0]


# ------------------------------------------------------------------ what a compiled call takes


def _here(x: Tensor) -> bool:
    from perfloop.ops.base import interpreting

    return _TRITON and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def graph_cross_entropy(x, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Under torch.compile: F.cross_entropy as perfloop's graph node, or None where it does not
    take the call (then torch's own goes into the graph)."""
    if not (
        taken("cross_entropy")
        and isinstance(target, Tensor)
        and _here(x)
        and weight is None
        and reduction == "mean"
        and not label_smoothing
        and x.ndim == 2
        and target.ndim == 1
        and target.dtype == torch.int64
        and x.dtype in _FLOATS
    ):
        return None
    loss = cross_entropy(x, target, ignore_index)
    return loss if autocast_on(x.device.type) else loss.to(x.dtype)


def graph_linear_cross_entropy(h, weight, target, ignore_index):
    """Under torch.compile: LinearCrossEntropy's loss as perfloop's graph node (h and weight in
    one dtype, autocast already applied), or None."""
    if not (
        taken("linear_cross_entropy")
        and _here(h)
        and h.dtype == weight.dtype
        and target.dtype == torch.int64
        and h.dtype in _FLOATS
    ):
        return None
    with torch.autocast(h.device.type, enabled=False):
        return linear_cross_entropy(h, weight, target, ignore_index, 0)  # 0: the op picks the chunk


def graph_norm(name: str, x, normalized_shape, weight, bias, eps, rms: bool):
    """Under torch.compile: F.layer_norm / F.rms_norm as perfloop's graph node, or None."""
    if not (
        taken(name)
        and isinstance(x, Tensor)
        and _here(x)
        and weight is not None
        and x.ndim
        and tuple(normalized_shape) == tuple(x.shape[-1:])
        and weight.shape == x.shape[-1:]
        and x.dtype in _FLOATS
        and x.shape[-1] <= MAX_N
    ):
        return None
    x = _autocast_fp32(x)
    return norm(x, weight, bias, eps if eps is not None else torch.finfo(x.dtype).eps, rms)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
