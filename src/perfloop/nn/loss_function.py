"""A model's `loss_function` (Hugging Face's: `ForCausalLMLoss` -> `fixed_cross_entropy` ->
`nn.functional.cross_entropy`), run with its cross entropy fused: the same function, its code
unchanged, with the names by which it and the functions it calls reach `F.cross_entropy` (`nn`,
`F`, the bare name) bound to ones that give perfloop's fused cross entropy instead.

pl.patch records the loss function's first call and its cross entropy's, checks the fused one
on that call like any swap, and sets it as the model's `loss_function` (the property's setter:
an instance attribute); `restore` puts the class's back.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch
import torch.nn.functional as F

from perfloop.nn import verify as _verify

KIND = "loss function"


class _Namespace:
    """A module as the rebuilt code sees it: some names given otherwise, the rest its own."""

    def __init__(self, base, **given):
        self._base, self._given = base, given

    def __getattr__(self, name):
        return self._given[name] if name in self._given else getattr(self._base, name)


class _Globals(dict):
    """A function's globals with some names bound otherwise; the others read live."""

    def __init__(self, base: dict, bound: dict):
        super().__init__(bound)
        self.base = base

    def __missing__(self, key):
        return self.base[key]  # KeyError: Python goes on to the builtins


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def with_cross_entropy(fn, cross_entropy, depth: int = 2):
    """fn with its calls of F.cross_entropy (and those of the functions it calls, `depth` levels
    down) sent to `cross_entropy`; None where none reach it."""
    names = _names(fn.__code__)
    bound, reaches = {}, False
    for name in names:
        v = fn.__globals__.get(name)
        if v is torch.nn or v is F:  # `nn.functional.cross_entropy`, `F.cross_entropy`
            functional = _Namespace(F, cross_entropy=cross_entropy)
            bound[name] = _Namespace(torch.nn, functional=functional) if v is torch.nn else functional
            reaches = reaches or "cross_entropy" in names
        elif v is F.cross_entropy:
            bound[name], reaches = cross_entropy, True
        elif depth and isinstance(v, types.FunctionType) and not v.__module__.startswith("torch"):
            inner = with_cross_entropy(v, cross_entropy, depth - 1)
            if inner is not None:
                bound[name], reaches = inner, True
    if not reaches:
        return None
    out = types.FunctionType(
        fn.__code__, _Globals(fn.__globals__, bound), fn.__name__, fn.__defaults__, fn.__closure__
    )
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


class FusedLoss:
    """The model's loss function with its cross entropy fused (`original`: the function)."""

    def __init__(self, original):
        from perfloop.nn.functional import FUSED

        self.original = original
        self.fn = with_cross_entropy(original, FUSED["cross_entropy"])

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def find(model: torch.nn.Module):
    """The model's loss function where it is a `loss_function` property (Hugging Face's
    PreTrainedModel) giving a Python function that reaches F.cross_entropy; else None."""
    if not isinstance(inspect.getattr_static(type(model), "loss_function", None), property):
        return None
    with contextlib.suppress(Exception):
        fn = model.loss_function
        if isinstance(fn, types.FunctionType) and with_cross_entropy(fn, F.cross_entropy) is not None:
            return fn
    return None


class Recording:
    """The loss function's first call and its cross entropy's, as _verify.recorded gives them."""

    def __init__(self):
        self.call = None
        self.cross_entropy = None


@contextlib.contextmanager
def recording(model: torch.nn.Module, fn):
    """Within: the model's loss function records its first call and its cross entropy's (torch's
    computing); after: the model's loss function as it was."""
    rec = Recording()

    def cross_entropy(*args, **kwargs):
        if rec.cross_entropy is None:
            rec.cross_entropy = _verify.recorded(args, kwargs)
        return F.cross_entropy(*args, **kwargs)

    inner = with_cross_entropy(fn, cross_entropy)

    def loss(*args, **kwargs):
        if rec.call is None:
            rec.call = _verify.recorded(args, kwargs)
        return inner(*args, **kwargs)

    had = model.__dict__.get("_loss_function", _MISSING)
    model.loss_function = loss
    try:
        yield rec
    finally:
        _put(model, had)


_MISSING = object()


def _put(model, had) -> None:
    if had is _MISSING:
        model.__dict__.pop("_loss_function", None)
    else:
        model.loss_function = had


def apply(model: torch.nn.Module) -> FusedLoss:
    fused = FusedLoss(find(model))
    fused.had = model.__dict__.get("_loss_function", _MISSING)
    model.loss_function = fused
    return fused


def restore(model: torch.nn.Module) -> None:
    fused = model.__dict__.get("_loss_function")
    if isinstance(fused, FusedLoss):
        _put(model, fused.had)
