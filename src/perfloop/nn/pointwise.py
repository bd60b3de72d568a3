"""GELU written out op by op inline (nanoGPT's early `new_gelu(x)`, GPT-NeoX's `gelu_new`, an
erf form in a forward), found in a captured graph (nn.rewrite's) and replaced by the fused GELU.

Found by what it computes, not by how it is spelled: around each `tanh` or `erf`, the largest run
of elementwise ops whose only tensor input is one x is evaluated on a float64 probe; where that
function of x is GELU (either form) to 1e-10, the run is replaced by one fused call, written in
the dtype the run gave (fp32 where autocast promoted it).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from perfloop.nn.modules import kernel_here

GELU = "GELU written out"

_ANCHORS = (torch.tanh, torch.erf, torch.special.erf, "tanh", "erf")
_POINTWISE = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.pow, torch.neg, torch.tanh, torch.erf,
    torch.special.erf, torch.sqrt, torch.rsqrt, torch.exp,
    "mul", "add", "sub", "div", "pow", "neg", "tanh", "erf", "sqrt", "rsqrt", "exp",
}  # fmt: skip
_CASTS = ("float", "to", "type_as", "half", "bfloat16")


def _pointwise(n) -> bool:
    if not isinstance(n, Node) or n.op not in ("call_function", "call_method"):
        return False
    return n.target in _POINTWISE or (n.op == "call_method" and n.target in _CASTS)


def _tensors(n: Node) -> list:
    return [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node)]


def _cone(n: Node, region: set) -> tuple[set, set]:
    """(the pointwise ancestors of n, n included, not yet in region; the other tensors they read)."""
    out, todo, leaves = set(), [n], set()
    while todo:
        m = todo.pop()
        if m in region or m in out:
            continue
        if not _pointwise(m):
            leaves.add(m)
            continue
        out.add(m)
        todo += _tensors(m)
    return out, leaves


def _island(anchor: Node) -> list[tuple[Node, Node, list]]:
    """(x, out, nodes in graph order) of the growing runs of pointwise ops around `anchor` with
    one tensor input x, smallest first."""
    region, leaves = _cone(anchor, set())
    if len(leaves) != 1:
        return []
    (x,) = leaves
    runs, out = [], anchor
    while True:
        runs.append((x, out, set(region)))
        if len(out.users) != 1:
            break
        user = next(iter(out.users))
        if not _pointwise(user):
            break
        more, more_leaves = _cone(user, region)
        if more_leaves - {x}:
            break
        region |= more
        out = user
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    return [(x, o, sorted(r, key=order.__getitem__)) for x, o, r in runs]


def _evaluate(x: Node, nodes: list, probe: torch.Tensor) -> torch.Tensor | None:
    env = {x: probe}

    def val(a):
        if isinstance(a, Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(val(b) for b in a)
        return a

    for n in nodes:
        if n.op == "call_method" and n.target in _CASTS:
            env[n] = env[n.args[0]] if isinstance(n.args[0], Node) else n.args[0]
            continue
        args, kwargs = val(n.args), {k: val(v) for k, v in n.kwargs.items()}
        env[n] = (
            getattr(args[0], n.target)(*args[1:], **kwargs)
            if n.op == "call_method"
            else n.target(*args, **kwargs)
        )
    y = env[nodes[-1]]
    return y if isinstance(y, torch.Tensor) else None


def _form(x: Node, nodes: list) -> str | None:
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = _evaluate(x, nodes, probe)
    except Exception:  # noqa: BLE001 -- a run that cannot take the probe is not GELU
        return None
    if y is None or y.shape != probe.shape:
        return None
    for form in ("tanh", "none"):
        if torch.allclose(y, F.gelu(probe, approximate=form), rtol=1e-10, atol=1e-12):
            return form
    return None


def find(graph) -> list[tuple[Node, Node, list, str]]:
    """(x, out, nodes, form) of each GELU written out in the graph: the largest run around a
    tanh or erf that computes it."""
    found, taken = [], set()
    for anchor in [
        n for n in graph.nodes if n.op in ("call_function", "call_method") and n.target in _ANCHORS
    ]:
        if anchor in taken:
            continue
        for x, out, nodes in reversed(_island(anchor)):
            form = _form(x, nodes)
            if form:
                found.append((x, out, nodes, form))
                taken |= set(nodes)
                break
    return found


def why_not(x: Node, out: Node, nodes: list) -> str:
    ev = x.meta.get("example_value")
    if not isinstance(ev, torch.Tensor) or ev.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "x is not a float32, float16 or bfloat16 tensor"
    why = kernel_here(ev)
    if why:
        return f"no fused GELU kernel here: {why}"
    inside = set(nodes)
    if any(u not in inside for n in nodes[:-1] for u in n.users):
        return "its intermediate values are used elsewhere"
    return ""


def _gelu_call(x, approximate: str, out_dtype):
    from perfloop.ops.gelu.triton_impl import gelu

    return gelu(x, approximate=approximate, out_dtype=out_dtype)


def replace(graph, x: Node, out: Node, nodes: list, form: str) -> None:
    with graph.inserting_before(out):
        fused = graph.call_function(_gelu_call, (x, form, out.meta["example_value"].dtype))
    fused.meta = dict(out.meta)
    out.replace_all_uses_with(fused)
    for n in reversed(nodes):
        if not n.users:
            graph.erase_node(n)
