"""Drop-in modules backed by the fused Triton kernels of the op library: the constructors,
parameters and state-dict keys of the torch modules they replace (they are subclasses), so a
checkpoint loads either way. Where a kernel cannot take a call (a CPU tensor without the Triton
interpreter, a shape or option it does not support) the torch module's own forward runs, with
a warning the first time; under torch.compile too (silently): Inductor fuses the module
itself, and a Python autograd function in its graph would only break it."""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from perfloop.nn.registry import dispatch
from perfloop.ops.base import TRITON_MISSING, autocast_on, interpreting, triton_installed
from perfloop.ops.base import autocast_fp32 as _autocast_fp32

_WARNED: set = set()
# while pl.patch checks a module (recording_fallbacks): its fallbacks go to that list, unsaid
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("perfloop_fallbacks", default=None)


@contextlib.contextmanager
def recording_fallbacks():
    """Within: a fused module that falls back to torch adds why to the list yielded, and warns
    nothing (pl.patch's check says it in its report)."""
    said: list[str] = []
    token = _RECORDING.set(said)
    try:
        yield said
    finally:
        _RECORDING.reset(token)


def _fallback(module: nn.Module, why: str) -> None:
    if why == "compiling":
        return
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(why)
        return
    name = module.__name__ if isinstance(module, type) else type(module).__name__
    if (name, why) not in _WARNED:
        _WARNED.add((name, why))
        warnings.warn(
            f"perfloop.nn.{name}: {why}; running torch's own forward instead", RuntimeWarning, stacklevel=3
        )


def kernel_here(x: torch.Tensor) -> str | None:
    if x.is_cuda or (x.device.type == "cpu" and interpreting()):
        return None if triton_installed() else TRITON_MISSING
    return f"a {x.device.type} tensor (the kernels run on a GPU, or on the CPU with TRITON_INTERPRET=1)"


def _why_no_kernel(module: nn.Module, x: torch.Tensor) -> str | None:
    """Why the kernels cannot take this call (None: they can); the answer is kept per device,
    dtype and row length, so a step pays for the checks once."""
    dev = x.device
    key = (dev, x.dtype, x.shape[-1], autocast_on(dev.type))
    return _cached_why(module, key, lambda: _norm_supported(_autocast_fp32(x), module.weight), x)


def _norm_supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    from perfloop.ops.layernorm.triton_impl import supported  # on a miss only: Triton loads late

    return supported(x, weight)


def _cached_why(module: nn.Module, key, call_check, x: torch.Tensor) -> str | None:
    """Why no kernel takes this call: the checks for this key, run once per module and key."""
    cache = module.__dict__.get("_perfloop_why")
    if cache is not None and key in cache:  # the common case: this key seen before
        return cache[key]
    cache = module.__dict__.setdefault("_perfloop_why", {})
    cache[key] = kernel_here(x) or why_not(module) or call_check()
    return cache[key]


class _FusedNorm:
    """The forward both norms share: the kernels where they fit, torch's forward where not."""

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = isinstance(self, nn.RMSNorm)
        bias = None if rms else self.bias

        def graph():
            from perfloop.nn.compiled import graph_norm

            name = "rms_norm" if rms else "layer_norm"
            return graph_norm(name, x, self.normalized_shape, self.weight, bias, self.eps, rms)

        def kernel():
            from perfloop.ops.layernorm.triton_impl import fused_norm

            y = _autocast_fp32(x)
            eps = self.eps if self.eps is not None else torch.finfo(y.dtype).eps
            # no autocast switch around it: the function makes no op autocast would cast
            return fused_norm(y, self.weight, bias, eps, rms)

        return dispatch(
            graph=graph, why=lambda: _why_no_kernel(self, x), kernel=kernel, fallback=self._torch(x)
        )

    def _torch(self, x: torch.Tensor):
        def fallback(why: str) -> torch.Tensor:
            _fallback(self, why)
            return super(_FusedNorm, self).forward(x)

        return fallback


class LayerNorm(_FusedNorm, nn.LayerNorm):
    """nn.LayerNorm over the last dimension, one fused kernel forward and one backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._fused_forward(input)


class RMSNorm(_FusedNorm, nn.RMSNorm):
    """nn.RMSNorm over the last dimension, one fused kernel forward and one backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused_forward(x)


