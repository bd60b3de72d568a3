"""The lecture's experiments, one command each: `perfloop experiment NAME`.

Each returns {table, conclusion, plots}: the conclusion is computed from the numbers
measured, not written in advance. Each stores its result (and its plots' names) so
`perfloop report --html` shows it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

_EXPERIMENTS: dict[str, tuple[str, str]] = {
    "matmul-scaling": ("square matmul time against size: flat, then cubic", "scaling:matmul_scaling"),
    "mlp-scaling": ("MLP fwd+bwd against steps, layers, batch, width", "scaling:mlp_scaling"),
    "launch-overhead": ("small op: eager vs CUDA graph vs reduce-overhead", "pitfalls:launch_overhead"),
    "sync-pitfall": ("time.time() without synchronize, with it, and events", "pitfalls:sync_pitfall"),
    "warmup": ("first calls against steady state: eager, compiled, Triton", "pitfalls:warmup"),
    "lm-step": ("Transformer LM step at CS336 sizes, fp32 vs bf16", "lm:lm_step"),
    "matmul-dispatch": ("which kernel `a @ b` runs, by shape and dtype", "dispatch:matmul_dispatch"),
}


def describe() -> dict[str, str]:
    return {n: d for n, (d, _) in _EXPERIMENTS.items()}


def get(name: str) -> Callable:
    if name not in _EXPERIMENTS:
        raise KeyError(f"experiment: no experiment named {name!r}; valid: {', '.join(_EXPERIMENTS)}")
    mod, _, attr = _EXPERIMENTS[name][1].partition(":")
    return getattr(importlib.import_module(f"perfloop.experiments.{mod}"), attr)
