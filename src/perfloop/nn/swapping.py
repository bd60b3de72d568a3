"""What patch, its measuring and its plan share: where a model's swappable modules are, the
step run on the example batch, and a swap made or undone by name."""

from __future__ import annotations

import torch.nn as nn

from perfloop.nn import functional as _functional
from perfloop.nn import heads as _heads
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
    if loss_fn is not None:
        return loss_fn(model, batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


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
        _functional.reroute(m, sites)
        out.append(m)
    return out


def restore_forward(module: nn.Module) -> None:
    _functional.restore(module)
    _rewrite.restore(module)
    _heads.unmerge(module)
