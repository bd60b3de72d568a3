"""perfloop: optimization is measured, never guessed.

Benchmark (bench, compare, sweep, ceilings), profile (profile, annotate, diff),
diagnose, fuse (ops), and measure again -- with the history kept.

>>> import torch, perfloop as pl
>>> x = torch.randn(4096)
>>> pl.bench(torch.nn.functional.gelu, x).median_ms > 0
True

The names below are imported on first use (PEP 562): `import perfloop` and `perfloop --help`
stay light, and torch, scipy and the op library load when a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "BenchError": "perfloop.harness.timing",
    "Comparison": "perfloop.harness.measurement",
    "Diagnosis": "perfloop.analysis.findings",
    "Finding": "perfloop.analysis.findings",
    "Profile": "perfloop.analysis.profiling",
    "annotate": "perfloop.analysis.annotate",
    "diff": "perfloop.analysis.compare_profiles",
    "profile": "perfloop.analysis.profiling",
    "Measurement": "perfloop.harness.measurement",
    "Sweep": "perfloop.harness.measurement",
    "Work": "perfloop.harness.measurement",
    "bench": "perfloop.harness.timing",
    "ceilings": "perfloop.harness.ceilings",
    "compare": "perfloop.harness.timing",
    "device_info": "perfloop.device",
    "env_fingerprint": "perfloop.device",
    "patch": "perfloop.nn",
    "sweep": "perfloop.harness.timing",
    "tune": "perfloop.workflows.tune",
}
_SUBPACKAGES = ("ops", "nn", "analysis", "harness", "results", "workflows", "experiments")

__all__ = [
    "BenchError",
    "Comparison",
    "Diagnosis",
    "Finding",
    "Measurement",
    "Profile",
    "Sweep",
    "Work",
    "__version__",
    "annotate",
    "bench",
    "ceilings",
    "compare",
    "device_info",
    "diff",
    "env_fingerprint",
    "ops",
    "patch",
    "profile",
    "sweep",
    "tune",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from perfloop import ops
    from perfloop.analysis.annotate import annotate
    from perfloop.analysis.compare_profiles import diff
    from perfloop.analysis.findings import Diagnosis, Finding
    from perfloop.analysis.profiling import Profile, profile
    from perfloop.device import device_info, env_fingerprint
    from perfloop.harness.ceilings import ceilings
    from perfloop.harness.measurement import Comparison, Measurement, Sweep, Work
    from perfloop.harness.timing import BenchError, bench, compare, sweep
    from perfloop.nn import patch
    from perfloop.workflows.tune import tune


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"perfloop.{name}")
    else:
        raise AttributeError(f"module 'perfloop' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE, *_SUBPACKAGES])
