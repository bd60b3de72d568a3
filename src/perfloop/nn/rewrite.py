"""Attention written out op by op in a module's own forward, replaced by one
`F.scaled_dot_product_attention` call.

The forward is captured by Dynamo (a `torch.compile` whose backend runs the captured graph as it
is, eager, after the rewrite): Dynamo follows real code (shape arithmetic, `math.sqrt`, slices of
registered buffers, branches on config) and re-captures where a guard fails (a new shape, train
or eval), so each capture is rewritten for what it holds. In each captured graph the rewrite
finds `softmax(q @ k^T * scale [mask]) [dropout] @ v`:

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
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Interpreter, Node

from perfloop.nn import pointwise, rotary
from perfloop.nn.pointwise import GELU as GELU  # the kinds nn.patch names
from perfloop.nn.pointwise import NORM as NORM
from perfloop.nn.rotary import ROPE as ROPE  # the kind nn.patch names

ATTENTION = "attention written out"
HIDDEN = -1e4  # a fill value at or under this hides its position after softmax as -inf does


@dataclass
class Found:
    """One softmax of a captured graph: whether it became SDPA, and how or why not."""

    line: str  # file:line of the softmax in the user's code ("" for a RoPE: its graph has no lines)
    replaced: bool
    reason: str = ""
    form: dict = field(default_factory=dict)  # is_causal, attn_mask, dropout_p, scale; a RoPE's layout
    pattern: str = ATTENTION


def _is(n: Any, *targets) -> bool:
    return isinstance(n, Node) and n.op in ("call_function", "call_method") and n.target in targets


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
    v = n.meta.get("example_value") if isinstance(n, Node) else None
    return v.ndim if isinstance(v, torch.Tensor) else None


def _shape(n: Node) -> tuple:
    return tuple(n.meta["example_value"].shape)


_CASTS = ("float", "half", "bfloat16", "to", "type_as", "type")
_SOFTMAX = (F.softmax, torch.softmax, "softmax", torch.Tensor.softmax, torch._C._nn.softmax if hasattr(
    torch._C._nn, "softmax") else F.softmax)  # fmt: skip
_MATMUL = (operator.matmul, torch.matmul, "matmul", torch.Tensor.matmul)
_DROPOUT = (F.dropout, torch.dropout, "dropout")


def _cast(n: Any) -> bool:
    return _is(n, *_CASTS) and n.op == "call_method" or _is(n, torch.Tensor.float, torch.Tensor.to)


def _const(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scaled(n: Node) -> tuple[Node, float] | None:
    """(input, factor) of a multiplication or division by a constant."""
    if _is(n, operator.mul, torch.mul, "mul"):
        a, b = n.args[:2]
        if _const(b) and isinstance(a, Node):
            return a, float(b)
        if _const(a) and isinstance(b, Node):
            return b, float(a)
    if _is(n, operator.truediv, torch.div, "div") and _const(n.args[1]) and not n.kwargs.get("rounding_mode"):
        return n.args[0], 1.0 / float(n.args[1])
    return None


def _transposed(n: Any) -> Node | None:
    """k, where n is k with its last two dims swapped."""
    d = _ndim(n)
    if d is None or d < 2:
        return None
    last = {(d - 2, d - 1), (d - 1, d - 2), (-2, -1), (-1, -2), (d - 2, -1), (-2, d - 1), (-1, d - 2),
            (d - 1, -2)}  # fmt: skip
    if _is(n, "transpose", torch.transpose) and tuple(n.args[1:3]) in last:
        return n.args[0]
    if _is(n, "permute", torch.permute):
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
        elif _is(nxt, *_DROPOUT):
            train = _arg(nxt, 2, "training" if nxt.target is not torch.dropout else "train", True)
            p = float(_arg(nxt, 1, "p", 0.5))
            p = p if train else -p  # in eval mode: none now, `-p` in training
            chain.append(nxt)
        elif _is(nxt, *_MATMUL) and nxt.args[0] is n:
            return nxt, p, chain
        else:
            what = nxt.target if nxt.op != "call_method" else "." + nxt.target
            return f"the weights go on to {what}, not @ v"
        n = nxt


def _before(x: Node) -> tuple[Node, float, tuple | None, list] | str:
    """(q @ k^T, scale, mask, the nodes between, the softmax's side first) behind a softmax's input."""
    scale, mask, chain = 1.0, None, []
    while not _is(x, *_MATMUL):
        if not isinstance(x, Node):
            return "the softmax's input is not computed from q @ k^T"
        if len(x.users) != 1:
            return "the scores are used elsewhere"
        s = _scaled(x)
        is_mask = _is(x, "masked_fill", torch.masked_fill, torch.where, operator.add, torch.add, "add")
        if is_mask and mask is not None:
            return "two masks"
        if s is not None:
            nxt, scale = s[0], scale * s[1]
        elif _is(x, "masked_fill", torch.masked_fill):
            mask, nxt = ("fill", x.args[1], _arg(x, 2, "value")), x.args[0]
        elif _is(x, torch.where) and len(x.args) == 3 and isinstance(x.args[1], Node):
            mask, nxt = ("where", x.args[0], x.args[2]), x.args[1]
        elif _is(x, operator.add, torch.add, "add") and all(isinstance(a, Node) for a in x.args[:2]):
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
        if _is(n, *_MATMUL):
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
        elif scaled and _is(n, operator.add, torch.add, "add"):
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


def _values(gm: GraphModule, inputs: list, wanted: list) -> dict:
    """The values of these nodes on the capture's inputs (only what they need is computed)."""
    need: set = set()
    todo = [n for n in wanted if isinstance(n, Node)]
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)

    class Part(Interpreter):
        def run_node(self, n):
            if n.op == "placeholder" or n in need:
                return super().run_node(n)
            return None

    part = Part(gm, garbage_collect_values=False)
    devices = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"][:1]
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        part.run(*inputs)
    return {n: part.env.get(n) for n in wanted if isinstance(n, Node)}


