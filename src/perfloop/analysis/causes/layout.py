"""Copies that change a layout only (.contiguous(), clone): the next op could read the layout
it was given. The written-out attention's and the fused runs' copies are theirs."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import attention, fusion
from perfloop.analysis.causes.base import Findings, by_module
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.patterns import LAYOUT_OPS
from perfloop.harness.measurement import fmt_ms


def copies(c: Capture, ceilings: dict) -> list:
    """The layout copies no earlier finding explains."""
    taken = attention.covered(c) | fusion.covered(c, ceilings)
    return [
        i
        for i in c.items
        if (i.outer_op or i.op) in LAYOUT_OPS
        and i.phase != "optimizer"
        and (i.module, i.phase, i.op) not in taken
    ]


def find(c: Capture, ceilings: dict) -> list[Finding]:
    layout = copies(c, ceilings)
    if not layout:
        return []
    f = Findings(c, ceilings)
    ms = sum(i.ms for i in layout) / c.calls
    ops = sorted({(i.outer_op or i.op).split("::")[-1] for i in layout})
    top = by_module(layout, c.calls, lambda i: f"{i.module} ({i.phase})")[:3]
    f.add(
        Kind.LAYOUT_COPY,
        f"layout copies: {len(layout) // c.calls} per call ({', '.join(ops)})",
        ms,
        Bound.MEMORY,
        f"{fmt_ms(ms)} per call copying tensors to a new layout, in "
        + "; ".join(f"{m} {fmt_ms(v)}" for m, v in top),
        "keep the layout the next op takes: matmul and scaled_dot_product_attention read transposed "
        "operands (drop the .contiguous()), transpose after the op rather than before, or "
        "torch.compile, which folds the copy into the op that reads it",
        site=Site(top[0][0].rsplit(" (", 1)[0]),
        by_module=dict(top),
    )
    return f.found
