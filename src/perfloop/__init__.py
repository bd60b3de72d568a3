"""perfloop: optimization is measured, never guessed.

Benchmark (bench, compare, sweep, ceilings), profile (profile, annotate, diff),
diagnose, fuse (ops), and measure again -- with the history kept.

>>> import torch, perfloop as pl
>>> x = torch.randn(4096)
>>> pl.bench(torch.nn.functional.gelu, x).median_ms > 0
True
"""

from perfloop import ops
from perfloop.analysis.diagnose import Diagnosis
from perfloop.analysis.profiling import Profile, annotate, diff, profile
from perfloop.device import device_info, env_fingerprint
from perfloop.harness.ceilings import ceilings
from perfloop.harness.measurement import Comparison, Measurement, Sweep, Work
from perfloop.harness.timing import BenchError, bench, compare, sweep
from perfloop.nn import patch

__version__ = "0.1.0"

__all__ = [
    "BenchError",
    "Comparison",
    "Diagnosis",
    "Profile",
    "annotate",
    "diff",
    "profile",
    "Measurement",
    "Sweep",
    "Work",
    "bench",
    "ceilings",
    "compare",
    "device_info",
    "env_fingerprint",
    "ops",
    "patch",
    "sweep",
]
