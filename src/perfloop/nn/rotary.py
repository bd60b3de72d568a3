"""Rotary position embeddings written out op by op, found in a captured graph (nn.rewrite's) and
replaced by the fused RoPE op (perfloop.ops.rope): one kernel each way, the math in fp32.

The three forms model code writes:

- neighbouring pairs, real: `x1, x2 = x[..., 0::2], x[..., 1::2]`,
  `stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)`;
- halves (`rotate_half`, Hugging Face's): `x * cos + cat((-x2, x1), -1) * sin` with the tables
  doubled along the last dim;
- complex (Meta's Llama): `view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis)
  .flatten(3)`, cast back with `type_as`.

The tables must be one angle per position and frequency, shared by the batch and the heads
(broadcast over them); the positions may sit before the heads ((B, T, H, D)) or after them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from perfloop.nn.fxnodes import calls, example
from perfloop.nn.modules import kernel_here

ROPE = "RoPE written out"


@dataclass
class RopeMatch:
    out: Node  # its users get the fused op's output
    x: Node
    cos: Node  # the code's tables: cos and sin, or (complex form) the complex angles twice
    sin: Node
    interleaved: bool
    doubled: bool  # tables of the whole head dim (rotate_half's), their halves equal
    complex: bool
    chain: list  # the nodes the fused op replaces, in the graph's order


def _slice_of(n) -> tuple | None:
    """(x, start, stop, step) where n is x[..., start:stop:step]."""
    if not calls(n, operator.getitem) or not isinstance(n.args[1], tuple) or len(n.args[1]) != 2:
        return None
    dots, s = n.args[1]
    if dots is not Ellipsis or not isinstance(s, slice):
        return None
    return n.args[0], s.start or 0, s.stop, s.step or 1


def _pair_layout(p: Node, q: Node) -> tuple[Node, bool] | None:
    """(x, interleaved) where p and q are x's two halves or its even and odd elements."""
    a, b = _slice_of(p), _slice_of(q)
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, d = a[0], example(a[0]).shape[-1]
    if (a[1:], b[1:]) == ((0, None, 2), (1, None, 2)):
        return x, True
    h = d // 2
    if a[1:] in ((0, h, 1),) and b[1:] in ((h, None, 1), (h, d, 1)):
        return x, False
    return None


def _mul_parts(n) -> tuple | None:
    if calls(n, operator.mul, torch.mul, "mul") and all(isinstance(a, Node) for a in n.args[:2]):
        return n.args[0], n.args[1]
    return None


def _product(n, factor) -> Node | None:
    """The other factor of n = factor * other (either order)."""
    parts = _mul_parts(n)
    if parts is None or factor not in parts:
        return None
    return parts[1] if parts[0] is factor else parts[0]


def _real_pairs(out: Node) -> RopeMatch | None:
    """stack((x1 c - x2 s, x1 s + x2 c), -1).flatten(-2), or cat((...), -1) of the halves."""
    if calls(out, "flatten") and calls(out.args[0], torch.stack):
        joined, interleaved = out.args[0], True
    elif calls(out, torch.cat):
        joined, interleaved = out, False
    else:
        return None
    parts = joined.args[0] if joined.args else None
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    a, b = parts
    if not (calls(a, operator.sub, torch.sub, "sub") and calls(b, operator.add, torch.add, "add")):
        return None
    m1, m2 = a.args[:2]
    p_c, q_s = _mul_parts(m1), _mul_parts(m2)
    if p_c is None or q_s is None:
        return None
    for p, c in (p_c, p_c[::-1]):
        for q, s in (q_s, q_s[::-1]):
            layout = _pair_layout(p, q)
            if layout is None or layout[1] != interleaved:
                continue
            with_p = {_product(b.args[0], p), _product(b.args[1], p)}
            with_q = {_product(b.args[0], q), _product(b.args[1], q)}
            if s in with_p and c in with_q:  # b = x1 sin + x2 cos
                chain = [p, q, m1, m2, a, *b.args[:2], b, *([joined] if joined is not out else []), out]
                return RopeMatch(out, layout[0], c, s, interleaved, False, False, chain)
    return None


def _rotate_half(out: Node) -> RopeMatch | None:
    """x * cos + cat((-x2, x1), -1) * sin (either order of each product and of the sum)."""
    if not calls(out, operator.add, torch.add, "add") or not all(isinstance(a, Node) for a in out.args[:2]):
        return None
    for plain, turned in (out.args[:2], out.args[1::-1]):
        pc, ts = _mul_parts(plain), _mul_parts(turned)
        if pc is None or ts is None:
            continue
        for cat, s in (ts, ts[::-1]):
            if not calls(cat, torch.cat) or len(cat.args[0]) != 2:
                continue
            dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
            if dim not in (-1, example(cat).ndim - 1):
                continue
            neg, x1 = cat.args[0]
            if not calls(neg, operator.neg, torch.neg, "neg"):
                continue
            layout = _pair_layout(x1, neg.args[0])
            if layout is None or layout[1] or layout[0] not in pc:
                continue
            x = layout[0]
            c = pc[1] if pc[0] is x else pc[0]
            chain = [x1, neg.args[0], neg, cat, plain, turned, out]
            return RopeMatch(out, x, c, s, False, True, False, chain)
    return None


