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
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from perfloop.nn import functional as _functional
from perfloop.nn import heads as _heads
from perfloop.nn import registry
from perfloop.nn import rewrite as _rewrite
from perfloop.nn import verify as _verify
from perfloop.nn.modules import fused_like, why_not
from perfloop.nn.verify import Swap


@dataclass
class PatchReport:
    swaps: list[Swap]
    timing: dict | None = None  # measure=True: the step before and after
    compiled: bool = False  # the model given was compiled (torch.compile's OptimizedModule)

    @property
    def replaced(self) -> list[str]:
        return [s.name for s in self.swaps if s.replaced]

    @property
    def refused(self) -> dict[str, str]:
        return {s.name: s.reason for s in self.swaps if not s.replaced}

    def __str__(self) -> str:
        lines = [f"patched {len(self.replaced)} of {len(self.swaps)} candidate modules"]
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


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        fused = fused_like(m)
        if fused is not None:
            out.append((name or type(m).__name__, m, fused))
    return out


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


def _capture(model, batch, loss_fn, modules: dict, sites: list) -> tuple[dict, dict, object]:
    """One run of the step on the example batch, torch's own code computing: (each candidate
    module's first call by id, each functional call site's first call by (module name, function,
    line) -- both as _verify.recorded gives them --, the step's output)."""
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

        _functional.reroute(m, {}).record = record
        routed.append(m)
    try:
        with torch.no_grad():
            out = _run(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
        for m in routed:
            _functional.restore(m)
    return seen, calls, out


def _run(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


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
    fn = _functional.forward_function(module)
    where = f"{fn.__code__.co_filename.rsplit('/', 1)[-1]}:{line}"
    return f"{module_name or type(module).__name__}: {_CALL_SHOWN.get(fname, 'F.' + fname)} ({where})"


def _check_call(label: str, fname: str, args, kwargs, autocast_dtype) -> Swap:
    why = _functional.why_not_call(fname, args, kwargs)
    if why:
        return Swap(label, _CALL_SHOWN.get(fname, f"F.{fname}"), False, why)
    torch_fn, fused = _Call(_functional.torch_function(fname)), _Call(_functional.FUSED[fname])
    kind = _CALL_SHOWN.get(fname, f"F.{fname}")
    return _verify.check(label, torch_fn, fused, args, kwargs, autocast_dtype, registry.get(fname).op, kind)


def _route_sites(model: nn.Module, swaps) -> list:
    """Reroute the modules of these (replaced) functional swaps; the modules rerouted."""
    by_module: dict = {}
    for s in swaps:
        if s.site is not None and s.replaced:
            by_module.setdefault(s.site[0], {}).setdefault(s.site[1], set()).add(s.site[2])
    out = []
    for name, sites in by_module.items():
        m = model.get_submodule(name)
        _functional.reroute(m, sites)
        out.append(m)
    return out


def _named(model: nn.Module, name: str) -> nn.Module:
    """The submodule of that name; the model itself under its class's name (as the report names it)."""
    return model if name == type(model).__name__ and not hasattr(model, name) else model.get_submodule(name)


def _restore_forward(module: nn.Module) -> None:
    _functional.restore(module)
    _rewrite.restore(module)
    _heads.unmerge(module)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


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
    batch = example_batch if isinstance(example_batch, (tuple, list)) else (example_batch,)
    for i, t in enumerate(batch):
        if isinstance(t, torch.Tensor) and t.numel() == 0:
            raise ArgumentError(
                "example_batch",
                f"tensor {i} has no elements (shape {tuple(t.shape)}); patch checks each swap on "
                "the model's activations: give a batch with at least one row",
            )


def patch(
    model: nn.Module,
    example_batch: tuple | list | torch.Tensor,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    measure: bool = False,
    budget_s: float = 3.0,
    compiled: bool = False,
    logits: bool = True,
) -> PatchReport:
    """Replace the modules of `model` that have a fused perfloop.nn version, each only after it
    matched the original on this model's own activations and gradients (see the module
    docstring). `loss_fn(model, example_batch)` runs one step's forward (default:
    `model(*example_batch)`). With `measure=True` the training step (forward, backward) is
    timed before and after, interleaved (`compare`), with peak memory both ways; where more
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
    cands = _candidates(model)
    taken = {id(m) for _, m, _ in cands}
    sites = [(n, m) for n, m in _functional.site_modules(model) if id(m) not in taken]
    unreachable = [
        Swap(n or type(m).__name__, "forward", False, _functional.why_not_rerouted(m))
        for n, m in sites
        if _functional.why_not_rerouted(m)
    ]
    sites = [(n, m) for n, m in sites if not _functional.why_not_rerouted(m)]
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
                _restore_forward(original)
            else:
                _set(model, name, original)
        raise
    return report


def _patch(
    model, found, names, example_batch, loss_fn, measure: dict | None, swapped, logits=True
) -> PatchReport:
    cands, sites, rewrites = found
    before = _verify.copy_module(model) if measure else None
    groups = [(n or type(m).__name__, m) for n, m in _heads.find(model)]
    watched = {n: m for n, m, _ in cands} | dict(rewrites) | dict(groups)
    seen, calls, out = _capture(model, example_batch, loss_fn, watched, sites)
    if measure and not (isinstance(out, torch.Tensor) and out.is_floating_point()):
        raise ValueError(
            f"loss_fn: measure=True times forward and backward of the step, which must give a "
            f"float tensor; the step gave a {type(out).__name__}. Pass loss_fn=lambda m, b: "
            "m(*b)[0] (or whichever part is the loss)"
        )
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
                _set(model, n, fused)
                swapped.append((n, original))
            originals[name] = original
        elif swap.replaced:
            swap = Swap(name, swap.kind, False, "it is the model itself: use perfloop.nn's module directly")
        swaps.append(swap)
    heads = _fuse_heads(model, rewrites, seen, names, swapped, logits)
    merged = _merge_heads(groups, seen, swapped)
    swaps += heads + merged
    fused = {id(_named(model, s.name)) for s in heads if s.replaced}
    fused |= {id(h) for s in merged if s.replaced for h in _heads.heads_of(_named(model, s.name))}
    for (mname, fname, line), (args, kwargs, autocast_dtype) in sorted(calls.items()):
        m = model.get_submodule(mname)
        if id(m) in fused:
            continue
        swap = _check_call(_site_label(mname, m, fname, line), fname, args, kwargs, autocast_dtype)
        swap.site = (mname, fname, line)
        swaps.append(swap)
    rerouted = _route_sites(model, swaps)
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
    report = PatchReport(swaps)
    if measure and report.replaced:
        report.timing = _keep_what_pays(report, originals, before, model, example_batch, loss_fn, **measure)
    return report


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


def _keep_what_pays(
    report, originals: dict, before, model, batch, loss_fn, budget_s: float, compiled: bool = False
) -> dict:
    """Time the step unpatched, patched, and (with several kinds swapped) patched with each kind
    alone, interleaved (each compiled, with `compiled`); keep the fastest that beats the
    unpatched step, put the rest back."""
    kinds = sorted({s.kind for s in report.swaps if s.replaced})
    models = {"before": before, "after": model}
    if len(kinds) > 1:
        for kind in kinds:
            models[f"only {kind}"] = _with(before, report, {kind})
    t = _measure(models, batch, loss_fn, budget_s, compiled)
    pays = functools.partial(_pays, peak_before=t["peak_before"])
    winners = [k for k in kinds if pays(t["candidates"].get(f"only {k}", {"significant": False}))]
    if 1 < len(winners) < len(kinds):  # the kinds that paid alone, together
        label = "only " + "+".join(winners)
        pair = {"before": before, label: _with(before, report, set(winners))}
        t2 = _measure(pair, batch, loss_fn, budget_s, compiled)
        t["candidates"][label] = t2["candidates"][label] | {"before_ms": t2["before_ms"]}
    faster = {k: v for k, v in t["candidates"].items() if pays(v)}
    best = max(faster, key=lambda k: faster[k]["speedup"]) if faster else None
    keep = set(kinds) if best == "after" else (set(best.removeprefix("only ").split("+")) if best else set())
    for s in report.swaps:
        if s.replaced and s.kind not in keep:
            if s.site is not None:
                _functional.restore(model.get_submodule(s.site[0]))
            elif s.kind == _heads.KIND:
                _heads.unmerge(_named(model, s.name))
            elif s.rewritten:
                _rewrite.restore(_named(model, s.name))
            else:
                for n in (s.name, *s.aliases):
                    _set(model, n, originals[s.name])
            s.replaced = False
            s.reason = (
                f"equal, but the step{' compiled' if compiled else ''} was neither faster nor smaller "
                "with it (measured)"
            )
    chosen = best or "before"
    _route_sites(model, report.swaps)  # the kept functional sites, per module (a put-back cleared all)
    after_ms = t["candidates"].get(chosen, {"ms": t["before_ms"]})["ms"]
    t.update({"after_ms": after_ms, "kept": sorted(keep), "compiled": compiled})
    c = t["candidates"].get(chosen)
    t.update(
        {
            "speedup": c["speedup"] if c else 1.0,
            "ci": c["ci"] if c else (1.0, 1.0),
            "verdict": "significant" if c else "no swap made the step faster: none kept",
        }
    )
    return t


SMALLER = 0.9  # a step whose peak memory is at most this share of the unpatched one's is smaller


def _pays(c: dict, peak_before: int | None) -> bool:
    """Whether a timed candidate pays: significantly faster, or smaller at its peak and not
    significantly slower."""
    if c["significant"] and c["speedup"] > 1:
        return True
    smaller = bool(c.get("peak") and peak_before and c["peak"] <= SMALLER * peak_before)
    return smaller and not (c["significant"] and c["speedup"] < 1)


def _with(before: nn.Module, report: PatchReport, kinds: set) -> nn.Module:
    """A copy of the unpatched model with the checked swaps of these kinds made."""
    m = _verify.copy_module(before)
    for s in report.swaps:
        if s.replaced and s.kind in kinds and s.kind == _heads.KIND:
            _heads.merge(_named(m, s.name), **s.options)
        elif s.replaced and s.kind in kinds and s.rewritten:
            _rewrite.rewrite(_named(m, s.name), logits=s.options.get("logits"))
        elif s.replaced and s.kind in kinds and s.site is None:
            fused = fused_like(m.get_submodule(s.name))
            for k, v in s.options.items():
                setattr(fused, k, v)
            for n in (s.name, *s.aliases):
                _set(m, n, fused)
    _route_sites(m, [s for s in report.swaps if s.kind in kinds])
    return m


def _measure(models: dict, batch, loss_fn, budget_s: float, compiled: bool = False) -> dict:
    from perfloop.harness.timing import compare

    def step(m):
        def run():
            out = _run(m, batch, loss_fn)
            (out if out.ndim == 0 else out.float().mean()).backward()

        return run

    if compiled:  # compiled (two steps each: a first and a recompile) before the timing
        models = {k: torch.compile(m) for k, m in models.items()}
        for m in models.values():
            for _ in range(2):
                step(m)()

    dev = next(models["before"].parameters()).device
    peaks = {label: step_peak(m, step(m)) for label, m in models.items()} if dev.type == "cuda" else {}
    c = compare({k: step(m) for k, m in models.items()}, baseline="before", budget_s=budget_s)
    cands = {
        k: {
            "ms": c.measurements[k].median_ms,
            "speedup": s.speedup,
            "ci": s.ci,
            "p_value": s.p_value,
            "significant": s.significant,
            "peak": peaks.get(k),
        }
        for k, s in c.speedups.items()
        if k != "before"
    }
    return {
        "before_ms": c.measurements["before"].median_ms,
        "candidates": cands,
        "device": dev.type,
        "peak_before": peaks.get("before"),
        "peak_after": peaks.get("after"),
    }


def step_peak(model: nn.Module, run) -> int:
    """Bytes the step needs at its peak: the model's parameters, plus the most the step allocated
    on top of what was there before it (activations, gradients: set to None first, as a training
    step does). Other models on the same GPU do not count."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    peak = torch.cuda.max_memory_allocated() - base + params
    model.zero_grad(set_to_none=True)
    return peak


def plan(model: nn.Module, root: str = "") -> dict[str, dict[str, str]]:
    """What pl.patch would check in this model, read from its modules and code (nothing run):
    {module name (as module ranges name them, the root by `root` or its class): {kind
    ("cross_entropy", "normalization", "gelu", "attention"): where, and whether pl.patch reaches
    it}}: a module of a kind pl.patch swaps, a functional call in a module's own forward
    (file:line), or attention written out there.
    Code pl.patch cannot see (a loss computed outside forward) is absent."""
    out: dict = {}
    root = root or type(model).__name__
    prefix = lambda n: root if n in ("", root) else n
    for name, m, fused in _candidates(model):
        row = registry.by_module(type(m).__name__)  # a model's own class: its fused one's
        kind = (row if row is not None and row.kind else registry.by_module(type(fused).__name__)).kind
        why = why_not(m)
        label = f"{type(m).__name__} module" + (f": not reached ({why})" if why else ": pl.patch swaps it")
        out.setdefault(prefix(name), {})[kind] = label
    for name, m in model.named_modules():
        if _rewrite.ROPE in _rewrite.writes(m):
            out.setdefault(prefix(name), {})["rope"] = (
                f"rotary embedding written out ({type(m).__name__}.forward): pl.patch rewrites it to "
                "perfloop's fused RoPE where it takes one call"
            )
        if _rewrite.GELU in _rewrite.writes(m) and fused_like(m) is None:
            out.setdefault(prefix(name), {}).setdefault(
                "gelu",
                f"tanh or erf written out ({type(m).__name__}.forward): pl.patch rewrites it to the "
                "fused GELU where it computes GELU",
            )
        if _rewrite.NORM in _rewrite.writes(m) and fused_like(m) is None:
            out.setdefault(prefix(name), {}).setdefault(
                "normalization",
                f"a norm written out ({type(m).__name__}.forward): pl.patch rewrites it to the "
                "fused norm where it computes one",
            )
        if _rewrite.LOSS in _rewrite.writes(m):
            fn = _functional.forward_function(m)
            lines = _functional.call_lines(fn, ("cross_entropy",)).get("cross_entropy")
            file = fn.__code__.co_filename.rsplit("/", 1)[-1]
            call = f"F.cross_entropy at {file}:{lines[0]}" if lines else "a cross entropy"
            out.setdefault(prefix(name), {})["cross_entropy"] = (
                f"{call} ({type(m).__name__}.forward): pl.patch reaches it; with logits=False (the step does "
                "not read the logits) it fuses the Linear before it in, the logits never held whole"
            )
        if _rewrite.ATTENTION in _rewrite.writes(m):
            lines = ", ".join(_rewrite.softmax_lines(_functional.forward_function(m)))
            out.setdefault(prefix(name), {})["attention"] = (
                f"attention written out at {lines} ({type(m).__name__}.forward): pl.patch checks it as "
                "one F.scaled_dot_product_attention call on your batch, and swaps it only where it "
                "matches (with measure=True, only where the step is faster)"
            )
    for name, parent in _heads.find(model):
        hs = _heads.heads_of(parent)
        out.setdefault(prefix(name), {})["attention"] = (
            f"{len(hs)} attention heads in their own modules ({type(hs[0]).__name__}): one SDPA per head "
            "saves little (each head's matmuls stay small); the win is the heads merged: pl.patch checks "
            "their key/query/value Linears as one projection and their attentions as one SDPA call, "
            "and merges them where that matches"
        )
    for name, m in _functional.site_modules(model):
        fn = _functional.forward_function(m)
        where = fn.__code__.co_filename.rsplit("/", 1)[-1]
        for kind, names in registry.kinds().items():
            lines = _functional.call_lines(fn, names)
            if lines:
                calls = ", ".join(f"F.{n} at {where}:{','.join(map(str, ls))}" for n, ls in lines.items())
                out.setdefault(prefix(name), {}).setdefault(
                    kind, f"{calls} ({type(m).__name__}.forward): pl.patch reaches it"
                )
    return out
