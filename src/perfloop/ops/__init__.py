"""The op library: each op in its own folder, every way of writing it side by side.

>>> import perfloop as pl
>>> pl.ops.names()[:5]
['attention', 'cross_entropy', 'geglu', 'gelu', 'layernorm']
>>> op = pl.ops.get("gelu")
>>> sorted(op.variants)
['builtin', 'compiled', 'cuda', 'naive', 'triton']
"""

from __future__ import annotations

import contextlib
import importlib

from perfloop.ops.base import CheckFailed, Op, Unavailable, Variant, dtype_name, parse_dtype

_OP_MODULES = (
    "gelu",
    "softmax",
    "rowsum",
    "matmul_relu",
    "attention",
    "layernorm",
    "rmsnorm",
    "cross_entropy",
    "swiglu",
    "geglu",
    "linear_cross_entropy",
    "rope",
)
_REGISTRY: dict[str, Op] = {}


def _load() -> dict[str, Op]:
    if not _REGISTRY:
        for name in _OP_MODULES:
            mod = importlib.import_module(f"perfloop.ops.{name}")
            _REGISTRY[mod.OP.name] = mod.OP
    return _REGISTRY


def names() -> list[str]:
    return sorted(_load())


def get(name: str) -> Op:
    ops = _load()
    if name not in ops:
        raise KeyError(f"op: no op named {name!r}; valid: {', '.join(sorted(ops))}")
    return ops[name]


__all__ = [
    "CheckFailed",
    "Op",
    "Unavailable",
    "Variant",
    "dtype_name",
    "get",
    "names",
    "parse_dtype",
]


@contextlib.contextmanager
def temporary_variant(op: Op, name: str, fn):
    """Register `fn` as a variant of `op` for the duration of a with-block (tests, experiments)."""
    op.add(Variant(name, fn=fn))
    try:
        yield name
    finally:
        op.variants.pop(name, None)
