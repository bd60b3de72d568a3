"""Put fused modules into a user's model only where they are proven equal on that model.

`patch(model, example_batch, loss_fn)` finds the modules it can replace (torch's LayerNorm,
RMSNorm, GELU and CrossEntropyLoss by type; Llama-style RMSNorm by its shape), records each one's
inputs on the example batch, and for each runs forward and backward with the original module
and with the fused one, against a float64 run of the original: the output and the gradient of
every input and parameter within the op's declared tolerances (or within twice the original
module's own error in its dtype, where that is larger). Only modules that pass are replaced;
the report says what was replaced, what was refused and why, and the largest errors.

The model after `patch` is the model it was but for the swapped submodules: its gradients,
buffers, training mode and random state as they were before (the checks and timed steps run on
top and are undone), each swapped module's hooks and attributes carried over, every name a
shared module goes by pointing at the one fused module; a call that fails swaps nothing.

    >>> report = pl.patch(model, (x, y), loss_fn=lambda m, b: m(*b))   # doctest: +SKIP
    >>> print(report)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from perfloop.nn import functional as _functional
from perfloop.nn import heads as _heads
from perfloop.nn import loss_function as _loss_function
from perfloop.nn import registry
from perfloop.nn import reroute as _reroute
from perfloop.nn import rewrite as _rewrite
from perfloop.nn import verify as _verify
from perfloop.nn.keep import keep_what_pays as _keep_what_pays
from perfloop.nn.modules import why_not
from perfloop.nn.swapping import (
    candidates,
    named,
    restore_forward,
    route_sites,
    run_step,
    set_module,
    step_loss,
)
from perfloop.nn.verify import Swap


@dataclass
class PatchReport:
    swaps: list[Swap]
    timing: dict | None = None  # measure=True: the step before and after
    compiled: bool = False  # the model given was compiled (torch.compile's OptimizedModule)
    # what patch did not check, by where, and why (the step: it gave no loss to time)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def replaced(self) -> list[str]:
        return [s.name for s in self.swaps if s.replaced]

    @property
    def refused(self) -> dict[str, str]:
        return {s.name: s.reason for s in self.swaps if not s.replaced}

    def __str__(self) -> str:
        lines = [f"patched {len(self.replaced)} of {len(self.swaps)} candidate modules"]
        lines += [f"  skipped  {where}: {why}" for where, why in self.skipped.items()]
        for s in self.swaps:
            worst = max(s.errors.items(), key=lambda kv: kv[1][0], default=None)
            err = (
                f"; largest error {worst[0]}: {worst[1][0]:.2g} (the original's {worst[1][1]:.2g})"
                if worst
                else ""
            )
            also = f" (also {', '.join(s.aliases)})" if s.aliases else ""
            kind = "" if s.site else f" ({s.kind}{': ' + s.via if s.via else ''})"
            lines.append(
                f"  {'replaced' if s.replaced else 'kept    '} {s.name}{also}{kind}{err}"
                + (f": {s.reason}" if s.reason else "")
            )
        if self.timing:
            t = self.timing
            if t.get("compiled"):
                lines.append("each step timed compiled (torch.compile, default options)")
            for k, c in t["candidates"].items():
                sig = " (significant)" if c["significant"] else ""
                lines.append(
                    f"step {k}: {c.get('before_ms', t['before_ms']):.3f} ms -> {c['ms']:.3f} ms, "
                    f"{c['speedup']:.3f}x "
                    f"[{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]{sig}"
                )
            lines.append(f"kept: {', '.join(t['kept']) or 'nothing'} ({t['verdict']})")
            if t["device"] == "cpu":
                lines.append("timed on the CPU (the kernels interpreted): not a speed; time it on a GPU")
            if t.get("peak_before") is not None:
                peaks = ", ".join(f"{k} {c['peak'] / 2**20:.0f}" for k, c in t["candidates"].items())
                lines.append(f"peak memory (MiB): before {t['peak_before'] / 2**20:.0f}, {peaks}")
        if self.compiled and not (self.timing or {}).get("compiled"):
            lines.append(
                "the model is compiled: under torch.compile the swapped modules and rewritten forwards run "
                "as Inductor compiles them, so what pays eager may not pay there; measure=True, "
                "compiled=True keeps only what does"
            )
        return "\n".join(lines)


def _names(model: nn.Module) -> dict[int, list[str]]:
    """id(module) -> every name it goes by in the model (a shared module has several)."""
    names: dict = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    return names


@contextlib.contextmanager
def _preserved(model: nn.Module):
    """Within: run the model as much as needed; after: its gradients (the same tensors), buffers,
    training modes and random state as they were."""
    params = {id(p): p for p in model.parameters()}.values()
    grads = [(p, p.grad) for p in params]
    for p in params:  # every backward inside makes new gradient tensors: the user's stay untouched
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in {id(b): b for b in model.buffers()}.values()]
    modes = [(m, m.training) for m in model.modules()]
    plain = lambda k: not k.startswith("_") and k not in ("forward", "training")
    # what forward may set on a module (a last loss)
    attrs = [(m, {k: v for k, v in vars(m).items() if plain(k)}) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, training in modes:
            m.training = training
        for m, saved in attrs:
            m.__dict__.update(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _capture(model, batch, loss_fn, modules: dict, sites: list, loss=None) -> tuple:
    """One run of the step on the example batch, torch's own code computing: (each candidate
    module's first call by id, each functional call site's first call by (module name, function,
    line) -- both as _verify.recorded gives them --, the step's output, the first calls of the
    model's `loss` function and its cross entropy, a _loss_function.Recording)."""
    seen: dict = {}
    calls: dict = {}

    def hook(m, args, kwargs):
        if id(m) not in seen:
            seen[id(m)] = _verify.recorded(args, kwargs)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules.values()]
    routed = []
    for name, m in sites:

        def record(fname, line, args, kwargs, name=name):
            if (name, fname, line) not in calls:
                calls[(name, fname, line)] = _verify.recorded(args, kwargs)
            return _functional.torch_function(fname)(*args, **kwargs)

        _reroute.reroute(m, {}).record = record
        routed.append(m)
    recording = _loss_function.recording(model, loss) if loss else contextlib.nullcontext()
    try:
        with torch.no_grad(), recording as rec:
            out = run_step(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
        for m in routed:
            _reroute.restore(m)
    return seen, calls, out, rec


def _adopt(original: nn.Module, fused: nn.Module) -> nn.Module:
    """The fused module takes over the original's hooks (the same dicts: the user's handles still
    remove them) and the attributes the user set on it."""
    for h in _verify.HOOKS:
        if hasattr(original, h):
            setattr(fused, h, getattr(original, h))
    fused._is_full_backward_hook = getattr(original, "_is_full_backward_hook", None)
    for k, v in original.__dict__.items():
        if k not in fused.__dict__ and not k.startswith("_perfloop"):
            fused.__dict__[k] = v
    return fused


class _Call(nn.Module):
    """One functional call as a module, for the checks: fn(*args, **kwargs)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


_CALL_SHOWN = {"silu_gate": "F.silu(a) * b", "gelu_gate": "F.gelu(a) * b"}


def _site_label(module_name: str, module: nn.Module, fname: str, line: int) -> str:
    fn = _reroute.forward_function(module)
    where = f"{fn.__code__.co_filename.rsplit('/', 1)[-1]}:{line}"
    return f"{module_name or type(module).__name__}: {_CALL_SHOWN.get(fname, 'F.' + fname)} ({where})"


def _check_call(label: str, fname: str, args, kwargs, autocast_dtype) -> Swap:
    why = _functional.why_not_call(fname, args, kwargs)
    if why:
        return Swap(label, _CALL_SHOWN.get(fname, f"F.{fname}"), False, why)
    torch_fn, fused = _Call(_functional.torch_function(fname)), _Call(_functional.FUSED[fname])
    kind = _CALL_SHOWN.get(fname, f"F.{fname}")
    return _verify.check(label, torch_fn, fused, args, kwargs, autocast_dtype, registry.get(fname).op, kind)


def _check_arguments(model, example_batch, loss_fn) -> None:
    """Refuse, naming the argument, what patch cannot check swaps on: a model that is not a
    Module (or is TorchScript), parameters without values (meta), a batch without rows, a
    loss_fn that cannot be called."""
    from perfloop.errors import ArgumentError

    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "model: a TorchScript module (torch.jit.script / trace) cannot be patched: its forward "
            "is TorchScript, not Python; patch the nn.Module before scripting it"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ArgumentError(
            "model",
            "its parameters are on the meta device (shapes without values), so no swap can be "
            "checked: materialize it first (model.to_empty(device=...) and load its weights)",
        )
    batch = example_batch if isinstance(example_batch, (tuple, list, Mapping)) else (example_batch,)
    for i, t in batch.items() if isinstance(batch, Mapping) else enumerate(batch):
        if isinstance(t, torch.Tensor) and t.numel() == 0:
            raise ArgumentError(
                "example_batch",
                f"tensor {i!r} has no elements (shape {tuple(t.shape)}); patch checks each swap on "
                "the model's activations: give a batch with at least one row",
            )


def patch(
    model: nn.Module,
    example_batch: tuple | list | Mapping | torch.Tensor,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    measure: bool = False,
    budget_s: float = 3.0,
    compiled: bool = False,
    logits: bool = True,
) -> PatchReport:
    """Replace the modules of `model` that have a fused perfloop.nn version, each only after it
    matched the original on this model's own activations and gradients (see the module
    docstring). `loss_fn(model, example_batch)` runs one step's forward (default: the model
    called as its docs call it, `model(**batch)` for a dict or BatchEncoding, `model(*batch)`
    for a tuple or list, `model(batch)` for a tensor). With `measure=True` the training step
    (forward, backward on the loss wherever the output holds it: swapping.step_loss) is timed
    before and after, interleaved (`compare`), with peak memory both ways; where more
    than one kind of module was swapped, each kind alone is timed too, and a kind whose swap
    does not make the step faster is put back (the report says so). `compiled=True` (for a
    model that will run under torch.compile): each of those steps is timed compiled
    (torch.compile, default options, compiled before the timing), so only what pays under
    compile is kept. `logits=False`: the step does not read the logits a forward returns beside
    its loss; a head written the usual way (a bias-free Linear, views, F.cross_entropy) is then
    fused into perfloop's linear + cross entropy, eager and under torch.compile, and those
    logits come back as None.
    """
    if not isinstance(logits, bool):
        raise TypeError(
            f"logits: expected True or False, got {logits!r}; False lets pl.patch fuse a head "
            "whose logits the step does not read"
        )
    if compiled and not measure:
        raise ValueError("compiled: True times the step compiled, which needs measure=True as well")
    _check_arguments(model, example_batch, loss_fn)
    cands = candidates(model)
    taken = {id(m) for _, m, _ in cands}
    sites = [(n, m) for n, m in _reroute.site_modules(model) if id(m) not in taken]
    unreachable = [
        Swap(n or type(m).__name__, "forward", False, _reroute.why_not_rerouted(m))
        for n, m in sites
        if _reroute.why_not_rerouted(m)
    ]
    sites = [(n, m) for n, m in sites if not _reroute.why_not_rerouted(m)]
    written = [(n, m) for n, m in model.named_modules() if id(m) not in taken and _rewrite.writes(m)]
    rewrites = [(n or type(m).__name__, m) for n, m in written]
    if not cands and not sites and not rewrites:
        return PatchReport(unreachable)
    names = _names(model)
    swapped: list = []  # (name, original) of each attribute set, (None, module) rerouted: undone on failure
    try:
        with _preserved(model):
            found = (cands, sites, rewrites)
            timing = {"budget_s": budget_s, "compiled": compiled} if measure else None
            report = _patch(model, found, names, example_batch, loss_fn, timing, swapped, logits)
            report.swaps += unreachable
            report.compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    except BaseException:
        for name, original in reversed(swapped):
            if name is None:
                restore_forward(original)
            else:
                set_module(model, name, original)
        raise
    return report


def _patch(
    model, found, names, example_batch, loss_fn, measure: dict | None, swapped, logits=True
) -> PatchReport:
    cands, sites, rewrites = found
    before = _verify.copy_module(model) if measure else None
    groups = [(n or type(m).__name__, m) for n, m in _heads.find(model)]
    watched = {n: m for n, m, _ in cands} | dict(rewrites) | dict(groups)
    loss = _loss_function.find(model)
    seen, calls, out, recorded_loss = _capture(model, example_batch, loss_fn, watched, sites, loss)
    scalar, why = step_loss(out)
    if measure and scalar is None:  # nothing swapped yet: the model stays as it was
        return PatchReport([], skipped={"step": f"measure=True times its forward and backward, but {why}"})
    swaps, originals = [], {}
    for name, original, fused in cands:
        aliases = [n for n in names[id(original)] if n != name and n]
        if why_not(original):
            swaps.append(Swap(name, type(original).__name__, False, why_not(original), aliases=aliases))
            continue
        if id(original) not in seen:
            swaps.append(
                Swap(name, type(original).__name__, False, "not called by the example batch", aliases=aliases)
            )
            continue
        args, kwargs, autocast_dtype = seen[id(original)]
        row = registry.by_module(type(original).__name__) or registry.by_module(type(fused).__name__)
        op = row.op if row is not None else "rmsnorm"
        swap = _verify.check(name, original, fused, args, kwargs, autocast_dtype, op)
        swap.aliases = aliases
        if swap.replaced and original is not model:
            _adopt(original, fused)
            for n in (name, *aliases):
                set_module(model, n, fused)
                swapped.append((n, original))
            originals[name] = original
        elif swap.replaced:
            swap = Swap(name, swap.kind, False, "it is the model itself: use perfloop.nn's module directly")
        swaps.append(swap)
    heads = _fuse_heads(model, rewrites, seen, names, swapped, logits)
    merged = _merge_heads(groups, seen, swapped)
    swaps += heads + merged
    fused = {id(named(model, s.name)) for s in heads if s.replaced}
    fused |= {id(h) for s in merged if s.replaced for h in _heads.heads_of(named(model, s.name))}
    for (mname, fname, line), (args, kwargs, autocast_dtype) in sorted(calls.items()):
        m = model.get_submodule(mname)
        if id(m) in fused:
            continue
        swap = _check_call(_site_label(mname, m, fname, line), fname, args, kwargs, autocast_dtype)
        swap.site = (mname, fname, line)
        swaps.append(swap)
    rerouted = route_sites(model, swaps)
    swapped.extend((None, m) for m in rerouted)
    for name, m in rewrites:
        if _rewrite.writes(m) == {_rewrite.LOSS} or id(m) in fused:
            continue  # a head merged with its neighbours is not rewritten alone
        swap = _verify.check_written(name, m, seen.get(id(m)), rerouted)
        swap.aliases = [n for n in names[id(m)] if n != name and n]
        if swap.replaced:
            _rewrite.rewrite(m)
            swapped.append((None, m))
        swaps.append(swap)
    if loss is not None:
        swaps.append(_check_loss_function(model, loss, recorded_loss, swapped))
    report = PatchReport(swaps)
    if measure and report.replaced:
        report.timing = _keep_what_pays(report, originals, before, model, example_batch, loss_fn, **measure)
    return report


def _check_loss_function(model, fn, recorded: _loss_function.Recording, swapped) -> Swap:
    """Check the model's loss function with its cross entropy fused on its own first call
    (the logits' gradient too), and set it where it matches."""
    name, kind = "loss_function", _loss_function.KIND
    via = f"{fn.__name__} -> F.cross_entropy -> perfloop's fused cross entropy"
    if recorded.call is None or recorded.cross_entropy is None:
        why = "not called by the example batch (a batch without labels computes no loss)"
        return Swap(name, kind, False, why, via=via)
    why = _functional.why_not_call("cross_entropy", *recorded.cross_entropy[:2])
    if why:
        return Swap(name, kind, False, f"its F.cross_entropy call has no fused kernel: {why}", via=via)
    args, kwargs, autocast_dtype = recorded.call
    fused = _Call(_loss_function.FusedLoss(fn))
    swap = _verify.check(name, _Call(fn), fused, args, kwargs, autocast_dtype, "cross_entropy", kind)
    swap.via = via
    if swap.replaced:
        _loss_function.apply(model)
        swapped.append((None, model))
    return swap


def _merge_heads(groups, seen, swapped) -> list[Swap]:
    """Check and make the merge of one-module-per-head attention (nn.heads): each form (scale,
    causal) tried on a copy of the parent against its own output and gradients, in eval mode
    (dropout off: SDPA draws its masks otherwise); the first that matches is made."""
    out = []
    for name, parent in groups:
        if id(parent) not in seen:
            out.append(Swap(name, _heads.KIND, False, "not called by the example batch"))
            continue
        args, kwargs, autocast_dtype = seen[id(parent)]
        first = None
        for scale, causal in _heads.FORMS:
            fused = _verify.copy_module(parent)
            _heads.merge(fused, scale, causal)
            fused.eval()
            try:
                with _verify.eval_mode(parent):
                    swap = _verify.check(
                        name, parent, fused, args, kwargs, autocast_dtype, "attention", _heads.KIND
                    )
            except Exception as exc:
                swap = Swap(
                    name, _heads.KIND, False, f"the check could not run it: {type(exc).__name__}: {exc}"
                )
            first = first or swap
            if swap.replaced:
                swap.via = _heads.merge(parent, scale, causal).said()
                swap.options = {"scale": scale, "causal": causal}
                swapped.append((None, parent))
                break
        out.append(swap if swap.replaced else first)
    return out


def _fuse_heads(model, rewrites, seen, names, swapped, logits: bool) -> list[Swap]:
    """Check and make the head rewrites (nn.head) of modules whose forward computes a cross
    entropy from their own Linear, before any of their functional calls is rerouted."""
    out = []
    for name, m in rewrites:
        if _rewrite.LOSS not in _rewrite.writes(m):
            continue
        if logits:
            why = (
                "pl.patch(..., logits=False) checks it where the step does not read the logits: the "
                "head's linear and cross entropy fused, the logits returned as None"
            )
            out.append(Swap(name, _rewrite.LOSS, False, why))
            continue
        swap = _verify.check_written(name, m, seen.get(id(m)), [], logits=False)
        swap.aliases = [n for n in names[id(m)] if n != name and n]
        if swap.replaced and _rewrite.LOSS in swap.kind:
            swap.options["logits"] = False
            _rewrite.rewrite(m, logits=False)
            swapped.append((None, m))
        elif swap.replaced:
            swap.replaced, swap.reason = False, "its head is not one fused call; checked without it below"
        out.append(swap)
    return out