def _hidden(mask: tuple, values: dict) -> torch.Tensor | str:
    """The positions the mask hides, as a bool tensor (broadcastable to the scores)."""
    kind, node, fill = mask
    if kind == "add":
        m = values[node]
        return m == -math.inf if isinstance(m, torch.Tensor) else "an added mask that is not a tensor"
    fill = values.get(fill, fill) if isinstance(fill, Node) else fill
    fill = float(fill) if isinstance(fill, (int, float)) or (isinstance(fill, torch.Tensor)
                                                             and fill.numel() == 1) else None  # fmt: skip
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
        return f"head dim {e}: SDPA's fused CUDA kernels take multiples of 8 up to 256 (its math fallback " \
               "writes the scores as the code does)"  # fmt: skip
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
        pure = n.target in (operator.getitem, operator.eq, operator.ne, torch.triu, torch.tril, torch.ones,
                            torch.full) or n.target in _PURE_METHODS  # fmt: skip
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


def rewrite_graph(gm: GraphModule, inputs: list, lines: list | None = None) -> list[Found]:
    """Replace each written-out attention in `gm` by SDPA and each written-out RoPE by the fused
    op (in place, recompiled where any was); what each became, or why not. `lines`: the
    softmaxes' file:line where the graph keeps no stack traces (in order)."""
    found, matches = [], []
    softmaxes = [n for n in gm.graph.nodes if _is(n, *_SOFTMAX)]
    for i, sm in enumerate(softmaxes):
        if _line(sm) == "?" and lines and len(lines) == len(softmaxes):
            sm.meta["perfloop_line"] = lines[i]
        m = _match(sm)
        why = m if isinstance(m, str) else _head_dim_refused(m)
        if why:
            found.append(Found(_line(sm), False, why))
        else:
            matches.append(m)
    values = _values(gm, inputs, [n for m in matches if m.mask for n in m.mask[1:]]) if matches else {}
    for m in matches:
        attn_mask, causal = None, False
        if m.mask is not None:
            hidden = _hidden(m.mask, values)
            if isinstance(hidden, str):
                found.append(Found(_line(m.softmax), False, hidden))
                continue
            value = m.mask[1].meta.get("example_value")
            learned = m.mask[0] == "add" and getattr(value, "requires_grad", False)
            causal = not learned and _causal(hidden, m.q, m.k)
            attn_mask = None if causal else m.mask
        default = 1 / math.sqrt(_shape(m.q)[-1])
        form = {"attn_mask": attn_mask is not None, "is_causal": causal,
                "dropout_p": m.dropout_p if m.dropout_p >= 0 else f"{-m.dropout_p:g} in training",
                "scale": m.scale if abs(m.scale - default) > 1e-9 * default else None}  # fmt: skip
        line = _line(m.softmax)
        _replace(gm, m, causal, attn_mask)
        found.append(Found(line, True, "", form))
    found += _rewrite_ropes(gm, inputs)
    found += _rewrite_gelus(gm)
    found += _rewrite_norms(gm)
    if any(f.replaced for f in found):
        gm.graph.lint()
        gm.recompile()
    return found


