"""Drop-in modules backed by the fused Triton kernels of the op library: the constructors,
parameters and state-dict keys of the torch modules they replace (they are subclasses), so a
checkpoint loads either way. Where a kernel cannot take a call (a CPU tensor without the Triton
interpreter, a shape or option it does not support) the torch module's own forward runs, with
a warning the first time."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from perfloop.ops.base import interpreting

_WARNED: set = set()


def _fallback(module: nn.Module, why: str) -> None:
    key = (type(module).__name__, why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"perfloop.nn.{type(module).__name__}: {why}; running torch's own forward instead",
                      RuntimeWarning, stacklevel=3)  # fmt: skip


def _kernel_here(x: torch.Tensor) -> str | None:
    if x.is_cuda or (x.device.type == "cpu" and interpreting()):
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    return f"a {x.device.type} tensor (the kernels run on a GPU, or on the CPU with TRITON_INTERPRET=1)"


def _autocast_fp32(x: torch.Tensor) -> torch.Tensor:
    """Under autocast torch computes norms and the loss in fp32 and returns fp32: so do these."""
    if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float32:
        return x.float()
    return x


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm over the last dimension, one fused kernel forward and one backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from perfloop.ops.layernorm.triton_impl import norm, supported

        why = _kernel_here(x)
        if why is None and (len(self.normalized_shape) != 1 or self.weight is None):
            why = "a normalized shape of more than one dim, or no weight"
        if why is None:
            why = supported(x, self.weight)
        if why:
            _fallback(self, why)
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return norm(_autocast_fp32(x), self.weight, self.bias, self.eps, rms=False)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over the last dimension, one fused kernel forward and one backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from perfloop.ops.layernorm.triton_impl import norm, supported

        why = _kernel_here(x)
        if why is None and (len(self.normalized_shape) != 1 or self.weight is None):
            why = "a normalized shape of more than one dim, or no weight"
        if why is None:
            why = supported(x, self.weight)
        if why:
            _fallback(self, why)
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            x = _autocast_fp32(x)
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return norm(x, self.weight, None, eps, rms=True)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss for (N, C) logits and class indices, mean reduction: the loss in one
    read of the logits, their gradient in one more read and one write, in the logits' dtype."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from perfloop.ops.cross_entropy.triton_impl import CrossEntropyFunction, supported

        why = _kernel_here(logits) or why_not(self) or supported(logits, target)
        if why:
            _fallback(self, why)
            return super().forward(logits, target)
        with torch.autocast(logits.device.type, enabled=False):
            loss = CrossEntropyFunction.apply(logits, target, self.ignore_index)  # fp32
        return loss if torch.is_autocast_enabled(logits.device.type) else loss.to(logits.dtype)


def why_not(module: nn.Module) -> str | None:
    """Why a candidate's configuration has no kernel (None: it has one)."""
    shape = getattr(module, "normalized_shape", (0,))
    if len(shape) != 1:
        return f"normalized over {len(shape)} dims (the kernels normalize the last one)"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is None:
        return "no weight (elementwise_affine=False)"
    if isinstance(module, nn.CrossEntropyLoss) and (module.weight is not None or module.label_smoothing
                                                   or module.reduction != "mean"):  # fmt: skip
        return "class weights, label smoothing or a reduction other than mean"
    return None


def fused_like(module: nn.Module) -> nn.Module | None:
    """The fused module for `module` (same configuration, sharing its parameters), or None."""
    if type(module) is nn.LayerNorm:
        new = LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                        bias=module.bias is not None, device="meta")  # fmt: skip
    elif type(module) is nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    elif type(module) is nn.CrossEntropyLoss:
        new = CrossEntropyLoss(module.weight, ignore_index=module.ignore_index, reduction=module.reduction,
                               label_smoothing=module.label_smoothing)  # fmt: skip
        return new
    elif _llama_rmsnorm(module):
        new = RMSNorm(module.weight.shape, getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)),
                      device="meta")  # fmt: skip
    else:
        return None
    for name, p in module.named_parameters(recurse=False):
        setattr(new, name, p)
    new.train(module.training)
    return new


def _llama_rmsnorm(module: nn.Module) -> bool:
    """A Llama-style RMSNorm (Hugging Face's LlamaRMSNorm and its copies): a class named
    ...RMSNorm with one 1-D weight and an epsilon, not torch's own."""
    params = dict(module.named_parameters(recurse=False))
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, nn.RMSNorm)
            and set(params) == {"weight"} and params["weight"].ndim == 1
            and (hasattr(module, "variance_epsilon") or hasattr(module, "eps")))  # fmt: skip
