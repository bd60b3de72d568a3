"""Attention written out op by op in a captured graph (nn.rewrite's), replaced by one
`F.scaled_dot_product_attention` call: `softmax(q @ k^T * scale [mask]) [dropout] @ v`, with

- the scale: constants multiplied or divided in, on the scores or on q;
- the mask: `masked_fill(cond, -inf)`, `torch.where(keep, scores, min)` or an added float mask;
  evaluated on the capture's inputs, a mask that hides exactly the upper triangle becomes
  `is_causal=True`, any other `attn_mask=`;
- dropout on the probabilities becomes `dropout_p=` (0 in eval mode).

What cannot be said as one SDPA call (the weights used elsewhere, two masks, a mask added before
the scale, a fill value that does not hide its positions) is left as written, with the reason.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from perfloop.nn.fxnodes import CASTS, Found, calls, example, values_of

ATTENTION = "attention written out"
HIDDEN = -1e4  # a fill value at or under this hides its position after softmax as -inf does


def _line(n: Node) -> str:
    if "perfloop_line" in n.meta:
        return n.meta["perfloop_line"]
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.meta.get("stack_trace") or "")
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else "?"


def _arg(n: Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _ndim(n: Any) -> int | None:
    v = example(n)
    return None if v is None else v.ndim


def _shape(n: Node) -> tuple:
    return tuple(n.meta["example_value"].shape)


_SOFTMAX = (F.softmax, torch.softmax, "softmax", torch.Tensor.softmax)
_MATMUL = (operator.matmul, torch.matmul, "matmul", torch.Tensor.matmul)
_DROPOUT = (F.dropout, torch.dropout, "dropout")


def _cast(n: Any) -> bool:
    return (calls(n, *CASTS) and n.op == "call_method") or calls(n, torch.Tensor.float, torch.Tensor.to)


def _const(x: Any) -> float | None:
    """The number x is: a Python number, or a 0-d tensor the graph makes from one
    (`torch.full([], c)`, `torch.tensor(c)`); None otherwise."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if calls(x, torch.full) and len(x.args) >= 2 and x.args[0] in ([], ()):
        return _const(x.args[1])
    if calls(x, torch.tensor) and x.args:
        return _const(x.args[0])
    return None


def _scaled(n: Node) -> tuple[Node, float] | None:
    """(input, factor) of a multiplication or division by a constant."""
    if calls(n, operator.mul, torch.mul, "mul"):
        a, b = n.args[:2]
        if _const(b) is not None and isinstance(a, Node):
            return a, _const(b)
        if _const(a) is not None and isinstance(b, Node):
            return b, _const(a)
    divides = calls(n, operator.truediv, torch.div, "div") and not n.kwargs.get("rounding_mode")
    if divides and _const(n.args[1]):
        return n.args[0], 1.0 / _const(n.args[1])
    return None


def _transposed(n: Any) -> Node | None:
    """k, where n is k with its last two dims swapped."""
    d = _ndim(n)
    if d is None or d < 2:
        return None
    pair = n.args[1:3] if calls(n, "transpose", torch.transpose) else ()
    if (
        len(pair) == 2
        and all(isinstance(a, int) for a in pair)
        and sorted(a % d for a in pair) == [d - 2, d - 1]
    ):
        return n.args[0]
    if calls(n, "permute", torch.permute):
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        want = [*range(d - 2), d - 1, d - 2]
        if [x % d for x in dims] == want:
            return n.args[0]
    if n.op == "call_function" and n.target is getattr and n.args[1] == "mT":
        return n.args[0]
    return None


@dataclass
class _Match:
    softmax: Node
    out: Node  # the matmul with v: its users get SDPA's output
    q: Node
    k: Node
    v: Node
    scale: float
    chain: list  # the nodes SDPA replaces, in the graph's order
    mask: tuple | None = None  # (kind: "fill" | "where" | "add", cond or mask node, fill value)
    dropout_p: float = 0.0  # negative: the dropout's p, off in eval mode


def _after(sm: Node) -> tuple[Node, float, list] | str:
    """(the matmul with v, dropout p, the nodes between) following a softmax."""
    n, p, chain = sm, 0.0, []
    while True:
        if len(n.users) != 1:
            return "the attention weights are used elsewhere (returned or stored)"
        nxt = next(iter(n.users))
        if _cast(nxt):
            chain.append(nxt)
        elif calls(nxt, *_DROPOUT):
            train = _arg(nxt, 2, "training" if nxt.target is not torch.dropout else "train", True)
            p = float(_arg(nxt, 1, "p", 0.5))
            p = p if train else -p  # in eval mode: none now, `-p` in training
            chain.append(nxt)
        elif calls(nxt, *_MATMUL) and nxt.args[0] is n:
            return nxt, p, chain
        else:
            what = nxt.target if nxt.op != "call_method" else "." + nxt.target
            return f"the weights go on to {what}, not @ v"
        n = nxt


