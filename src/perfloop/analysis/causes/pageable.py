"""Host-to-device copies from pageable memory: the host stages them at a fraction of the link's
speed, and the device idles while it does; pinned memory and non_blocking copies remove both."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind
from perfloop.analysis.idle_record import Cause
from perfloop.harness.measurement import fmt_ms

ADVICE = (
    "pin the host tensor (tensor.pin_memory(), DataLoader(pin_memory=True)) and copy "
    "with .to(device, non_blocking=True), or keep the data on the GPU"
)


def copies(c: Capture) -> list:
    """The step's copies from pageable memory (the optimizer's phase aside)."""
    return [i for i in c.items if "Pageable" in i.kernel and i.phase != "optimizer"]


def find(c: Capture, ceilings: dict) -> list[Finding]:
    pageable = copies(c)
    if not pageable:
        return []
    f = Findings(c, ceilings)
    dev_ms = sum(i.ms for i in pageable) / c.calls
    staging = c.idle.by_cause[Cause.PAGEABLE] / c.calls if c.idle is not None else 0.0
    n = len(pageable) // c.calls
    said = "1 host-to-device copy" if n == 1 else f"{n} host-to-device copies"
    f.add(
        Kind.PAGEABLE_COPY,
        f"{said} from pageable memory per call",
        dev_ms + staging,
        Bound.HOST,
        f"{fmt_ms(dev_ms)} per call of device copies from pageable memory (staged by the host, at a "
        f"fraction of the link's speed)"
        + (f"; the GPU idle {fmt_ms(staging)} while the host staged it" if staging else ""),
        ADVICE,
        device_ms=dev_ms,
        staging_ms=staging,
    )
    return f.found
