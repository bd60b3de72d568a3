"""The rerouting that sends chosen call sites of a model's own `forward` to perfloop.nn.functional's
fused functions, without a change to the model's code; and the reading of that code it rests on
(the forward a module runs, its aliases of torch.nn.functional, its activation modules, the lines
of each call).

A module whose forward was checked by `pl.patch` gets, as its instance's `forward`, a `Rerouted`
object: the class's own forward run with its `torch.nn.functional` names (`F`, or any alias)
resolved through a proxy; at the verified source lines the proxy hands out the fused function,
elsewhere torch's.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F

from perfloop.nn.functional import FUSED, TORCH
from perfloop.nn.registry import CALLS, GATES


def class_forward(module: torch.nn.Module):
    """What the module's class holds as its forward (a decorator's wrapper, if any), as stored:
    a descriptor-based decorator is not asked to bind itself."""
    found = inspect.getattr_static(type(module), "forward")
    return getattr(found, "__func__", found)


def forward_function(module: torch.nn.Module):
    """The function whose code the module's forward runs: the class's forward, unwrapped through
    the decorators that keep what they wrap as `__wrapped__` (functools.wraps)."""
    return inspect.unwrap(class_forward(module))


def _codes(code: types.CodeType):
    """A function's code and the code nested in it (comprehensions, lambdas, inner functions),
    which run with the function's globals."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def rewrap(outer, inner):
    """`outer` (a chain of decorators' wrappers ending at the function they wrap) with `inner`
    in that function's place: each wrapper rebuilt with the closure cell that held what it wraps
    holding the new one. None where a wrapper does not hold it in its closure (a class-based
    decorator): then the wrapped code cannot be rerouted."""
    wrapped = getattr(outer, "__wrapped__", None)
    if wrapped is None:
        return inner
    new_wrapped = rewrap(wrapped, inner)
    if new_wrapped is None or not isinstance(outer, types.FunctionType):
        return None
    cells = outer.__closure__ or ()
    held = [i for i, c in enumerate(cells) if _cell(c) is wrapped]
    if not held:
        return None
    closure = tuple(types.CellType(new_wrapped) if i in held else c for i, c in enumerate(cells))
    out = types.FunctionType(outer.__code__, outer.__globals__, outer.__name__, outer.__defaults__, closure)
    out.__kwdefaults__ = outer.__kwdefaults__
    out.__dict__.update(outer.__dict__, __wrapped__=new_wrapped)
    return out


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def why_not_rerouted(module: torch.nn.Module) -> str | None:
    """Why the module's forward cannot be given a rerouted copy, or None."""
    outer = class_forward(module)
    if outer is not forward_function(module) and rewrap(outer, forward_function(module)) is None:
        return (
            f"{type(module).__name__}.forward is wrapped by a decorator that does not hold the function "
            "in its closure (a class-based decorator?): perfloop cannot rebuild it to reach its calls"
        )
    return None


def functional_aliases(fn) -> dict[str, str]:
    """{global name: what it is} for the names `fn` uses (in comprehensions and inner functions
    too) that are torch.nn.functional (as a module: "F") or one of its fusable functions
    (imported bare: "layer_norm" ...)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    out = {}
    g = fn.__globals__
    for name in {n for c in _codes(code) for n in c.co_names}:
        v = g.get(name)
        if v is F:
            out[name] = "F"
        else:
            for fused in (*CALLS, *GATES):
                if v is getattr(F, fused):
                    out[name] = fused
    return out


def site_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's modules whose own forward (Python code of the model's, not torch's) calls
    torch.nn.functional by a name in its globals, with one of the fusable functions in reach."""
    out = []
    for name, m in model.named_modules():
        fn = forward_function(m)
        if getattr(fn, "__module__", "").startswith("torch.") or not isinstance(fn, types.FunctionType):
            continue
        aliases = functional_aliases(fn)
        names = {n for c in _codes(fn.__code__) for n in c.co_names}
        if (
            any(v != "F" for v in aliases.values())
            or (any(v == "F" for v in aliases.values()) and names & {*CALLS, *GATES})
            or _gates_modules(fn, module_activations(m, names))
        ):
            out.append((name, m))
    return out


def module_activations(module: torch.nn.Module, names=None) -> dict[str, tuple[str, str]]:
    """{attribute: (activation, GELU's approximate form)} of the module's children that compute
    SiLU or GELU (torch's, or a model's own such as Hugging Face's ACT2FN["silu"], checked on a
    float64 probe) and carry no hooks: `self.act_fn(a) * b` in its forward is a gate. `names`:
    only those attributes."""
    out = {}
    children = module.__dict__.get("_modules", {})  # none while a pickled module is being rebuilt
    for attr, child in children.items():
        if names is not None and attr not in names:
            continue
        form = _activation(child)
        if form is not None:
            out[attr] = form
    return out


