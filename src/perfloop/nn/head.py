"""A language model's head written the usual way -- a bias-free Linear, views, slices and casts
of its logits, F.cross_entropy -- found in a captured graph and replaced by the fused linear +
cross entropy, which never holds the whole logits.

Only heads whose weight `allow` registered are replaced (pl.patch registers a module's own
bias-free Linears once its check passed), in two places: the module's own capture
(nn.rewrite, eager) and, under an outer torch.compile, Inductor's pre-grad graph (`install`
puts `PreGradPass` into torch._inductor.config.pre_grad_custom_pass, after any pass already
there). Logits that the forward also returns are dropped (None) only where `allow` was told the
step does not read them.
"""

from __future__ import annotations

import logging
import operator
import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from perfloop.nn.fxnodes import CASTS, Found, calls, example
from perfloop.nn.modules import linear_cross_entropy

LOSS = "linear + cross entropy written out"

_LINEARS = (torch._C._nn.linear, F.linear)
_KEEPS_ROWS = (*CASTS, "contiguous")  # with a dtype as their only argument
_VIEWS = ("view", "reshape", "flatten")

# id(weight) -> (a weak reference to it, whether the logits must be kept)
_ALLOWED: dict[int, tuple[weakref.ref, bool]] = {}


def allow(module: torch.nn.Module, keep_logits: bool) -> list[torch.Tensor]:
    """Let the heads on `module`'s own bias-free Linears be fused; the weights registered."""
    out = []
    for child in module.children():
        if isinstance(child, torch.nn.Linear) and child.bias is None:
            w = child.weight
            _ALLOWED[id(w)] = (weakref.ref(w, lambda _r, k=id(w): _ALLOWED.pop(k, None)), keep_logits)
            out.append(w)
    return out


def disallow(weights: list) -> None:
    for w in weights:
        _ALLOWED.pop(id(w), None)


def allowed(w) -> bool | None:
    """Whether logits must be kept for a head on this weight (None: not registered)."""
    entry = _ALLOWED.get(id(w)) if isinstance(w, torch.Tensor) else None
    return entry[1] if entry is not None and entry[0]() is w else None


def owns_head(module: torch.nn.Module) -> bool:
    return any(isinstance(c, torch.nn.Linear) and c.bias is None for c in module.children())


@dataclass
class Head:
    linear: Node
    chain: list[Node]  # from the linear's output to cross_entropy's input, in order
    ce: Node
    line: str
    returned: list[Node] = field(default_factory=list)  # of linear and chain, those the graph returns
    elsewhere: list[Node] = field(default_factory=list)  # those read by anything else


def find(graph: Graph) -> list[Head]:
    out = []
    for ce in graph.nodes:
        if not calls(ce, F.cross_entropy) or not ce.args:
            continue
        chain, x = [], ce.args[0]
        while isinstance(x, Node) and _row_preserving(x):
            chain.insert(0, x)
            x = x.args[0]
        if not (calls(x, *_LINEARS) and len(x.args) >= 2):
            continue
        head = Head(x, chain, ce, _line(ce))
        inside = {ce, *chain}
        for n in (x, *chain):
            for u in n.users:
                if u.op == "output":
                    head.returned.append(n)
                elif u not in inside:
                    head.elsewhere.append(u)
        out.append(head)
    return out


def _row_preserving(n: Node) -> bool:
    """A view, slice or cast of logits that keeps each row of the vocabulary whole."""
    y, x = example(n), example(n.args[0]) if n.args else None
    if y is None or x is None or not y.ndim or not x.ndim or y.shape[-1] != x.shape[-1]:
        return False
    if n.op == "call_method" and n.target in _KEEPS_ROWS:
        return all(isinstance(a, torch.dtype) for a in (*n.args[1:], *n.kwargs.values()))
    if n.op == "call_method" and n.target in _VIEWS:
        return n.target == "flatten" or _last_is(n.args[1:], x.shape[-1])
    if calls(n, operator.getitem):
        return _keeps_last(n.args[1], x.ndim)
    return False


def _last_is(shape: tuple, size: int) -> bool:
    dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    return bool(dims) and isinstance(dims[-1], int) and dims[-1] in (size, -1)


def _with_last(shape: tuple, size: int, hidden: int) -> tuple:
    """A view's shape with the vocabulary's size (its last) made the hidden size."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return (_with_last(tuple(shape[0]), size, hidden),)
    return (*shape[:-1], hidden if shape[-1] == size else shape[-1])


def _keeps_last(index, ndim: int) -> bool:
    idx = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx):
        return False
    last = idx[-1]
    return last is Ellipsis or last == slice(None) or (Ellipsis not in idx and len(idx) < ndim)


def _line(n: Node) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.meta.get("stack_trace") or "")
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""


_CE_ARGS = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _options(ce: Node) -> dict:
    """cross_entropy's arguments after (input, target), by name."""
    return dict(zip(_CE_ARGS, ce.args[2:], strict=False)) | ce.kwargs