def _rewrite_ropes(gm: GraphModule, inputs: list) -> list[Found]:
    ropes = rotary.find(gm.graph)
    values = _values(gm, inputs, [n for r in ropes for n in (r.cos, r.sin)]) if ropes else {}
    found = []
    for r in ropes:
        why = rotary.why_not(r, values)
        form = {"interleaved": r.interleaved, "form": "complex" if r.complex else "rotate_half" if r.doubled
                else "real"}  # fmt: skip
        found.append(Found("", not why, why, form, rotary.ROPE))
        if not why:
            rotary.replace(gm.graph, r, values)
    return found


def _rewrite_gelus(gm: GraphModule) -> list[Found]:
    found = []
    for x, out, nodes, form in pointwise.find(gm.graph):
        why = pointwise.why_not(x, out, nodes)
        found.append(Found("", not why, why, {"form": form}, GELU))
        if not why:
            pointwise.replace(gm.graph, x, out, nodes, form)
    return found


def _rewrite_norms(gm: GraphModule) -> list[Found]:
    found = []
    for m in pointwise.find_norms(gm.graph):
        why = pointwise.why_not(m["x"], m["out"], m["nodes"])
        form = {"form": "RMS" if m["rms"] else "layer", "eps": m["eps"], "weight": m["weight"] is not None,
                "bias": m["bias"] is not None}  # fmt: skip
        found.append(Found("", not why, why, form, NORM))
        if not why:
            pointwise.replace_norm(gm.graph, m)
    return found


class Backend:
    """A torch.compile backend that runs each captured graph eager after `rewrite_graph`;
    `found` keeps what every capture held. One per forward function: the instances of a class
    share its captures."""

    def __init__(self, fn) -> None:
        self.found: list[Found] = []
        self.graphs = 0  # captures so far
        self.lines = softmax_lines(fn)

    def __call__(self, gm: GraphModule, example_inputs: list):
        self.graphs += 1
        try:
            self.found += rewrite_graph(gm, example_inputs, self.lines)
        except Exception as exc:  # noqa: BLE001 -- a graph the rewrite cannot read runs as written
            self.found.append(Found("?", False, f"the captured graph could not be rewritten: {exc}"))
        return gm.forward


_BACKENDS: dict = {}


def backend_for(fn) -> Backend:
    if fn.__code__ not in _BACKENDS:
        _BACKENDS[fn.__code__] = Backend(fn)
    return _BACKENDS[fn.__code__]


