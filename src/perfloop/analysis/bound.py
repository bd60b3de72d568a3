"""What limits a piece of work, one vocabulary for every analysis: a single op's diagnosis, a
step's ranked opportunities, a breakdown row against its roofline."""

from __future__ import annotations

from enum import Enum


class Bound(str, Enum):
    """A str, so it compares, prints and serializes (JSON) as its word: `Bound.MEMORY == "memory"`."""

    LAUNCH = "launch"  # the device waits while the host launches: fewer, larger launches; CUDA graphs
    MEMORY = "memory"  # its bytes at the copy ceiling set its time: move fewer (fuse, lower precision)
    COMPUTE = "compute"  # its FLOPs at the matmul ceiling set its time: tensor cores, lower precision
    LATENCY = "latency"  # short, small kernels far from either ceiling: their ramp-up sets the time
    HOST = "host"  # the device waits for the host's other work (syncs, copies, Python)
    PRECISION = "precision"  # a faster ceiling is there for the taking (fp32 matmuls with TF32 off)
    UNCLEAR = "unclear"  # near neither ceiling, and not launch-bound
    NONE = "none"  # nothing to gain

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
