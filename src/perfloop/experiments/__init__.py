"""The lecture's experiments, one command each: `perfloop experiment NAME`."""

from __future__ import annotations

from collections.abc import Callable

_EXPERIMENTS: dict[str, tuple[str, str]] = {}


def register(name: str, doc: str, loader: str) -> None:
    _EXPERIMENTS[name] = (doc, loader)


def describe() -> dict[str, str]:
    return {n: d for n, (d, _) in _EXPERIMENTS.items()}


def get(name: str) -> Callable:
    if name not in _EXPERIMENTS:
        valid = ", ".join(_EXPERIMENTS) or "none yet"
        raise KeyError(f"experiment: no experiment named {name!r}; valid: {valid}")
    import importlib

    mod, _, attr = _EXPERIMENTS[name][1].partition(":")
    return getattr(importlib.import_module(mod), attr)