class GELU(nn.GELU):
    """nn.GELU, either form (exact erf, torch's default, or approximate="tanh", GPT-2's): one fused
    kernel forward, one backward, the slope recomputed from x. `autocast_fp32`: under autocast the
    output in fp32, as a GELU written out with torch.pow (on autocast's fp32 list) gives it."""

    autocast_fp32 = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input
        ok = (torch.float32, torch.float16, torch.bfloat16)

        def kernel():
            from perfloop.ops.gelu.triton_impl import gelu

            out_dtype = torch.float32 if self.autocast_fp32 and autocast_on(x.device.type) else None
            y = gelu(x if x.ndim else x.reshape(1), approximate=self.approximate, out_dtype=out_dtype)
            return y if x.ndim else y.reshape(())

        def fallback(why: str) -> torch.Tensor:
            _fallback(self, why)
            return super(GELU, self).forward(x)

        return dispatch(
            why=lambda: _cached_why(
                self, (x.device, x.dtype), lambda: None if x.dtype in ok else f"dtype {x.dtype}", x
            ),
            kernel=kernel,
            fallback=fallback,
        )


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss for (N, C) logits and class indices, mean reduction: the loss in one
    read of the logits, their gradient in one more read and one write, in the logits' dtype."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = input

        def graph():
            from perfloop.nn.compiled import graph_cross_entropy

            return graph_cross_entropy(
                logits, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing
            )

        def why():
            from perfloop.ops.cross_entropy.triton_impl import supported

            key = (logits.device, logits.dtype, logits.ndim, target.dtype)
            return _cached_why(self, key, lambda: supported(logits, target), logits)

        def kernel():
            from perfloop.ops.cross_entropy.triton_impl import fused_cross_entropy

            # under autocast torch's loss is fp32; else the logits' dtype (the kernel writes it so)
            dtype = torch.float32 if autocast_on(logits.device.type) else logits.dtype
            return fused_cross_entropy(logits, target, self.ignore_index, dtype)

        def fallback(why: str) -> torch.Tensor:
            _fallback(self, why)
            return super(CrossEntropyLoss, self).forward(logits, target)

        return dispatch(graph=graph, why=why, kernel=kernel, fallback=fallback)


class SwiGLU(nn.Module):
    """silu(a) * b, the gate of a Llama-style MLP (`SwiGLU()(gate_proj(x), up_proj(x))`): one
    fused kernel forward and one backward, where torch makes four and six."""

    gelu = False

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        def kernel():
            from perfloop.ops.swiglu.triton_impl import geglu, swiglu

            return (geglu if self.gelu else swiglu)(a, b)

        def fallback(why: str) -> torch.Tensor:
            _fallback(self, why)
            return (F.gelu(a, approximate="tanh") if self.gelu else F.silu(a)) * b

        def why():
            same = a.shape == b.shape and a.dtype == b.dtype
            return kernel_here(a) or (None if same else "operands of different shapes or dtypes")

        return dispatch(why=why, kernel=kernel, fallback=fallback)


class GeGLU(SwiGLU):
    """gelu(a) * b (tanh form), the gate of GeGLU MLPs: one fused kernel each way."""

    gelu = True


class RoPE(nn.Module):
    """Rotary position embeddings on a query or key tensor x (..., T, D): each pair rotated by
    its position's angle, cos and sin (T, D/2) -- the pairs the two halves (`rotate_half`,
    Hugging Face's Llama), or neighbours with `interleaved=True` (Meta's complex form). One fused
    kernel forward and one backward, the math in fp32, out in x's dtype."""

    def __init__(self, interleaved: bool = False) -> None:
        super().__init__()
        if not isinstance(interleaved, bool):
            raise ValueError(f"interleaved: True (neighbouring pairs) or False (halves), got {interleaved!r}")
        self.interleaved = interleaved

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from perfloop.ops.rope import validate
        from perfloop.ops.rope.torch_impl import fp32
        from perfloop.ops.rope.triton_impl import rope

        validate(x, cos, sin, self.interleaved)

        def fallback(why: str) -> torch.Tensor:
            _fallback(self, why)
            return fp32(x, cos, sin, self.interleaved)

        return dispatch(
            why=lambda: kernel_here(x), kernel=lambda: rope(x, cos, sin, self.interleaved), fallback=fallback
        )

    def extra_repr(self) -> str:
        return f"interleaved={self.interleaved}"


