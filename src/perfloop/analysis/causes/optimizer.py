"""The optimizer's kernels against the bytes of its parameters, gradients and moments, and the
device's idle in its per-parameter host loop: a fused optimizer does one pass."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.idle_record import Cause
from perfloop.analysis.patterns import ADVICE
from perfloop.harness.measurement import fmt_ms


def loop_ms(c: Capture) -> float:
    """The idle in the optimizer's host loop, per call, where the step ran an optimizer: this
    finding's, not the idle finding's."""
    if c.idle is None or not any(i.phase == "optimizer" for i in c.items):
        return 0.0
    return c.idle.by_cause[Cause.OPTIMIZER] / c.calls


def find(c: Capture, ceilings: dict) -> list[Finding]:
    opt = [i for i in c.items if i.phase == "optimizer"]
    if not opt:
        return []
    f = Findings(c, ceilings)
    idle, loop = c.idle, loop_ms(c)
    opt_ms = sum(i.ms for i in opt) / c.calls
    nbytes = sum(w[1] for k, w in (c.work or {}).items() if k[1] == "optimizer") / c.calls
    ideal = f.at_copy_ms(nbytes)
    on_gpu = idle is None or idle.device == "GPU"
    waits = "the GPU" if on_gpu else "the CPU's ops"
    said = f"; {waits} idle {fmt_ms(loop)} per call in its host loop between them" if loop else ""
    rate = (
        f" for {nbytes / 1e6:.1f} MB of parameters, gradients and moments: "
        f"{nbytes / (opt_ms * 1e-3) / 1e9 / f.copy:.0%} of copy"
        if nbytes and f.copy
        else ""
    )
    f.add(
        Kind.OPTIMIZER,
        f"optimizer: {len(opt) // c.calls} {'kernels' if on_gpu else 'ops'} per step",
        opt_ms - ideal + loop,
        Bound.HOST if loop > opt_ms - ideal else Bound.MEMORY,
        f"{fmt_ms(opt_ms)} per call" + rate + said,
        ADVICE["optimizer"] + " (one pass over the parameters, its state and gradients)",
        site=Site("optimizer"),
        kernels_ms=opt_ms,
        bytes=nbytes,
        loop_ms=loop,
    )
    return f.found
