"""The batch built op by op in a training step: the ops outside every module that run before the
model's forward (a list comprehension of slices stacked, indices read one by one). Data
preparation, not model code: one indexing op builds the batch, on the device or in a DataLoader's
workers ahead of the step; torch.compile is not its fix. Its ops are this finding's (`items`)."""

from __future__ import annotations

from collections import Counter

from perfloop.analysis import attribution as attr
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.harness.measurement import fmt_ms

TRAINING = ("backward", "optimizer")
ADVICE = (
    "build the batch with one indexing op, not a Python loop of slices stacked: "
    "x = data[ix[:, None] + torch.arange(T)] (y from ix + 1 likewise); keep `data` on the device the "
    "model runs on so the batch is built there, or build it in a DataLoader with workers "
    "(num_workers=N, pin_memory=True), ahead of the step"
)


def items(found) -> list:
    """The data preparation among `found` (a step's items, or its counted call's): in a training
    step, the ops outside every module between the last step's backward or optimizer (or the
    start) and the model's first op of the forward."""
    ordered = sorted(found, key=lambda i: i.start_us)
    if not any(i.phase in TRAINING for i in ordered):
        return []  # a generation step: what runs between forwards is its sampling
    out, before_model = [], True
    for i in ordered:
        if i.phase in TRAINING:
            before_model = True
        elif i.module != attr.NO_MODULE:
            before_model = False
        elif before_model and attr.category(i.op or i.kernel) != "memcpy/memset":  # copies: pageable's
            out.append(i)
    return out


def find(c: Capture, ceilings: dict) -> list[Finding]:
    prep = items(c.items)
    if not prep:
        return []
    f = Findings(c, ceilings)
    ms = sum(i.ms for i in prep) / c.calls
    counts = Counter((i.op or i.kernel).split("::")[-1] for i in prep)
    said = ", ".join(f"{op} x{n // c.calls}" for op, n in counts.most_common(5))
    n = len(prep) // c.calls
    f.add(
        Kind.DATA_PREP,
        f"the batch built op by op: {n} ops a step before the model's forward",
        ms,
        Bound.HOST,
        f"{said}; {fmt_ms(ms)} per call in ops outside the model, each a dispatch for a few bytes",
        ADVICE,
        site=Site("data preparation"),
        ops=n,
    )
    return f.found