class LinearCrossEntropy(nn.Module):
    """A language model's output projection and its loss in one: `weight` as nn.Linear(in, out,
    bias=False) keeps it (the same state-dict key, so a head's checkpoint loads), forward(hidden,
    target) gives the mean cross entropy without ever holding the whole logits (chunked over
    tokens). Under autocast the matmuls run in its dtype, the loss in fp32."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ignore_index: int = -100,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.ignore_index = in_features, out_features, ignore_index
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.weight, target, self.ignore_index, self)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    owner=None,
    graph: bool | None = None,
) -> torch.Tensor:
    """The mean cross entropy of hidden @ weight.T against target (class indices), the logits
    never held whole: LinearCrossEntropy's forward, and what nn.head puts into a captured graph.
    `graph`: traced into a compiled graph (default: whether torch.compile is tracing), where it
    is perfloop's graph op. Where no kernel takes the call, torch's own (said once, as from
    `owner`)."""
    h, t, w = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), weight
    dev = h.device.type
    if autocast_on(dev):
        dtype = torch.get_autocast_dtype(dev)
        h, w = h.to(dtype), w.to(dtype)

    def graph_op():
        from perfloop.nn.compiled import graph_linear_cross_entropy

        return graph_linear_cross_entropy(h, w, t, ignore_index)

    def why():
        if t.dtype != torch.int64:
            return kernel_here(h) or f"targets of dtype {t.dtype} (class indices in int64 only)"
        return kernel_here(h) or (
            None if h.dtype == w.dtype else "hidden states and weight in different dtypes"
        )

    def kernel():
        from perfloop.ops.linear_cross_entropy.triton_impl import LinearCrossEntropyFunction, chunk_rows

        with torch.autocast(dev, enabled=False):
            chunk = chunk_rows(h.shape[0], w.shape[0], h.element_size())
            return LinearCrossEntropyFunction.apply(h, w, t, ignore_index, chunk)

    def fallback(reason: str) -> torch.Tensor:
        _fallback(owner if owner is not None else LinearCrossEntropy, reason)
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=ignore_index)

    return dispatch(graph=graph_op, why=why, kernel=kernel, fallback=fallback, compiling=graph)


def why_not_norm_options(normalized_shape, weight) -> str | None:
    """Why a norm so configured has no kernel (the module's and F.layer_norm/rms_norm's)."""
    if len(tuple(normalized_shape)) != 1:
        return f"normalized over {len(tuple(normalized_shape))} dims (the kernels normalize the last one)"
    if weight is None:
        return "no weight (elementwise_affine=False)"
    return None


def why_not_loss_options(weight, label_smoothing, reduction) -> str | None:
    """Why a cross entropy so configured has no kernel (the module's and F.cross_entropy's)."""
    if weight is not None or label_smoothing or reduction != "mean":
        return "class weights, label smoothing or a reduction other than mean"
    return None


def why_not_gelu_options(approximate: str) -> str | None:
    if approximate not in ("tanh", "none"):
        return f"approximate={approximate!r} (torch's forms are 'none' and 'tanh')"
    return None


def why_not(module: nn.Module) -> str | None:
    """Why a candidate's configuration has no kernel (None: it has one)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return why_not_norm_options(module.normalized_shape, module.weight)
    if isinstance(module, nn.GELU):
        return why_not_gelu_options(module.approximate)
    if isinstance(module, nn.CrossEntropyLoss):
        return why_not_loss_options(module.weight, module.label_smoothing, module.reduction)
    return None


def fused_like(module: nn.Module) -> nn.Module | None:
    """The fused module for `module` (same configuration, sharing its parameters), or None."""
    if type(module) is nn.LayerNorm:
        new = LayerNorm(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
        )
    elif type(module) is nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    elif type(module) is nn.GELU:
        return GELU(module.approximate)
    elif form := written_gelu(module):
        return GELU(form)
    elif type(module) is nn.CrossEntropyLoss:
        new = CrossEntropyLoss(
            module.weight,
            ignore_index=module.ignore_index,
            reduction=module.reduction,
            label_smoothing=module.label_smoothing,
        )
        return new
    elif _llama_rmsnorm(module):
        new = RMSNorm(
            module.weight.shape,
            getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)),
            device="meta",
        )
    else:
        return None
    for name, p in module.named_parameters(recurse=False):
        setattr(new, name, p)
    new.train(module.training)
    return new


def written_gelu(module: nn.Module) -> str | None:
    """The form of GELU ("tanh" or "none") a model's own GELU module writes out op by op
    (minGPT's NewGELU: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))), found by running
    it in float64 on a probe: a class named ...GELU..., not torch's, with no parameters,
    buffers or submodules. None where it is not one, or computes neither form."""
    if (
        type(module).__module__.startswith("torch.")
        or "gelu" not in type(module).__name__.lower()
        or next(module.parameters(), None) is not None
        or next(module.buffers(), None) is not None
        or next(module.children(), None) is not None
    ):
        return None
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = module(probe)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != probe.shape or y.dtype != probe.dtype:
        return None
    for form in ("tanh", "none"):
        if torch.allclose(y, F.gelu(probe, approximate=form), rtol=1e-10, atol=1e-12):
            return form
    return None


def _llama_rmsnorm(module: nn.Module) -> bool:
    """A Llama-style RMSNorm (Hugging Face's LlamaRMSNorm and its copies): a class named
    ...RMSNorm with one 1-D weight and an epsilon, not torch's own."""
    params = dict(module.named_parameters(recurse=False))
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, nn.RMSNorm)
        and set(params) == {"weight"}
        and params["weight"].ndim == 1
        and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
    )