def _before(x: Node) -> tuple[Node, float, tuple | None, list] | str:
    """(q @ k^T, scale, mask, the nodes between, the softmax's side first) behind a softmax's input."""
    scale, mask, chain = 1.0, None, []
    while not calls(x, *_MATMUL):
        if not isinstance(x, Node):
            return "the softmax's input is not computed from q @ k^T"
        if len(x.users) != 1:
            return "the scores are used elsewhere"
        s = _scaled(x)
        is_mask = calls(x, "masked_fill", torch.masked_fill, torch.where, operator.add, torch.add, "add")
        if is_mask and mask is not None:
            return "two masks"
        if s is not None:
            nxt, scale = s[0], scale * s[1]
        elif calls(x, "masked_fill", torch.masked_fill):
            mask, nxt = ("fill", x.args[1], _arg(x, 2, "value")), x.args[0]
        elif calls(x, torch.where) and len(x.args) == 3 and isinstance(x.args[1], Node):
            mask, nxt = ("where", x.args[0], x.args[2]), x.args[1]
        elif calls(x, operator.add, torch.add, "add") and all(isinstance(a, Node) for a in x.args[:2]):
            a, b = x.args[:2] if _score_side(x.args[0]) else x.args[1::-1]
            mask, nxt = ("add", b, None), a
        elif _cast(x):
            nxt = x.args[0]
        else:
            what = x.target if x.op != "call_method" else "." + x.target
            return f"{what} between q @ k^T and the softmax"
        chain.append(x)
        x = nxt
    if mask is not None and mask[0] == "add" and _added_before_scale(chain):
        return "a mask added before the scale"
    return x, scale, mask, chain


def _score_side(n: Node) -> bool:
    """Whether n (one side of an addition) comes from q @ k^T through elementwise steps."""
    for _ in range(8):
        if calls(n, *_MATMUL):
            return True
        if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
            return False
        n = n.args[0]
    return False


def _added_before_scale(chain: list) -> bool:
    """In the nodes from the softmax back to the matmul, a scaling nearer the softmax than the
    add (the add came first, and the scale multiplies the mask too)."""
    scaled = False
    for n in chain:
        if _scaled(n) is not None:
            scaled = True
        elif scaled and calls(n, operator.add, torch.add, "add"):
            return True
    return False


def _match(sm: Node) -> _Match | str:
    x = sm.args[0] if sm.args else sm.kwargs.get("input")
    dim = _arg(sm, 1, "dim")
    d = _ndim(x)
    if d is None or dim not in (-1, d - 1):
        return "a softmax over another dim than the last"
    after = _after(sm)
    if isinstance(after, str):
        return after
    out, p, tail = after
    before = _before(x)
    if isinstance(before, str):
        return before
    qk, scale, mask, head = before
    q, kt = qk.args[0], qk.args[1]
    s = _scaled(q) if isinstance(q, Node) and len(q.users) == 1 else None
    first = []  # the scaling of q, when the scale is applied there
    if s is not None:
        first.append(q)
        q, scale = s[0], scale * s[1]
    k = _transposed(kt)
    if k is None:
        return "q @ k^T's second factor is not k with its last two dims swapped"
    v = out.args[1]
    if not all(_ndim(t) and _ndim(t) >= 3 for t in (q, k, v)):
        return "q, k and v are not batched (..., tokens, head dim)"
    if _shape(q)[-1] != _shape(k)[-1] or _shape(k)[-2] != _shape(v)[-2]:
        return f"q {_shape(q)}, k {_shape(k)} and v {_shape(v)} do not fit one attention"
    if not scale > 0:
        return f"a scale of {scale:g}"
    chain = [*first, *([kt] if len(kt.users) == 1 else []), qk, *reversed(head), sm, *tail, out]
    return _Match(sm, out, q, k, v, scale, chain, mask, p)


def _hidden(mask: tuple, values: dict) -> torch.Tensor | str:
    """The positions the mask hides, as a bool tensor (broadcastable to the scores)."""
    kind, node, fill = mask
    if kind == "add":
        m = values[node]
        return m == -math.inf if isinstance(m, torch.Tensor) else "an added mask that is not a tensor"
    fill = values.get(fill, fill) if isinstance(fill, Node) else fill
    fill = (
        float(fill)
        if isinstance(fill, (int, float)) or (isinstance(fill, torch.Tensor) and fill.numel() == 1)
        else None
    )
    if fill is None or fill > HIDDEN:
        return f"a fill value of {fill} does not hide its positions"
    cond = values[node]
    return cond if kind == "fill" else ~cond


