"""What pl.patch would check in a model, read from its modules and code, nothing run: said by
`perfloop profile --script` beside each finding it reaches."""

from __future__ import annotations

import torch.nn as nn

from perfloop.nn import heads as _heads
from perfloop.nn import registry
from perfloop.nn import reroute as _reroute
from perfloop.nn import rewrite as _rewrite
from perfloop.nn.modules import fused_like, why_not
from perfloop.nn.swapping import candidates


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
    for name, m, fused in candidates(model):
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
            fn = _reroute.forward_function(m)
            lines = _reroute.call_lines(fn, ("cross_entropy",)).get("cross_entropy")
            file = fn.__code__.co_filename.rsplit("/", 1)[-1]
            call = f"F.cross_entropy at {file}:{lines[0]}" if lines else "a cross entropy"
            out.setdefault(prefix(name), {})["cross_entropy"] = (
                f"{call} ({type(m).__name__}.forward): pl.patch reaches it; with logits=False (the step does "
                "not read the logits) it fuses the Linear before it in, the logits never held whole"
            )
        if _rewrite.ATTENTION in _rewrite.writes(m):
            lines = ", ".join(_rewrite.softmax_lines(_reroute.forward_function(m)))
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
    for name, m in _reroute.site_modules(model):
        fn = _reroute.forward_function(m)
        where = fn.__code__.co_filename.rsplit("/", 1)[-1]
        for kind, names in registry.kinds().items():
            lines = _reroute.call_lines(fn, names)
            if lines:
                calls = ", ".join(f"F.{n} at {where}:{','.join(map(str, ls))}" for n, ls in lines.items())
                out.setdefault(prefix(name), {}).setdefault(
                    kind, f"{calls} ({type(m).__name__}.forward): pl.patch reaches it"
                )
    return out
