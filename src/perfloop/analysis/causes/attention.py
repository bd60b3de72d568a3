"""Attention computed op by op: its T x T scores go through memory, forward and backward, where
F.scaled_dot_product_attention keeps them on chip. Its ops are this finding's (`covered`), its
matmuls too: SDPA's one kernel does their FLOPs, at best at the matmul ceiling, and nothing else."""

from __future__ import annotations

from perfloop.analysis import attribution as attr
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.patterns import ADVICE, where_called, written_attention_modules
from perfloop.harness.measurement import fmt_ms, matmul_ceiling


def covered(c: Capture) -> set:
    """The (module, phase, op) keys of the written-out attention's modules."""
    mods = set().union(*(m for m, _, _ in written_attention_modules(c.items).values()))
    return {(i.module, i.phase, i.op) for i in c.items if i.module in mods}


def matmul_headroom(c: Capture, ceilings: dict, mods: set) -> float:
    """The time per call the matmuls of modules `mods` take beyond their FLOPs at the measured
    matmul ceiling (0 where the work or the ceiling is not known)."""
    ms = sum(i.ms for i in c.items if i.module in mods and attr.category(i.op or i.kernel) == "matmul")
    work = [w for k, w in (c.work or {}).items() if k[0] in mods and attr.category(k[2]) == "matmul"]
    peak = matmul_ceiling(ceilings, work[0][2]) if work else None
    if not peak:
        return 0.0
    return max(0.0, ms - sum(w[0] for w in work) / (peak * 1e12) * 1e3) / c.calls


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    for pattern, (mods, ms, n_ops) in written_attention_modules(c.items).items():
        matmuls = matmul_headroom(c, ceilings, mods)
        f.add(
            Kind.ATTENTION,
            f"attention written out in {pattern}: the scores go through memory",
            ms / c.calls + matmuls,
            Bound.MEMORY,
            f"{n_ops} ops on the T x T scores between its two matmuls, forward and backward, "
            f"{fmt_ms(ms / c.calls)} per call"
            + (f" in {len(mods)} modules" if len(mods) > 1 else "")
            + (
                f"; its matmuls {fmt_ms(matmuls)} per call beyond their FLOPs at the matmul ceiling"
                if matmuls
                else ""
            ),
            ADVICE["attention"] + ": one kernel, the scores never written (is_causal=True for a causal "
            "mask, attn_mask= for another; dropout_p= for attention dropout)",
            where=where_called(pattern, "attention", c.sites),
            site=Site(pattern),
            ops=n_ops,
            modules=len(mods),
            matmul_headroom_ms=matmuls,
        )
    return f.found
