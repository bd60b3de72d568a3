"""Which nn.Module ran each op: while profiling, every module call is a profiler range named
by the module's qualified name (`transformer.h.3.attn.c_attn`), so the trace's event tree
says which module an op ran in.

A module called with no module around it is a root: it is named by its class, and the modules
under it by their attribute paths from it.
"""

from __future__ import annotations

import contextlib
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
