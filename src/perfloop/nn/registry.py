"""The fused ops perfloop.nn offers, one row each, and the one choice every one of them makes.

A row names the op everywhere it is named: its function in perfloop.nn.functional (torch's
functional call it replaces, where there is one), its folder in perfloop.ops, the torch module
class it replaces, the kind the analysis calls its chains, and whether a torch.library op puts it
into a compiled graph. pl.patch, the rerouted call sites and the compiled graphs read this table;
a new fused op is one row here.

`dispatch` is the choice: under torch.compile the op's graph op where it takes the call, else
torch's own (Inductor fuses that); where the kernels cannot take the call (a CPU tensor without
the Triton interpreter, an option or dtype they lack), torch's own; else the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class FusedOp:
    name: str  # its function in perfloop.nn.functional
    op: str  # its folder in perfloop.ops
    module: str | None = None  # the torch module class it replaces
    kind: str | None = None  # what the analysis names its chains (patterns.chain_kind)
    call_site: bool = False  # `F.<name>(...)` in a forward is a call pl.patch reroutes
    gate_of: str | None = None  # a gate: this activation of a, times b, written out
    graph_op: bool = False  # a torch.library op (nn.compiled) puts it into a compiled graph
    in_graph: bool = False  # ... as shipped (nn.compiled's docstring says why only the head)


OPS = (
    FusedOp("layer_norm", "layernorm", "LayerNorm", "normalization", call_site=True, graph_op=True),
    FusedOp("rms_norm", "rmsnorm", "RMSNorm", "normalization", call_site=True, graph_op=True),
    FusedOp(
        "cross_entropy", "cross_entropy", "CrossEntropyLoss", "cross_entropy", call_site=True, graph_op=True
    ),
    FusedOp("gelu", "gelu", "GELU", "gelu", call_site=True),
    FusedOp("silu_gate", "swiglu", gate_of="silu"),
    FusedOp("gelu_gate", "geglu", gate_of="gelu"),
    FusedOp(
        "linear_cross_entropy", "linear_cross_entropy", "LinearCrossEntropy", graph_op=True, in_graph=True
    ),
)
_BY_NAME = {r.name: r for r in OPS}

CALLS = tuple(r.name for r in OPS if r.call_site)  # torch's functional calls rerouted
GATES = {r.gate_of: r.name for r in OPS if r.gate_of}  # activation -> its gate
GRAPH_OPS = frozenset(r.name for r in OPS if r.graph_op)
DEFAULT_IN_GRAPH = frozenset(r.name for r in OPS if r.in_graph)


def get(name: str) -> FusedOp:
    """The row of a fused function (`layer_norm`, `silu_gate`, ...)."""
    return _BY_NAME[name]


def by_module(class_name: str) -> FusedOp | None:
    """The row of the op that replaces a torch module class (or perfloop's own of that name)."""
    return next((r for r in OPS if r.module == class_name), None)


def kinds() -> dict[str, tuple[str, ...]]:
    """Each chain kind -> the functional calls of that kind."""
    out: dict[str, tuple[str, ...]] = {}
    for r in OPS:
        if r.kind and r.call_site:
            out[r.kind] = (*out.get(r.kind, ()), r.name)
    return out


def dispatch(
    *,
    why: Callable[[], str | None],
    kernel: Callable[[], T],
    fallback: Callable[[str], T],
    graph: Callable[[], T | None] | None = None,
    compiling: bool | None = None,
) -> T:
    """The call of one fused op: `graph()` under torch.compile (None: it does not take the call),
    `fallback(why)` where the kernels cannot take it (`why()` says why; "compiling" under
    torch.compile), else `kernel()`. `compiling`: whether a graph is being traced (default: whether
    torch.compile is tracing)."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        y = graph() if graph is not None else None
        return fallback("compiling") if y is None else y
    reason = why()
    return fallback(reason) if reason else kernel()
