"""What patch, its measuring and its plan share: where a model's swappable modules are, the
step run on the example batch, and a swap made or undone by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn as nn

from perfloop.nn import heads as _heads
from perfloop.nn import loss_function as _loss_function
from perfloop.nn import reroute as _reroute
from perfloop.nn import rewrite as _rewrite
from perfloop.nn.modules import fused_like


def candidates(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        fused = fused_like(m)
        if fused is not None:
            out.append((name or type(m).__name__, m, fused))
    return out


def run_step(model, batch, loss_fn):
    """The step on the batch: `loss_fn(model, batch)`, or the model called as its docs call it
    with such a batch (a dict or BatchEncoding by keywords, a tuple or list by position, anything
    else as the one argument)."""
    if loss_fn is not None:
        return loss_fn(model, batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def step_loss(out) -> tuple[torch.Tensor | None, str]:
    """(the scalar a step's output gives to backpropagate, "") or (None, why there is none): a
    float tensor (its mean where not a scalar); the `loss` of a ModelOutput, dataclass or dict,
    else a ModelOutput's or dict's `logits`; a tuple's or list's first element."""
    if isinstance(out, torch.Tensor):
        if not out.is_floating_point() or out.numel() == 0:
            return None, f"the step gave a {out.dtype} tensor of shape {tuple(out.shape)}, no loss"
        return (out if out.ndim == 0 else out.float().mean()), ""
    if isinstance(out, (tuple, list)) and out:
        return step_loss(out[0])
    fields = out if isinstance(out, Mapping) else vars(out) if dataclasses.is_dataclass(out) else None
    for key in ("loss", "logits"):
        if fields is not None and fields.get(key) is not None:
            return step_loss(fields[key])
    return None, (
        f"the step gave a {type(out).__name__}, with no loss in it (a float tensor, a tuple whose first "
        "element is one, or a ModelOutput, dataclass or dict with a loss or logits): pass "
        "loss_fn=lambda m, b: ... that returns the loss"
    )


def named(model: nn.Module, name: str) -> nn.Module:
    """The submodule of that name; the model itself under its class's name (as the report names it)."""
    return model if name == type(model).__name__ and not hasattr(model, name) else model.get_submodule(name)


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def route_sites(model: nn.Module, swaps) -> list:
    """Reroute the modules of these (replaced) functional swaps; the modules rerouted."""
    by_module: dict = {}
    for s in swaps:
        if s.site is not None and s.replaced:
            by_module.setdefault(s.site[0], {}).setdefault(s.site[1], set()).add(s.site[2])
    out = []
    for name, sites in by_module.items():
        m = model.get_submodule(name)
        _reroute.reroute(m, sites)
        out.append(m)
    return out


def restore_forward(module: nn.Module) -> None:
    _reroute.restore(module)
    _loss_function.restore(module)
    _rewrite.restore(module)
    _heads.unmerge(module)