def why_not(head: Head, keep_logits: bool) -> str | None:
    ce, weight = head.ce, head.linear.args[1]
    bias = head.linear.args[2] if len(head.linear.args) > 2 else head.linear.kwargs.get("bias")
    if bias is not None:
        return "the Linear has a bias"
    x, t, w = example(ce.args[0]), example(ce.args[1]) if len(ce.args) > 1 else None, example(weight)
    if x is None or t is None or w is None or x.ndim != 2 or t.ndim != 1 or t.dtype != torch.int64:
        return "cross entropy on other than (rows, classes) logits and int64 class indices"
    kw = _options(ce)
    if kw.get("weight") is not None or kw.get("label_smoothing") or kw.get("reduction", "mean") != "mean":
        return "class weights, label smoothing or a reduction other than mean"
    if kw.get("size_average") is not None or kw.get("reduce") is not None:
        return "the deprecated size_average or reduce"
    if not isinstance(kw.get("ignore_index", -100), int):
        return "an ignore_index that is not a constant"
    if head.elsewhere:
        return f"the logits are read beyond the loss ({head.elsewhere[0].name})"
    if head.returned and keep_logits:
        return (
            "the forward returns the logits too: with logits=False (the step does not read them) "
            "pl.patch fuses the head and returns None for them"
        )
    return None


def replace(graph: Graph, head: Head, compiled: bool) -> None:
    """Put nn.modules.linear_cross_entropy(hidden rows, weight, target rows, ignore_index) where
    the head's cross entropy was (cast to its dtype; `compiled`: as perfloop's graph op), the
    logits dropped from the output."""
    ce, (h, weight) = head.ce, head.linear.args[:2]
    hidden = example(weight).shape[1]
    kw = _options(ce)
    with graph.inserting_before(ce):
        for n in head.chain:  # the same slices and views on the hidden states
            if calls(n, operator.getitem):
                h = graph.call_function(operator.getitem, (h, n.args[1]))
            elif n.target == "flatten":
                h = graph.call_method("flatten", (h, *n.args[1:]), n.kwargs)
            elif n.target in _VIEWS:
                h = graph.call_method("reshape", (h, *_with_last(n.args[1:], example(n).shape[-1], hidden)))
        rows = graph.call_method("reshape", (h, -1, hidden))
        target = graph.call_method("reshape", (ce.args[1], -1))
        args = (rows, weight, target, kw.get("ignore_index", -100))
        loss = graph.call_function(linear_cross_entropy, args, {"graph": compiled})
        loss = graph.call_method("to", (loss, example(ce).dtype))
    ce.replace_all_uses_with(loss)
    dropped = set(head.returned)
    for out in [n for n in graph.nodes if n.op == "output"]:
        out.args = map_arg(out.args, lambda n: None if n in dropped else n)
    for n in [ce, *reversed(head.chain), head.linear]:
        if not n.users:
            graph.erase_node(n)


def rewrite(graph: Graph, compiled: bool = False) -> list[Found]:
    """Replace each allowed head in `graph` by the fused linear + cross entropy (`compiled`: a
    graph Inductor compiles, where it is perfloop's graph op); what each became, or why not."""
    found = []
    for head in find(graph):
        w = head.linear.args[1]
        arg = w.meta.get("grapharg") if isinstance(w, Node) else None
        keep = allowed(getattr(arg, "example", None))
        if keep is None:
            continue
        why = why_not(head, keep)
        found.append(Found(head.line, not why, why or "", {"logits": "kept" if keep else "dropped"}, LOSS))
        if not why:
            replace(graph, head, compiled)
    return found


class PreGradPass:
    """Inductor's pre-grad pass: the allowed heads as perfloop's graph op (after `before`, a pass
    the user had set). No uuid: Inductor then runs it before its cache lookup, so the cache keys
    the rewritten graph."""

    def __init__(self, before=None) -> None:
        self.before = before

    def __call__(self, graph: Graph) -> None:
        if self.before is not None:
            self.before(graph)
        if _ALLOWED and any(f.replaced for f in rewrite(graph, compiled=True)):
            graph.lint()


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "PreGradPass" not in record.getMessage()


def install() -> PreGradPass:
    """perfloop's pre-grad pass in Inductor's config (once); torch's note that it has no uuid
    (what keeps the cache right) left unsaid."""
    import torch._inductor.config as inductor

    current = inductor.pre_grad_custom_pass
    if isinstance(current, PreGradPass):
        return current
    inductor.pre_grad_custom_pass = PreGradPass(current)
    logging.getLogger("torch._inductor.codecache").addFilter(_Quiet())
    return inductor.pre_grad_custom_pass