def _causal(hidden: torch.Tensor, q: Node, k: Node) -> bool:
    big_l, s = _shape(q)[-2], _shape(k)[-2]
    if big_l != s or hidden.ndim < 2:
        return False
    want = torch.ones(big_l, s, dtype=torch.bool, device=hidden.device).triu(1)
    return bool(hidden.shape[-2:] == want.shape and (hidden == want).all())


def _head_dim_refused(m: _Match) -> str:
    e = _shape(m.q)[-1]
    dev = m.q.meta["example_value"].device
    if dev.type == "cuda" and (e % 8 or e > 256):
        return (
            f"head dim {e}: SDPA's fused CUDA kernels take multiples of 8 up to 256 (its math fallback "
            "writes the scores as the code does)"
        )
    return ""


def _replace(gm: GraphModule, m: _Match, is_causal: bool, attn_mask) -> None:
    g = gm.graph
    kwargs: dict = {"dropout_p": max(m.dropout_p, 0.0), "is_causal": is_causal, "scale": m.scale}
    with g.inserting_before(m.out):
        if attn_mask is not None:
            kind, node, _ = attn_mask
            keep = node if kind in ("add", "where") else g.call_function(torch.logical_not, (node,))
            kwargs["attn_mask"] = keep
        sdpa = g.call_function(F.scaled_dot_product_attention, (m.q, m.k, m.v), kwargs)
    sdpa.meta = dict(m.out.meta)
    m.out.replace_all_uses_with(sdpa)
    for n in reversed(m.chain):
        if not n.users:
            g.erase_node(n)
    _erase_unused({a for n in m.chain for a in n.all_input_nodes} - {m.q, m.k, m.v}, g)


_PURE_METHODS = (
    "__getitem__",
    "eq",
    "ne",
    "view",
    "expand",
    "to",
    "bool",
    "float",
    "type_as",
    "triu",
    "tril",
)


def _erase_unused(nodes: set, g) -> None:
    """Erase these nodes (and what only they used) where nothing uses them: the mask's slices
    and comparisons the rewrite left behind."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.graph is not g or n.users or n.op not in ("call_function", "call_method"):
            continue
        pure = (
            n.target
            in (operator.getitem, operator.eq, operator.ne, torch.triu, torch.tril, torch.ones, torch.full)
            or n.target in _PURE_METHODS
        )
        if pure:
            inputs = n.all_input_nodes
            g.erase_node(n)
            todo.extend(inputs)


def softmax_lines(fn) -> list[str]:
    """file:line of each softmax named in fn's own code, in order."""
    import dis

    code = fn.__code__
    where = code.co_filename.rsplit("/", 1)[-1]
    lines = [i.positions.lineno for i in dis.get_instructions(code) if i.argval == "softmax" and i.positions]
    return [f"{where}:{n}" for n in dict.fromkeys(lines)]


def rewrite(gm: GraphModule, inputs: list, lines: list | None = None) -> list[Found]:
    """Replace each written-out attention in `gm` by SDPA (in place); what each softmax became,
    or why not. `lines`: the softmaxes' file:line where the graph keeps no stack traces."""
    found, matches = [], []
    softmaxes = [n for n in gm.graph.nodes if calls(n, *_SOFTMAX)]
    for i, sm in enumerate(softmaxes):
        if _line(sm) == "?" and lines and len(lines) == len(softmaxes):
            sm.meta["perfloop_line"] = lines[i]
        m = _match(sm)
        why = m if isinstance(m, str) else _head_dim_refused(m)
        if why:
            found.append(Found(_line(sm), False, why, {}, ATTENTION))
        else:
            matches.append(m)
    values = values_of(gm, inputs, [n for m in matches if m.mask for n in m.mask[1:]]) if matches else {}
    for m in matches:
        attn_mask, causal = None, False
        if m.mask is not None:
            hidden = _hidden(m.mask, values)
            if isinstance(hidden, str):
                found.append(Found(_line(m.softmax), False, hidden, {}, ATTENTION))
                continue
            value = m.mask[1].meta.get("example_value")
            learned = m.mask[0] == "add" and getattr(value, "requires_grad", False)
            causal = not learned and _causal(hidden, m.q, m.k)
            attn_mask = None if causal else m.mask
        default = 1 / math.sqrt(_shape(m.q)[-1])
        form = {
            "attn_mask": attn_mask is not None,
            "is_causal": causal,
            "dropout_p": m.dropout_p if m.dropout_p >= 0 else f"{-m.dropout_p:g} in training",
            "scale": m.scale if abs(m.scale - default) > 1e-9 * default else None,
        }
        line = _line(m.softmax)
        _replace(gm, m, causal, attn_mask)
        found.append(Found(line, True, "", form, ATTENTION))
    return found