class Rewritten:
    """A module instance's forward: the class's own, captured and run with its written-out
    attention as SDPA and RoPE fused. Under an outer torch.compile the class's own code is
    traced (Inductor fuses it its own way). `alone`: captured apart from the class's other
    instances (Dynamo keeps its captures by code object: here a copy of it), so that `found`
    says what this instance's captures held, for the check."""

    def __init__(self, owner: torch.nn.Module, fn, alone: bool = False) -> None:
        self.owner, self.fn = owner, fn
        if alone:
            fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                    fn.__closure__)  # fmt: skip
            self.backend = Backend(fn)
        else:
            self.backend = backend_for(fn)
        self._compiled = torch.compile(fn, backend=self.backend)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self._compiled is None:
            return self.fn(self.owner, *args, **kwargs)
        try:
            return self._compiled(self.owner, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:  # the capture failed: run the code as written
            self._compiled = None
            warnings.warn(
                f"perfloop: {type(self.owner).__name__}'s rewritten forward could not be captured "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); it runs as "
                "written from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(self.owner, *args, **kwargs)

    def __getstate__(self):
        return {"owner": self.owner, "fn": self.fn}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["fn"])


def rewrite(module: torch.nn.Module) -> Rewritten:
    """Give `module` a forward whose written-out attention runs as SDPA."""
    r = Rewritten(module, type(module).forward)
    module.forward = r
    return r


def restore(module: torch.nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), Rewritten):
        del module.forward


def _code_names(fn, depth: int = 1) -> tuple[set, set, bool]:
    """(the global names fn's code and its nested code load, the other names it uses, whether it
    uses the @ operator), taken down `depth` levels of the global functions it calls."""
    import dis
    import types

    code = getattr(fn, "__code__", None)
    if code is None:
        return set(), set(), False
    globs, names, matmul, todo = set(), set(), False, [code]
    while todo:
        c = todo.pop()
        for i in dis.get_instructions(c):
            if i.opname == "LOAD_GLOBAL":
                globs.add(i.argval)
            elif isinstance(i.argval, str) and i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME"):
                names.add(i.argval)
            matmul = matmul or (i.opname == "BINARY_OP" and i.argrepr in ("@", "@="))
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    if depth:
        for n in list(globs):
            f = fn.__globals__.get(n)
            if isinstance(f, types.FunctionType) and not f.__module__.startswith("torch"):
                g2, n2, m2 = _code_names(f, depth - 1)
                globs, names, matmul = globs | g2, names | n2, matmul or m2
    return globs, names, matmul


_ROPE_NAMES = ("rotary", "rope", "rotate_half")


def writes(module: torch.nn.Module) -> set[str]:
    """What the module's own forward (its class's, and the functions it calls) may write out op
    by op: ATTENTION (a softmax and a matmul), ROPE (a global function named for rotary
    embeddings, rotate_half, or view_as_complex). Candidates only: the capture decides."""
    import inspect

    fn = inspect.unwrap(type(module).forward)
    if getattr(fn, "__code__", None) is None or getattr(fn, "__module__", "").startswith("torch."):
        return set()
    globs, names, matmul = _code_names(fn)
    out = set()
    if "softmax" in globs | names and (matmul or (globs | names) & {"matmul", "bmm"}):
        out.add(ATTENTION)
    if any(r in g.lower() for g in globs for r in _ROPE_NAMES) or "view_as_complex" in names:
        out.add(rotary.ROPE)
    if {"tanh", "erf"} & (names | globs):
        out.add(GELU)
    if "rsqrt" in names | globs or ("sqrt" in names | globs and {"mean", "var"} & (names | globs)):
        out.add(NORM)
    return out


def written_kind(patterns: set) -> str:
    """The kind a swap of these patterns goes by ("attention written out", "RoPE written out",
    or both joined)."""
    return " and ".join(sorted(patterns)) or ATTENTION


def is_written(kind: str) -> bool:
    return all(p in (ATTENTION, rotary.ROPE, GELU, NORM) for p in kind.split(" and "))
