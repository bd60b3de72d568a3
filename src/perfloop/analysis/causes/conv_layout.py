"""Convolutions in NCHW where the GPU's kernels want NHWC: cuDNN's tensor-core convolutions run
channels-last, so on an NCHW tensor it transposes the input in and the output back out around
every convolution (its nchwToNhwc / nhwcToNchw kernels), forward and backward. Each transpose
reads and writes the whole activation: time channels_last takes away.

Napkin math: a (64, 256, 56, 56) bf16 activation is 103 MB; one transpose each way moves 411 MB,
~0.1 ms at 4 TB/s, per convolution and direction."""

from __future__ import annotations

import re

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings, by_module
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.harness.measurement import fmt_ms

TRANSPOSE = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw", re.IGNORECASE)


def transposes(c: Capture) -> list:
    """The layout transposes a convolution launched."""
    return [i for i in c.items if TRANSPOSE.search(i.kernel) and "conv" in (i.outer_op or i.op or "conv")]


def find(c: Capture, ceilings: dict) -> list[Finding]:
    found = transposes(c)
    if not found:
        return []
    f = Findings(c, ceilings)
    ms = sum(i.ms for i in found) / c.calls
    top = by_module(found, c.calls)
    f.add(
        Kind.CONV_LAYOUT,
        f"convolutions in NCHW: {len(found) // c.calls} layout transposes per call around them",
        ms,
        Bound.MEMORY,
        f"{fmt_ms(ms)} per call in cuDNN's NCHW <-> NHWC transposes, in "
        + "; ".join(f"{m or 'the step'} {fmt_ms(v)}" for m, v in top[:3])
        + (f" and {len(top) - 3} more modules" if len(top) > 3 else "")
        + "; the least channels_last saves (its convolutions and batch norms run faster too)",
        "channels_last: model.to(memory_format=torch.channels_last) and each input batch "
        "x.to(memory_format=torch.channels_last); the convolutions then read and write NHWC directly",
        site=Site(top[0][0]),
        transposes=len(found) // c.calls,
        by_module=dict(top),
    )
    return f.found
