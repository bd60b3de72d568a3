"""Which nn.Module ran each op: while profiling, every module call is a profiler range named
by the module's qualified name (`transformer.h.3.attn.c_attn`), so the trace's event tree
says which module an op ran in.

A module called with no module around it is a root: it is named by its class, and the modules
under it by their attribute paths from it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref

import torch
from torch._C._profiler import _RecordFunctionFast

from perfloop.analysis.compilation import eager_hook, eager_hooks_skipped

PREFIX = "module: "
HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class _Tracker:
    def __init__(self, quiet=None):
        self.quiet = quiet  # a callable: True while no range should be recorded
        self.names: dict[int, str] = {}  # id(module) -> qualified name
        self.roots: dict[str, weakref.ref] = {}  # root name -> the module
        self._local = threading.local()  # per thread: one range per module call in flight

    @property
    def open(self) -> list:
        stack = getattr(self._local, "open", None)
        if stack is None:
            stack = self._local.open = []
        return stack

    def _name(self, module) -> str:
        name = self.names.get(id(module))
        if name is None:  # a root: name it and everything under it
            inner = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it holds
            root = type(inner).__name__
            with contextlib.suppress(TypeError):
                self.roots.setdefault(root, weakref.ref(inner))
            self.names.setdefault(id(module), root)
            for qual, sub in inner.named_modules():
                self.names.setdefault(id(sub), qual or root)
            name = self.names[id(module)]
        return name

    @eager_hook  # inside a compiled graph the ranges would break it
    def pre(self, module, args):
        if self.quiet is not None and self.quiet():
            self.open.append(None)
            return
        rf = _RecordFunctionFast(PREFIX + self._name(module))
        rf.__enter__()
        self.open.append(rf)

    @eager_hook
    def post(self, module, args, output):
        if self.open:
            rf = self.open.pop()
            if rf is not None:
                rf.__exit__(None, None, None)


@contextlib.contextmanager
def module_ranges(quiet=None):
    """Within: each nn.Module call is a profiler range "module: <qualified name>" (none while
    `quiet()` is true). torch's warning that global hooks fire once more for a torch.compile'd
    module's wrapper is not shown: the hooks are these, and the ranges name the wrapper as the
    model."""
    t = _Tracker(quiet)
    eager_hooks_skipped()
    pre = torch.nn.modules.module.register_module_forward_pre_hook(t.pre)
    post = torch.nn.modules.module.register_module_forward_hook(t.post, always_call=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=HOOKS_WARNING)
            yield t
    finally:
        pre.remove()
        post.remove()
        while t.open:
            rf = t.open.pop()
            if rf is not None:
                rf.__exit__(None, None, None)


def reached_models(call, depth: int = 3) -> dict[str, weakref.ref]:
    """The models a call reaches, by class name as `module_ranges` names roots: nn.Modules among a
    partial's arguments, a function's closure and the globals its code names, a bound method's
    object, down `depth` callables. For the code that runs no module eagerly (a compiled function
    given the model, gpt-fast's `decode_one_token`), where no hook names one."""
    found: dict[str, weakref.ref] = {}

    def visit(obj, left: int) -> None:
        if isinstance(obj, torch.nn.Module):
            inner = getattr(obj, "_orig_mod", obj)
            with contextlib.suppress(TypeError):
                found.setdefault(type(inner).__name__, weakref.ref(inner))
            return
        if left <= 0 or not callable(obj):
            return
        if isinstance(obj, functools.partial):
            for v in (obj.func, *obj.args, *obj.keywords.values()):
                visit(v, left - 1)
            return
        visit(getattr(obj, "__self__", None), left - 1)
        fn = getattr(obj, "__wrapped__", None) or getattr(obj, "__func__", None) or obj
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        for cell in cells:
            with contextlib.suppress(ValueError):  # an empty cell
                visit(cell.cell_contents, left - 1)
        names = getattr(fn, "__globals__", {})
        for name in getattr(code, "co_names", ()):
            if isinstance(names.get(name), torch.nn.Module) or callable(names.get(name)):
                visit(names[name], left - 1)

    visit(call, depth)
    return found
