"""Put fused modules into a user's model only where they are proven equal on that model.

`patch(model, example_batch, loss_fn)` finds the modules it can replace (torch's LayerNorm,
RMSNorm, GELU and CrossEntropyLoss by type; Llama-style RMSNorm by its shape), records each one's
inputs on the example batch, and for each runs forward and backward with the original module
and with the fused one, against a float64 run of the original: the output and the gradient of
every input and parameter within the op's declared tolerances (or within twice the original
module's own error in its dtype, where that is larger). Only modules that pass are replaced;
the report says what was replaced, what was refused and why, and the largest errors.

    >>> report = pl.patch(model, (x, y), loss_fn=lambda m, b: m(*b))   # doctest: +SKIP
    >>> print(report)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from perfloop.nn.modules import fused_like, why_not

OPS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm", "CrossEntropyLoss": "cross_entropy", "GELU": "gelu"}


@dataclass
class Swap:
    name: str  # qualified name in the model
    kind: str  # the original's class
    replaced: bool
    reason: str = ""  # why not, when not
    errors: dict = field(default_factory=dict)  # tensor -> (fused error, original's error), normalized


@dataclass
class PatchReport:
    swaps: list[Swap]
    timing: dict | None = None  # measure=True: the step before and after

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
            lines.append(f"  {'replaced' if s.replaced else 'kept    '} {s.name} ({s.kind}){err}"
                         + (f": {s.reason}" if s.reason else ""))  # fmt: skip
        if self.timing:
            t = self.timing
            for k, c in t["candidates"].items():
                sig = " (significant)" if c["significant"] else ""
                lines.append(f"step {k}: {c.get('before_ms', t['before_ms']):.3f} ms -> {c['ms']:.3f} ms, "
                             f"{c['speedup']:.3f}x "
                             f"[{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]{sig}")  # fmt: skip
            lines.append(f"kept: {', '.join(t['kept']) or 'nothing'} ({t['verdict']})")
            if t["device"] == "cpu":
                lines.append("timed on the CPU (the kernels interpreted): not a speed; time it on a GPU")
            if t.get("peak_before") is not None:
                peaks = ", ".join(f"{k} {c['peak'] / 2**20:.0f}" for k, c in t["candidates"].items())
                lines.append(f"peak memory (MiB): before {t['peak_before'] / 2**20:.0f}, {peaks}")
        return "\n".join(lines)


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        fused = fused_like(m)
        if fused is not None:
            out.append((name or type(m).__name__, m, fused))
    return out


def _capture(model, batch, loss_fn, modules: dict) -> dict:
    """Each module's first call on the example batch: (args, autocast dtype or None)."""
    seen: dict = {}

    def hook(m, args):
        if id(m) not in seen:
            dtype = torch.get_autocast_dtype(args[0].device.type) if torch.is_autocast_enabled(
                args[0].device.type) else None  # fmt: skip
            seen[id(m)] = (
                tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                dtype,
            )

    handles = [m.register_forward_pre_hook(hook) for m in modules.values()]
    try:
        with torch.no_grad():
            _run(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
    return seen


def _run(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def _forward_backward(module, args, autocast_dtype, seed: int):
    """(output, {tensor name: gradient}) of module(*args) and one backward with a seeded dy."""
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            for a in args]  # fmt: skip
    for p in module.parameters():
        p.grad = None
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    ctx = torch.autocast(dev, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with ctx:
        y = module(*args)
    g = torch.Generator(device=y.device).manual_seed(seed)
    dy = torch.randn(y.shape, generator=g, device=y.device, dtype=torch.float32).to(y.dtype)
    y.backward(dy)
    grads = {
        f"input {i}": a.grad for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.grad is not None
    }
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return y.detach(), grads


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest reference value."""
    want = want.double().cpu()
    return float((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _check(name: str, original: nn.Module, fused: nn.Module, args, autocast_dtype) -> Swap:
    from perfloop import ops

    kind = type(original).__name__
    op = ops.get(OPS.get(kind, "rmsnorm"))
    ref = copy.deepcopy(original).double()
    ref_args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    want_y, want_g = _forward_backward(ref, ref_args, None, seed=0)
    orig_y, orig_g = _forward_backward(original, args, autocast_dtype, seed=0)
    try:
        got_y, got_g = _forward_backward(fused, args, autocast_dtype, seed=0)
    except Exception as exc:  # noqa: BLE001 -- a kernel that cannot run here is a refusal, not a crash
        return Swap(name, kind, False, f"the fused module failed on this input: {exc}")
    finally:
        for p in original.parameters():
            p.grad = None
    if got_y.dtype != orig_y.dtype or got_y.shape != orig_y.shape:
        return Swap(name, kind, False, f"output {got_y.dtype} {tuple(got_y.shape)} where the original gives "
                    f"{orig_y.dtype} {tuple(orig_y.shape)}")  # fmt: skip
    dtype = orig_y.dtype if orig_y.dtype in op.tolerances else torch.float32
    errors = {"output": (_err(got_y, want_y), _err(orig_y, want_y))}
    for t in want_g:
        if t not in got_g:
            return Swap(name, kind, False, f"no gradient for {t}", errors)
        errors[f"grad {t}"] = (_err(got_g[t], want_g[t]), _err(orig_g[t], want_g[t]) if t in orig_g else 0.0)
    for t, (fused_err, orig_err) in errors.items():
        atol, rtol = (op.tolerances if t == "output" else op.grad_tolerances)[dtype]
        limit = max(atol + rtol, 2 * orig_err)
        if not fused_err <= limit:
            why = f"{t} off by {fused_err:.3g} of its largest value (limit {limit:.3g})"
            return Swap(name, kind, False, why, errors)
    return Swap(name, kind, True, "", errors)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def patch(model: nn.Module, example_batch, loss_fn=None, *, measure: bool = False, budget_s: float = 3.0
          ) -> PatchReport:  # fmt: skip
    """Replace the modules of `model` that have a fused perfloop.nn version, each only after it
    matched the original on this model's own activations and gradients (see the module
    docstring). `loss_fn(model, example_batch)` runs one step's forward (default:
    `model(*example_batch)`). With `measure=True` the training step (forward, backward) is
    timed before and after, interleaved (`compare`), with peak memory both ways; where more
    than one kind of module was swapped, each kind alone is timed too, and a kind whose swap
    does not make the step faster is put back (the report says so).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    cands = _candidates(model)
    if not cands:
        return PatchReport([])
    before = copy.deepcopy(model) if measure else None
    seen = _capture(model, example_batch, loss_fn, {n: m for n, m, _ in cands})
    swaps, originals = [], {}
    for name, original, fused in cands:
        if why_not(original):
            swaps.append(Swap(name, type(original).__name__, False, why_not(original)))
            continue
        if id(original) not in seen:
            swaps.append(Swap(name, type(original).__name__, False, "not called by the example batch"))
            continue
        args, autocast_dtype = seen[id(original)]
        swap = _check(name, original, fused, args, autocast_dtype)
        if swap.replaced and original is not model:
            _set(model, name, fused)
            originals[name] = original
        elif swap.replaced:
            swap = Swap(name, swap.kind, False, "it is the model itself: use perfloop.nn's module directly")
        swaps.append(swap)
    report = PatchReport(swaps)
    if measure and report.replaced:
        report.timing = _keep_what_pays(report, originals, before, model, example_batch, loss_fn, budget_s)
    return report