def _complex(out: Node) -> RopeMatch | None:
    """view_as_real(view_as_complex(x[.float()].reshape(..., -1, 2)) * freqs).flatten(k)
    [.type_as(x)]."""
    last = out
    if calls(out, "type_as", "to"):
        out = out.args[0]
    if not (calls(out, "flatten") and calls(out.args[0], torch.view_as_real)):
        return None
    prod = out.args[0].args[0]
    parts = _mul_parts(prod)
    if parts is None:
        return None
    for z, f in (parts, parts[::-1]):
        if not calls(z, torch.view_as_complex):
            continue
        r = z.args[0]
        if not calls(r, "reshape", "view") or r.args[-1] != 2:
            continue
        x = r.args[0]
        cast = [x] if calls(x, "float") else []
        if cast:
            x = x.args[0]
        chain = [*cast, r, z, prod, out.args[0], out, *([last] if last is not out else [])]
        return RopeMatch(last, x, f, f, True, False, True, chain)
    return None


def _position_dim(table: torch.Tensor, x: torch.Tensor) -> int | str:
    """The dim (from the end) the table's positions broadcast along in x, or why there is none."""
    shape = (1,) * (x.ndim - table.ndim) + tuple(table.shape)
    if len(shape) != x.ndim:
        return f"tables of {tuple(table.shape)} for x of {tuple(x.shape)}"
    spread = [i for i in range(x.ndim - 1) if shape[i] != 1]
    if len(spread) != 1 or shape[spread[0]] != x.shape[spread[0]]:
        return f"tables of {tuple(table.shape)} are not one angle per position shared by the batch and heads"
    return spread[0] - x.ndim


def find(graph) -> list[RopeMatch]:
    out = []
    taken: set = set()
    for n in graph.nodes:
        m = _complex(n) or _real_pairs(n) or _rotate_half(n)
        if m is not None and not (set(m.chain) & taken):
            out.append(m)
            taken |= set(m.chain)
    return out


def why_not(m: RopeMatch, values: dict) -> str:
    """Why the fused op cannot stand for this match, or ""."""
    x, out = example(m.x), example(m.out)
    if x is None or out is None or x.ndim < 2 or x.shape[-1] % 2:
        return "x is not (..., D) with D even"
    why = kernel_here(x)
    if why:
        return f"no fused RoPE kernel here: {why}"
    inside = set(m.chain)
    if any(u not in inside for n in m.chain[:-1] for u in n.users):
        return "its intermediate values are used elsewhere"
    table = values.get(m.cos)
    if not isinstance(table, torch.Tensor):
        return "its tables could not be evaluated"
    pd = _position_dim(table, x)
    if isinstance(pd, str):
        return pd
    if m.doubled:
        h = x.shape[-1] // 2
        for t in (values.get(m.cos), values.get(m.sin)):
            if t.shape[-1] != 2 * h or not torch.equal(t[..., :h], t[..., h:]):
                return "rotate_half's tables are not the same angles in both halves"
    return ""


def _rope_call(x, cos, sin, interleaved: bool, position_dim: int, out_dtype, doubled: bool, complex_: bool):
    from perfloop.ops.rope.triton_impl import rope

    t, d = x.shape[position_dim], x.shape[-1]
    if complex_:
        cos, sin = torch.view_as_real(cos)[..., 0], torch.view_as_real(cos)[..., 1]
    if doubled:
        cos, sin = cos[..., : d // 2], sin[..., : d // 2]
    return rope(
        x,
        cos.reshape(t, d // 2),
        sin.reshape(t, d // 2),
        interleaved,
        position_dim=position_dim,
        out_dtype=out_dtype,
    )


def replace(graph, m: RopeMatch, values: dict) -> None:
    x = example(m.x)
    pd = _position_dim(values[m.cos], x)
    args = (m.x, m.cos, m.sin, m.interleaved, pd, example(m.out).dtype, m.doubled, m.complex)
    with graph.inserting_before(m.out):
        fused = graph.call_function(_rope_call, args)
    fused.meta = dict(m.out.meta)
    m.out.replace_all_uses_with(fused)
    for n in reversed(m.chain):
        if not n.users and n is not m.x:
            graph.erase_node(n)
