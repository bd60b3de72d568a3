"""pl.patch(..., measure=True): the step timed unpatched, patched, and with each kind of swap
alone, interleaved; what does not make it faster (or smaller) is put back."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from perfloop.nn import heads as _heads
from perfloop.nn import loss_function as _loss_function
from perfloop.nn import reroute as _reroute
from perfloop.nn import rewrite as _rewrite
from perfloop.nn import verify as _verify
from perfloop.nn.modules import fused_like
from perfloop.nn.swapping import named, route_sites, run_step, set_module, step_loss

SMALLER = 0.9  # a step whose peak memory is at most this share of the unpatched one's is smaller


def keep_what_pays(
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
    t = measure(models, batch, loss_fn, budget_s, compiled)
    pays = functools.partial(_pays, peak_before=t["peak_before"])
    winners = [k for k in kinds if pays(t["candidates"].get(f"only {k}", {"significant": False}))]
    if 1 < len(winners) < len(kinds):  # the kinds that paid alone, together
        label = "only " + "+".join(winners)
        pair = {"before": before, label: _with(before, report, set(winners))}
        t2 = measure(pair, batch, loss_fn, budget_s, compiled)
        t["candidates"][label] = t2["candidates"][label] | {"before_ms": t2["before_ms"]}
    faster = {k: v for k, v in t["candidates"].items() if pays(v)}
    best = max(faster, key=lambda k: faster[k]["speedup"]) if faster else None
    keep = set(kinds) if best == "after" else (set(best.removeprefix("only ").split("+")) if best else set())
    for s in report.swaps:
        if s.replaced and s.kind not in keep:
            if s.site is not None:
                _reroute.restore(model.get_submodule(s.site[0]))
            elif s.kind == _loss_function.KIND:
                _loss_function.restore(model)
            elif s.kind == _heads.KIND:
                _heads.unmerge(named(model, s.name))
            elif s.rewritten:
                _rewrite.restore(named(model, s.name))
            else:
                for n in (s.name, *s.aliases):
                    set_module(model, n, originals[s.name])
            s.replaced = False
            s.reason = (
                f"equal, but the step{' compiled' if compiled else ''} was neither faster nor smaller "
                "with it (measured)"
            )
    chosen = best or "before"
    route_sites(model, report.swaps)  # the kept functional sites, per module (a put-back cleared all)
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


def _pays(c: dict, peak_before: int | None) -> bool:
    """Whether a timed candidate pays: significantly faster, or smaller at its peak and not
    significantly slower."""
    if c["significant"] and c["speedup"] > 1:
        return True
    smaller = bool(c.get("peak") and peak_before and c["peak"] <= SMALLER * peak_before)
    return smaller and not (c["significant"] and c["speedup"] < 1)


def _with(before: nn.Module, report, kinds: set) -> nn.Module:
    """A copy of the unpatched model with the checked swaps of these kinds made."""
    m = _verify.copy_module(before)
    for s in report.swaps:
        if s.replaced and s.kind in kinds and s.kind == _heads.KIND:
            _heads.merge(named(m, s.name), **s.options)
        elif s.replaced and s.kind in kinds and s.kind == _loss_function.KIND:
            _loss_function.apply(m)
        elif s.replaced and s.kind in kinds and s.rewritten:
            _rewrite.rewrite(named(m, s.name), logits=s.options.get("logits"))
        elif s.replaced and s.kind in kinds and s.site is None:
            fused = fused_like(m.get_submodule(s.name))
            for k, v in s.options.items():
                setattr(fused, k, v)
            for n in (s.name, *s.aliases):
                set_module(m, n, fused)
    route_sites(m, [s for s in report.swaps if s.kind in kinds])
    return m


def measure(models: dict, batch, loss_fn, budget_s: float, compiled: bool = False) -> dict:
    from perfloop.harness.timing import compare

    def step(m):
        def run():
            step_loss(run_step(m, batch, loss_fn))[0].backward()

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
