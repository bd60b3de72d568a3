"""GELU and norms written out op by op inline (nanoGPT's early `new_gelu(x)`, an erf form,
`x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w`, `(x - mean) / sqrt(var + eps)`),
found in a captured graph (nn.rewrite's) and replaced by the fused GELU or norm.

Found by what they compute, not by how they are spelled: around each `tanh` or `erf` (GELU), or
`rsqrt` or `sqrt` (a norm), the largest run of elementwise ops -- for a norm, and reductions over
the last dim that keep it -- whose only tensor input is one x is evaluated on a float64 probe;
where that function of x is GELU (either form), an RMS norm or a layer norm (with an epsilon the
run holds) to 1e-10, the run -- with a weight and bias it is then scaled and shifted by -- is
replaced by one fused call, written in the dtype the run gave.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from perfloop.nn.fxnodes import CASTS
from perfloop.nn.modules import kernel_here

GELU = "GELU written out"
NORM = "norm written out"

_ANCHORS = (torch.tanh, torch.erf, torch.special.erf, "tanh", "erf")
_NAMES = ["mul", "add", "sub", "div", "pow", "neg", "tanh", "erf", "sqrt", "rsqrt", "exp"]
_OPERATORS = (operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow)
_POINTWISE = {*_NAMES, *(getattr(torch, n) for n in _NAMES), *_OPERATORS, torch.special.erf}


_ROWWISE = {torch.mean, torch.var, torch.sum, "mean", "var", "sum"}


def _pointwise(n) -> bool:
    if not isinstance(n, Node) or n.op not in ("call_function", "call_method"):
        return False
    return n.target in _POINTWISE or (n.op == "call_method" and n.target in CASTS)


def _rowwise(n) -> bool:
    """A reduction over the last dim that keeps it (x.mean(-1, keepdim=True)), or pointwise."""
    if _pointwise(n):
        return True
    if not isinstance(n, Node) or n.op not in ("call_function", "call_method") or n.target not in _ROWWISE:
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    ev = n.meta.get("example_value")
    last = (-1, [-1], (-1,)) + ((ev.ndim - 1, [ev.ndim - 1], (ev.ndim - 1,)) if ev is not None else ())
    return dim in last and bool(n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False))


def _tensors(n: Node) -> list:
    return [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node)]


def _cone(n: Node, region: set, ok=_pointwise) -> tuple[set, set]:
    """(the ancestors of n that `ok` takes, n included, not yet in region; the other tensors they
    read)."""
    out, todo, leaves = set(), [n], set()
    while todo:
        m = todo.pop()
        if m in region or m in out:
            continue
        if not ok(m):
            leaves.add(m)
            continue
        out.add(m)
        todo += _tensors(m)
    return out, leaves


def _bounded(ok, x: Node):
    return lambda m: m is not x and ok(m)


def _input(anchor: Node, ok) -> Node | None:
    """The earliest node x such that the run of ops `ok` takes behind `anchor`, stopped at x,
    reads x alone (the run's one input), or None."""
    cone, leaves = _cone(anchor, set(), ok)
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    for x in sorted(cone | leaves, key=order.__getitem__):
        if x is anchor:
            break
        if _cone(anchor, set(), _bounded(ok, x))[1] == {x}:
            return x
    return None


def _island(anchor: Node, ok=_pointwise) -> list[tuple[Node, Node, list]]:
    """(x, out, nodes in graph order) of the growing runs of ops `ok` takes around `anchor` with
    one tensor input x, smallest first."""
    x = _input(anchor, ok)
    if x is None:
        return []
    ok = _bounded(ok, x)
    region, _ = _cone(anchor, set(), ok)
    runs, out = [], anchor
    while True:
        runs.append((x, out, set(region)))
        if len(out.users) != 1:
            break
        user = next(iter(out.users))
        if not ok(user):
            break
        more, more_leaves = _cone(user, region, ok)
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
        if n.op == "call_method" and n.target in CASTS:
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
    except Exception:
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


_NORM_ANCHORS = (torch.rsqrt, torch.sqrt, "rsqrt", "sqrt")


def _constants(nodes: list) -> list[float]:
    out = []
    for n in nodes:
        for a in (*n.args, *n.kwargs.values()):
            if isinstance(a, float):
                out.append(a)
    return out


def _norm_form(x: Node, nodes: list) -> tuple[bool, float] | None:
    """(rms, eps) where the run is an RMS norm or a layer norm of x's last dim, else None."""
    d = x.meta["example_value"].shape[-1]
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(6, d, generator=g, dtype=torch.float64) * 3 + 1
    try:
        with torch.no_grad():
            y = _evaluate(x, nodes, probe)
    except Exception:
        return None
    if y is None or y.shape != probe.shape:
        return None
    for eps in dict.fromkeys([*_constants(nodes), 1e-5, 1e-6, 0.0]):
        for rms in (True, False):
            want = F.rms_norm(probe, (d,), eps=eps) if rms else F.layer_norm(probe, (d,), eps=eps)
            if torch.allclose(y, want, rtol=1e-10, atol=1e-12):
                return rms, eps
    return None


def _affine(out: Node, region: set, d: int, ops) -> tuple[Node | None, Node]:
    """(the 1-D tensor of size d `out`'s only user combines it with by `ops`, that user), or
    (None, out)."""
    if len(out.users) != 1:
        return None, out
    user = next(iter(out.users))
    if not (isinstance(user, Node) and user.target in ops) or len(user.args) != 2:
        return None, out
    other = user.args[1] if user.args[0] is out else user.args[0]
    ev = other.meta.get("example_value") if isinstance(other, Node) else None
    if not isinstance(ev, torch.Tensor) or tuple(ev.shape) != (d,) or other in region:
        return None, out
    return other, user


def find_norms(graph) -> list[dict]:
    """Each norm written out in the graph: {x, out, nodes, rms, eps, weight, bias}."""
    found, taken = [], set()
    for anchor in [
        n for n in graph.nodes if n.op in ("call_function", "call_method") and n.target in _NORM_ANCHORS
    ]:
        if anchor in taken:
            continue
        for x, out, nodes in reversed(_island(anchor, _rowwise)):
            form = _norm_form(x, nodes)
            if form is None:
                continue
            d, region = x.meta["example_value"].shape[-1], set(nodes)
            weight, scaled = _affine(out, region, d, (operator.mul, torch.mul, "mul"))
            bias, extra = None, []
            if weight is not None:
                extra.append(scaled)
                bias, shifted = _affine(scaled, region, d, (operator.add, torch.add, "add"))
                extra += [shifted] if bias is not None else []
            nodes = [*nodes, *extra]
            m = {"x": x, "out": nodes[-1], "nodes": nodes, "rms": form[0], "eps": form[1]}
            found.append(m | {"weight": weight, "bias": bias})
            taken |= set(nodes)
            break
    return found


def _norm_call(x, weight, bias, eps: float, rms: bool, out_dtype):
    from perfloop.nn import functional as pf

    d = x.shape[-1]
    y = pf.rms_norm(x, (d,), weight, eps) if rms else pf.layer_norm(x, (d,), weight, bias, eps)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def replace_norm(graph, m: dict) -> None:
    out = m["out"]
    args = (m["x"], m["weight"], m["bias"], m["eps"], m["rms"], out.meta["example_value"].dtype)
    with graph.inserting_before(out):
        fused = graph.call_function(_norm_call, args)
    fused.meta = dict(out.meta)
    out.replace_all_uses_with(fused)
    for n in reversed(m["nodes"]):
        if not n.users:
            graph.erase_node(n)
