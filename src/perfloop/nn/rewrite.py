"""Patterns written out op by op in a module's own forward, replaced by fused calls without a
change to the model's code: attention (nn.sdpa), rotary embeddings (nn.rotary), GELU and norms
(nn.pointwise).

The forward is captured by Dynamo (a `torch.compile` whose backend runs the captured graph eager,
after the rewrite): Dynamo follows real code (shape arithmetic, `math.sqrt`, slices of registered
buffers, branches on config) and re-captures where a guard fails (a new shape, train or eval), so
each capture is rewritten for what it holds. A module gets a `Rewritten` forward; its state dict,
parameters and hooks stay as they were.
"""

from __future__ import annotations

import inspect
import types
import warnings

import torch
from torch.fx import GraphModule

from perfloop.nn import head, pointwise, rotary, sdpa
from perfloop.nn.compiled import all_in_graph
from perfloop.nn.fxnodes import Found, calls, values_of
from perfloop.nn.head import LOSS as LOSS
from perfloop.nn.pointwise import GELU as GELU  # the kinds nn.patch names
from perfloop.nn.pointwise import NORM as NORM
from perfloop.nn.rotary import ROPE as ROPE
from perfloop.nn.sdpa import ATTENTION as ATTENTION
from perfloop.nn.sdpa import HIDDEN as HIDDEN
from perfloop.nn.sdpa import softmax_lines as softmax_lines


def rewrite_graph(gm: GraphModule, inputs: list, lines: list | None = None) -> list[Found]:
    """Replace each written-out attention in `gm` by SDPA and each written-out RoPE by the fused
    op (in place, recompiled where any was); what each became, or why not. `lines`: the
    softmaxes' file:line where the graph keeps no stack traces (in order)."""
    found = sdpa.rewrite(gm, inputs, lines)
    found += _rewrite_ropes(gm, inputs)
    found += _rewrite_gelus(gm)
    found += _rewrite_norms(gm)
    found += head.rewrite(gm.graph)
    if any(f.replaced for f in found):
        gm.graph.lint()
        gm.recompile()
    return found


def _rewrite_ropes(gm: GraphModule, inputs: list) -> list[Found]:
    ropes = rotary.find(gm.graph)
    values = values_of(gm, inputs, [n for r in ropes for n in (r.cos, r.sin)]) if ropes else {}
    found = []
    for r in ropes:
        why = rotary.why_not(r, values)
        form = {
            "interleaved": r.interleaved,
            "form": "complex" if r.complex else "rotate_half" if r.doubled else "real",
        }
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
        form = {
            "form": "RMS" if m["rms"] else "layer",
            "eps": m["eps"],
            "weight": m["weight"] is not None,
            "bias": m["bias"] is not None,
        }
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
        self.sdpa = 0  # F.scaled_dot_product_attention calls they made (transformers' "sdpa")
        self.lines = sdpa.softmax_lines(fn)

    def __call__(self, gm: GraphModule, example_inputs: list):
        self.graphs += 1
        self.sdpa += sum(calls(n, *_SDPA) for n in gm.graph.nodes)
        try:
            self.found += rewrite_graph(gm, example_inputs, self.lines)
        except Exception as exc:
            self.found.append(Found("?", False, f"the captured graph could not be rewritten: {exc}"))
        return gm.forward


_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
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

    def __init__(self, owner: torch.nn.Module, fn, alone: bool = False, logits: bool | None = None) -> None:
        self.owner, self.fn, self.logits = owner, fn, logits
        if alone:
            fn = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            self.backend = Backend(fn)
        else:
            self.backend = backend_for(fn)
        self._compiled = torch.compile(fn, backend=self.backend)
        self.heads = head.allow(owner, logits) if logits is not None else []
        if self.heads:
            head.install()

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self._compiled is None:
            return self.fn(self.owner, *args, **kwargs)
        try:
            with all_in_graph():
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
        return {"owner": self.owner, "fn": self.fn, "logits": self.logits}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["fn"], logits=state.get("logits"))


def rewrite(module: torch.nn.Module, logits: bool | None = None) -> Rewritten:
    """Give `module` a forward whose written-out patterns run fused; with `logits` (whether the
    logits must be kept) its head too (nn.head), eager and under an outer torch.compile."""
    r = Rewritten(module, type(module).forward, logits=logits)
    module.forward = r
    return r


def restore(module: torch.nn.Module) -> None:
    r = module.__dict__.get("forward")
    if isinstance(r, Rewritten):
        head.disallow(r.heads)
        del module.forward


def _code_names(fn, depth: int = 1, cls: type | None = None) -> tuple[set, set, bool]:
    """(the global names fn's code and its nested code load, the other names and the float
    constants it uses, whether it uses the @ operator), taken down `depth` levels of the global
    functions it calls and, with `cls`, of the class's methods it calls (`self._attn(...)`)."""
    import dis

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
        names |= {k for k in c.co_consts if isinstance(k, float)}
    if depth:
        called = [fn.__globals__.get(n) for n in globs]
        called += [inspect.getattr_static(cls, n, None) for n in names] if cls is not None else []
        for f in called:
            if isinstance(f, types.FunctionType) and not f.__module__.startswith("torch"):
                g2, n2, m2 = _code_names(f, depth - 1, cls)
                globs, names, matmul = globs | g2, names | n2, matmul or m2
    return globs, names, matmul


_ROPE_NAMES = ("rotary", "rope", "rotate_half")


def writes(module: torch.nn.Module) -> set[str]:
    """What the module's own forward (its class's, and the functions it calls) may write out op
    by op: ATTENTION (a softmax and a matmul), ROPE (a global function named for rotary
    embeddings, rotate_half, or view_as_complex), GELU (erf, or tanh with the tanh form's
    0.044715), NORM (rsqrt, or sqrt with a mean or var), LOSS (a cross entropy, in a module with a
    bias-free Linear of its own). Candidates only: the capture decides."""
    fn = inspect.unwrap(type(module).forward)
    if getattr(fn, "__code__", None) is None or getattr(fn, "__module__", "").startswith("torch."):
        return set()
    globs, names, matmul = _code_names(fn, cls=type(module))
    out = set()
    if "softmax" in globs | names and (matmul or (globs | names) & {"matmul", "bmm"}):
        out.add(ATTENTION)
    if any(r in g.lower() for g in globs for r in _ROPE_NAMES) or "view_as_complex" in names:
        out.add(rotary.ROPE)
    cubic = any(isinstance(v, float) and abs(v - 0.044715) < 1e-9 for v in names)  # the tanh form's
    if ("tanh" in names | globs and cubic) or "erf" in names | globs:
        out.add(GELU)
    if {"cross_entropy", "CrossEntropyLoss"} & (globs | names) and head.owns_head(module):
        out.add(LOSS)
    if "rsqrt" in names | globs or ("sqrt" in names | globs and {"mean", "var"} & (names | globs)):
        out.add(NORM)
    return out


def written_kind(patterns: set) -> str:
    """The kind a swap of these patterns goes by ("attention written out", "RoPE written out",
    or both joined)."""
    return " and ".join(sorted(patterns)) or ATTENTION