def _activation(m: torch.nn.Module) -> tuple[str, str] | None:
    hooked = any(getattr(m, h, None) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"))
    if hooked or next(m.parameters(), None) is not None or next(m.children(), None) is not None:
        return None
    if isinstance(m, torch.nn.SiLU):
        return ("silu", "none")
    if isinstance(m, torch.nn.GELU):
        return ("gelu", m.approximate)
    if type(m).__module__.startswith("torch."):  # torch's others (Dropout, ReLU, ...) are no gate
        return None
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:  # the random state as it was, whatever the module draws
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            y = m(probe)
    except Exception:  # not an elementwise function of one tensor
        return None
    if not isinstance(y, torch.Tensor) or y.shape != probe.shape or y.dtype != probe.dtype:
        return None
    for act, form, want in (
        ("silu", "none", F.silu(probe)),
        ("gelu", "tanh", F.gelu(probe, approximate="tanh")),
        ("gelu", "none", F.gelu(probe)),
    ):
        if torch.allclose(y, want, rtol=1e-10, atol=1e-12):
            return (act, form)
    return None


_GATED: dict = {}  # (code, activations) -> whether gated_code finds a gate: read once per class


def _gates_modules(fn, activations: dict) -> bool:
    if not activations:
        return False
    key = (fn.__code__, tuple(sorted(activations.items())))
    if key not in _GATED:
        _GATED[key] = gated_code(fn, {}, activations) is not None
    return _GATED[key]


def call_lines(fn, names) -> dict[str, list[int]]:
    """{function: the source lines of fn where it is called} for these torch.nn.functional
    names, by F (any alias) or imported bare; read from fn's code, nothing run."""
    out: dict = {}
    for alias, what in functional_aliases(fn).items():
        for name in names if what == "F" else [what] if what in names else []:
            lines = _loads(fn, name if what == "F" else alias)
            if lines:
                out.setdefault(name, set()).update(lines)
    return {k: sorted(v) for k, v in out.items()}


class _Proxy:
    """torch.nn.functional as the rerouted forward sees it: `calls` decides per source line."""

    def __init__(self, route):
        self._route = route

    def __getattr__(self, name):
        if name in FUSED:
            return self._route(name, sys._getframe(1).f_lineno)
        return getattr(F, name)


GATE_CALL = "__perfloop_gate__"


def gated_code(fn, aliases: dict[str, str], activations: dict | None = None):
    """fn's code with each activation-times-gate it writes out (`F.silu(a) * b`, `b * F.gelu(a)`,
    ..., or `self.act_fn(a) * b` where `activations` names act_fn: module_activations) made one
    call, `__perfloop_gate__(activation, line, gated_first, left, right, **kw)`, its operands
    evaluated in their written order; the source lines kept. None where fn writes none, or its
    source or closure cannot be had again."""
    import ast
    import inspect
    import textwrap

    if fn.__code__.co_freevars:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    f_names = {a for a, what in aliases.items() if what == "F"}
    bare = {a: what for a, what in aliases.items() if what in GATES}
    activations = activations or {}

    def activation(node) -> str | None:
        if not (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            return None
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == owner:
            if f.attr not in activations or node.keywords:
                return None
            act, form = activations[f.attr]
            if act == "gelu":  # the module's form, said to the gate
                node.keywords = [ast.keyword("approximate", ast.Constant(form))]
            return act
        on_f = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in f_names
        act = f.attr if on_f else bare.get(f.id) if isinstance(f, ast.Name) else None
        allowed = {"approximate"} if act == "gelu" else set()
        return act if act in GATES and {k.arg for k in node.keywords} <= allowed else None

    class Gates(ast.NodeTransformer):
        found = 0

        def visit_BinOp(self, node):
            self.generic_visit(node)
            if not isinstance(node.op, ast.Mult):
                return node
            for first, call in ((True, node.left), (False, node.right)):
                act = activation(call)
                if act:
                    self.found += 1
                    operands = [call.args[0], node.right] if first else [node.left, call.args[0]]
                    args = [ast.Constant(act), ast.Constant(call.lineno), ast.Constant(first), *operands]
                    return ast.copy_location(
                        ast.Call(ast.Name(GATE_CALL, ast.Load()), args, call.keywords), node
                    )
            return node

    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    owner = fdef.args.args[0].arg if fdef.args.args else None  # `self`
    first = min([fdef.lineno, *(d.lineno for d in fdef.decorator_list)])
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - first)  # the file's lines, as the code's
    fdef.decorator_list = []
    gates = Gates()
    gates.visit(tree)
    if not gates.found:
        return None
    ast.fix_missing_locations(tree)
    module = compile(tree, fn.__code__.co_filename, "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)


class _Globals(dict):
    """A function's globals with some names bound otherwise; every other name read live from the
    module's own globals (a flag the module sets later is seen)."""

    def __init__(self, base: dict, bound: dict):
        super().__init__(bound)
        self.base = base

    def __missing__(self, key):
        return self.base[key]  # KeyError: Python goes on to the builtins


def _loads(fn, name: str) -> set[int]:
    """The source lines where fn's code loads `name` (as a global or an attribute)."""
    import dis

    ops = ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD")
    return {
        i.positions.lineno
        for code in _codes(fn.__code__)
        for i in dis.get_instructions(code)
        if i.opname in ops and i.argval == name
    }


def _function(fn, bound: dict, code=None):
    out = types.FunctionType(
        code or fn.__code__, _Globals(fn.__globals__, bound), fn.__name__, fn.__defaults__, fn.__closure__
    )
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _graph_function(fn, bound: dict, owner):
    """fn with these names bound otherwise, for torch.compile: which reads a function's globals
    from the module that sys.modules has under their `__name__`, so the globals are a module's
    of their own (a copy taken now; gone with `owner`)."""
    import weakref

    name = f"perfloop_rerouted_{id(owner):x}"
    mod = types.ModuleType(name)
    mod.__dict__.update(fn.__globals__)
    mod.__dict__.update(bound, __name__=name)
    sys.modules[name] = mod
    weakref.finalize(owner, sys.modules.pop, name, None)
    out = types.FunctionType(fn.__code__, mod.__dict__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


class Rerouted:
    """The instance's forward: the class's own function, its functional calls at `sites` (name
    -> source lines) sent to the fused versions. `record`, while set, is told of every fusable
    call (name, line, args, kwargs) and lets torch's run.

    Under torch.compile (which cannot follow a call's line) a function is sent to its fused
    version where every line calling it is a verified site, and the fused versions put the
    kernels `compiled.in_graph` names into the graph."""

    def __init__(self, owner: torch.nn.Module, fn, sites: dict[str, set[int]], outer=None):
        self.owner, self.fn, self.sites, self.outer = owner, fn, sites, outer or fn
        self.record = None
        proxy = _Proxy(self._route)
        aliases = functional_aliases(fn)
        bound = {a: proxy if w == "F" else self._bare(w) for a, w in aliases.items()}
        self._eager = rewrap(
            self.outer,
            _function(
                fn, bound | {GATE_CALL: self._gate}, gated_code(fn, aliases, module_activations(owner))
            ),
        )
        whole = {n for n, lines in sites.items() if lines and _loads(fn, n) <= lines}
        bound = {}
        for alias, what in aliases.items():
            if what == "F" and whole:
                bound[alias] = types.ModuleType("perfloop.nn.reroute.rerouted")
                bound[alias].__dict__.update(vars(F))
                bound[alias].__dict__.update({n: FUSED[n] for n in whole})
            elif what != "F" and _loads(fn, alias) <= sites.get(what, set()):
                bound[alias] = FUSED[what]
        self._graph = rewrap(self.outer, _graph_function(fn, bound, self))

    def _route(self, name: str, line: int):
        if name not in FUSED:
            return getattr(F, name)
        if self.record is not None:
            return lambda *a, **k: self.record(name, line, a, k)
        return FUSED[name] if line in self.sites.get(name, ()) else getattr(F, name)

    def _gate(self, act: str, line: int, gated_first: bool, left, right, **kw):
        name = GATES[act]
        a, b = (left, right) if gated_first else (right, left)
        if self.record is not None:
            return self.record(name, line, (a, b), kw)
        return (FUSED[name] if line in self.sites.get(name, ()) else TORCH[name])(a, b, **kw)

    def _bare(self, what: str):
        def call(*a, **k):  # `layer_norm(...)` imported bare: routed by its caller's line
            return self._route(what, sys._getframe(1).f_lineno)(*a, **k)

        return call

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self._graph(self.owner, *args, **kwargs)
        return self._eager(self.owner, *args, **kwargs)

    def __getstate__(self):
        return {"owner": self.owner, "fn": self.fn, "sites": self.sites, "outer": self.outer}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["fn"], state["sites"], state.get("outer"))


def reroute(module: torch.nn.Module, sites: dict[str, set[int]]) -> Rerouted:
    """Give `module` a forward that sends the functional calls at `sites` to the fused versions."""
    r = Rerouted(module, forward_function(module), sites, class_forward(module))
    module.forward = r
    return r


def restore(module: torch.nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), Rerouted):
        del module.forward
