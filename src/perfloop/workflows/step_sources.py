"""Where a script's steps come from, told to its profiling window (workflows.window's Window:
`enter`, `exit`, `boundary`, `settle`): each optimizer's step(), torch.profiler's
record_function ranges, NVTX push/pop -- patched in for the script's run, put back after."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from perfloop.analysis import annotate
from perfloop.analysis.compilation import eager_hook, eager_hooks_skipped

OPTIMIZER_STEP = "optimizer.step"
AUTO = "auto"  # the step: whichever of workflows.window's AUTO_STEPS occurs first
NUMBERED = re.compile(r"#\d+$")  # ProfilerStep#12 -> ProfilerStep


@contextlib.contextmanager
def step_sources(w):
    """Within: the window is told of the script's steps and ranges -- each optimizer's step()
    (the first optimizer's are the boundaries), torch.profiler.record_function ranges (and
    torch.profiler's ProfilerStep#N), its model's decode calls (ModelCalls: where the step is
    still to be found, MODEL_CALL); NVTX push/pop in nvtx_sources. perfloop's own annotate
    tells it itself."""
    rf_cls = torch.autograd.profiler.record_function
    rf_enter, rf_exit = rf_cls.__enter__, rf_cls.__exit__
    stepping: list = []  # the optimizer whose step() is the boundary
    pending: list = []  # a boundary reached inside step(): acted on once its range has closed

    def flush() -> None:
        # the optimizer's hooks run inside its own record_function range ("Optimizer.step#...",
        # torch's wrapper of every step()): the boundary is acted on once that range has closed
        if pending:
            pending.clear()
            w.boundary(OPTIMIZER_STEP)
        w.settle()

    def told(rf) -> bool:  # torch's own optimizer ranges are told as optimizer.step boundaries
        return not annotate.annotating() and not rf.name.startswith("Optimizer.")

    marks = itertools.count()
    opened = threading.local()  # per thread: the marks of the record_function ranges open
    mark_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a range open -> its mark

    def begun_since(mark: int) -> bool:
        return any(m > mark for m in getattr(opened, "marks", ()))

    w.begun_since, w.mark = begun_since, lambda: next(marks)

    def __enter__(rf):  # told first: a window opening here has the range in its trace
        if told(rf):
            w.enter(NUMBERED.sub("", rf.name))
        out = rf_enter(rf)
        mark_of[rf] = next(marks)
        opened.__dict__.setdefault("marks", []).append(mark_of[rf])
        return out

    def __exit__(rf, *exc):
        try:
            return rf_exit(rf, *exc)
        finally:
            mark = mark_of.pop(rf, None)
            if mark is not None and mark in getattr(opened, "marks", ()):
                opened.marks.remove(mark)
            if told(rf):
                w.exit(NUMBERED.sub("", rf.name))
            elif rf.name.startswith("Optimizer.step#"):
                flush()
            w.settle()

    def stepped(opt, args, kwargs):
        if not stepping:
            stepping.append(opt)
        elif stepping[0] is not opt:
            if len(stepping) == 1:
                stepping.append(opt)
                first = type(stepping[0]).__name__
                w.warnings.append(f"several optimizers step ({first} first): a step ends at {first}.step()")
            return
        pending.append(True)

    import torch.optim.optimizer as optim_module

    hook = optim_module.register_optimizer_step_post_hook(stepped)
    rf_cls.__enter__, rf_cls.__exit__ = __enter__, __exit__
    try:
        with _model_calls(w):
            yield
    finally:
        hook.remove()
        rf_cls.__enter__, rf_cls.__exit__ = rf_enter, rf_exit


@contextlib.contextmanager
def _model_calls(w):
    """The window told of the decode calls of the script's model while its step is AUTO or
    MODEL_CALL (an optimizer's step or a range named by the user is the step otherwise); what
    they were said in its warnings, why none was a step kept in `w.model_calls`."""

    def ours() -> bool:
        return w.range_name in (AUTO, MODEL_CALL)

    calls = ModelCalls(
        begin=lambda: ours() and w.enter(MODEL_CALL),
        end=lambda: ours() and w.exit(MODEL_CALL),
        switchable=lambda: w.state == "before",
    )
    w.model_calls = calls
    try:
        with calls.watching():
            yield
    finally:
        if w.range_name == MODEL_CALL:
            w.warnings.extend(calls.said())


@contextlib.contextmanager
def nvtx_sources(w):
    """Within: the window is told of the script's NVTX ranges (push/pop, per thread)."""
    nvtx = torch.cuda.nvtx
    push, pop = nvtx.range_push, nvtx.range_pop
    names = threading.local()  # per thread: the NVTX ranges open

    def range_push(msg):
        if not annotate.annotating():
            names.__dict__.setdefault("open", []).append(msg)
            w.enter(msg)
        return push(msg)

    def range_pop():
        out = pop()
        stack = names.__dict__.get("open")
        if stack and not annotate.annotating():
            w.exit(stack.pop())
        return out

    nvtx.range_push, nvtx.range_pop = range_push, range_pop
    try:
        yield
    finally:
        nvtx.range_push, nvtx.range_pop = push, pop


MODEL_CALL = "model call"  # a step: one decode call of the script's model (ModelCalls)
STEP_SAID = "a step: "  # the line that says which model call a step is


@dataclass
class Model:
    """One model the script called under no_grad: its calls by tokens per sequence."""

    name: str
    params: int
    calls: int = 0
    prefills: list = field(default_factory=list)  # each non-decode call's tokens
    batches: Counter = field(default_factory=Counter)  # a decode call's sequences -> calls
    batch_order: list = field(default_factory=list)  # the decode batches in the order they first came


def call_tokens(args, kwargs) -> tuple[int, int] | None:
    """(sequences, tokens per sequence) of a language model's call: its token ids (`input_ids`,
    else the first integer tensor of two or more dimensions: gpt-fast's `idx`), or None."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        tensors = (*args, *kwargs.values())
        ids = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ids is None or ids.is_floating_point() or ids.is_complex() or ids.dim() < 2:
        return None
    return ids.shape[0], ids.shape[-1]


class ModelCalls:
    """The script's outermost calls of modules with parameters under no_grad / inference_mode
    (per thread), each read by its token ids: a decode call takes one token per sequence, any
    other (a prompt's prefill, an evaluation) more. `begin()` and `end()` are told of each decode
    call of the step's model: the decode-calling model with the most parameters, a larger one
    taking over while `switchable()`. Module hooks do not run inside compiled code: a model
    called only there is not seen."""

    def __init__(self, begin, end, switchable=lambda: True):
        self.begin, self.end, self.switchable = begin, end, switchable
        self.models: dict[int, Model] = {}  # id(module) -> what its calls were
        self.step: Model | None = None
        self._local = threading.local()  # per thread: the module calls in flight, the decode open
        self._hooked: dict[int, object] = {}  # id(module) -> the model, flagged to give _pre its kwargs
        self._pre_id = -1

    def _stack(self) -> list:
        return self._local.__dict__.setdefault("stack", [])

    def _model(self, module) -> Model:
        got = self.models.get(id(module))
        if got is None:
            inner = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it holds
            got = self.models[id(module)] = Model(
                type(inner).__name__, sum(p.numel() for p in module.parameters())
            )
        return got

    def _outermost(self, module) -> bool:
        stack = self._stack()
        return len(stack) == 1 and stack[0] is module and not torch.is_grad_enabled()

    def _pre(self, module, args, kwargs=None) -> None:
        """Each module call's first hook: the window told of a decode call before any range of
        the call opens (module_ranges' would straddle the profiler's start). Global hooks get no
        kwargs (transformers' generate passes input_ids so): a model's are read from its second
        call on, flagged for this hook in its own with-kwargs set."""
        self._stack().append(module)
        if not self._outermost(module) or next(module.parameters(), None) is None:
            return
        if id(module) not in self._hooked:
            module._forward_pre_hooks_with_kwargs[self._pre_id] = True
            self._hooked[id(module)] = module
            self._model(module)
        if kwargs is None or (call_tokens(args, kwargs) or (0, 0))[1] != 1:
            return
        m = self._model(module)
        if self.step is None or (m is not self.step and m.params > self.step.params and self.switchable()):
            self.step = m
        if m is self.step:
            self._local.open = module
            self.begin()

    def _post(self, module, args, *rest) -> None:
        """(module, args, kwargs, output); on the error path torch passes no kwargs."""
        stack = self._stack()
        if not stack or stack[-1] is not module:
            return
        outermost = self._outermost(module)
        stack.pop()
        if outermost and id(module) in self._hooked:
            self._count(self._model(module), call_tokens(args, rest[0] if len(rest) == 2 else {}))
        if getattr(self._local, "open", None) is module:
            self._local.open = None
            self.end()

    @staticmethod
    def _count(m: Model, tokens) -> None:
        m.calls += 1
        if tokens is None or tokens[1] != 1:
            m.prefills.append(tokens[0] * tokens[1] if tokens else None)
        else:
            m.batch_order += [] if tokens[0] in m.batches else [tokens[0]]
            m.batches[tokens[0]] += 1

    def hook(self):
        """Register the hooks; returns what removes them."""
        eager_hooks_skipped()
        from torch.nn.modules.module import (
            _global_forward_pre_hooks,
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        pre = register_module_forward_pre_hook(eager_hook(self._pre))
        self._pre_id = pre.id
        _global_forward_pre_hooks.move_to_end(pre.id, last=False)  # before module_ranges' and the window's
        post = register_module_forward_hook(eager_hook(self._post), with_kwargs=True, always_call=True)

        def remove() -> None:
            pre.remove()
            post.remove()
            for module in self._hooked.values():
                module._forward_pre_hooks_with_kwargs.pop(self._pre_id, None)

        return remove

    @contextlib.contextmanager
    def watching(self):
        remove = self.hook()
        try:
            yield self
        finally:
            remove()

    def traced(self) -> str | None:
        """The step's range in the trace: its model's root module range (modules.module_ranges)."""
        from perfloop.analysis.modules import PREFIX

        return PREFIX + self.step.name if self.step else None

    # ---- what was seen, in words
    def said(self) -> list[str]:
        """The step chosen, its prefill, and what else was called, as lines."""
        m = self.step
        if m is None:
            return []
        batch = f"batch {m.batch_order[0]}" if len(m.batch_order) == 1 else "a varying batch"
        prompts = [t for t in m.prefills if t is not None]
        prefill = (
            f"prefill ({len(m.prefills)} call{'s' * (len(m.prefills) != 1)}, "
            f"{'/'.join(map(str, sorted(set(prompts)))) or 'unknown'} tokens) left out"
            if m.prefills
            else "no prefill call seen"
        )
        out = [f"{STEP_SAID}one decode call of {m.name} (1 token per sequence, {batch}); {prefill}"]
        if len(m.batches) > 1:
            seqs = ", ".join(map(str, m.batch_order))
            out.append(
                f"the decode calls' batch varies ({seqs} sequences): a step's tokens differ from step "
                "to step; per-token figures read the profiled steps' batch"
            )
        others = [o for o in self.models.values() if o is not m and o.calls]
        if others:
            listed = ", ".join(f"{o.name} ({o.calls} calls, {o.params:,} parameters)" for o in [m, *others])
            out.append(
                f"{len(others) + 1} models were called under no_grad: {listed}; the step is {m.name}'s, "
                "the one with the most parameters that decodes"
            )
        return out

    def why_none(self) -> str:
        """Why no model call was a step (none seen, or none with one token per sequence)."""
        called = [m for m in self.models.values() if m.calls]
        if not called:
            return "no model was called under no_grad / inference_mode outside compiled code"
        m = max(called, key=lambda m: m.params)
        tokens = [t for t in m.prefills if t is not None]
        what = f" ({'/'.join(map(str, sorted(set(tokens))))} tokens)" if tokens else ""
        times = "once" if m.calls == 1 else f"{m.calls} times"
        return (
            f"the model {m.name} was called {times} under no_grad{what}: no decode call (one token "
            "per sequence, after a prompt) to step by"
        )