def _keep_what_pays(report, originals: dict, before, model, batch, loss_fn, budget_s: float) -> dict:
    """Time the step unpatched, patched, and (with several kinds swapped) patched with each kind
    alone, interleaved; keep the fastest that beats the unpatched step, put the rest back."""
    kinds = sorted({s.kind for s in report.swaps if s.replaced})
    models = {"before": before, "after": model}
    if len(kinds) > 1:
        for kind in kinds:
            m = copy.deepcopy(before)
            for s in report.swaps:
                if s.replaced and s.kind == kind:
                    _set(m, s.name, fused_like(m.get_submodule(s.name)))
            models[f"only {kind}"] = m
    t = _measure(models, batch, loss_fn, budget_s)
    pays = lambda c: c["significant"] and c["speedup"] > 1  # noqa: E731
    winners = [k for k in kinds if pays(t["candidates"].get(f"only {k}", {"significant": False}))]
    if 1 < len(winners) < len(kinds):  # the kinds that paid alone, together
        label = "only " + "+".join(winners)
        m = copy.deepcopy(before)
        for s in report.swaps:
            if s.replaced and s.kind in winners:
                _set(m, s.name, fused_like(m.get_submodule(s.name)))
        t2 = _measure({"before": before, label: m}, batch, loss_fn, budget_s)
        t["candidates"][label] = t2["candidates"][label] | {"before_ms": t2["before_ms"]}
    faster = {k: v for k, v in t["candidates"].items() if pays(v)}
    best = max(faster, key=lambda k: faster[k]["speedup"]) if faster else None
    keep = set(kinds) if best == "after" else (set(best.removeprefix("only ").split("+")) if best else set())
    for s in report.swaps:
        if s.replaced and s.kind not in keep:
            _set(model, s.name, originals[s.name])
            s.replaced = False
            s.reason = "equal, but the step was not faster with it (measured: --measure)"
    chosen = best or "before"
    t.update({"after_ms": t["candidates"].get(chosen, {"ms": t["before_ms"]})["ms"], "kept": sorted(keep)})
    c = t["candidates"].get(chosen)
    t.update({"speedup": c["speedup"] if c else 1.0, "ci": c["ci"] if c else (1.0, 1.0),
              "verdict": "significant" if c else "no swap made the step faster: none kept"})  # fmt: skip
    return t


def _measure(models: dict, batch, loss_fn, budget_s: float) -> dict:
    from perfloop.harness.timing import compare

    def step(m):
        def run():
            out = _run(m, batch, loss_fn)
            (out if out.ndim == 0 else out.float().mean()).backward()

        return run

    dev = next(models["before"].parameters()).device
    peaks = {label: step_peak(m, step(m)) for label, m in models.items()} if dev.type == "cuda" else {}
    c = compare({k: step(m) for k, m in models.items()}, baseline="before", budget_s=budget_s)
    cands = {k: {"ms": c.measurements[k].median_ms, "speedup": s.speedup, "ci": s.ci, "p_value": s.p_value,
                 "significant": s.significant, "peak": peaks.get(k)}
             for k, s in c.speedups.items() if k != "before"}  # fmt: skip
    return {"before_ms": c.measurements["before"].median_ms, "candidates": cands, "device": dev.type,
            "peak_before": peaks.get("before"), "peak_after": peaks.get("after")}  # fmt: skip


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
