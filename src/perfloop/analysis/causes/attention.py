"""Attention computed op by op: its T x T scores go through memory, forward and backward, where
F.scaled_dot_product_attention keeps them on chip. Its ops are this finding's (`covered`)."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.patterns import ADVICE, where_called, written_attention_modules
from perfloop.harness.measurement import fmt_ms


def covered(c: Capture) -> set:
    """The (module, phase, op) keys of the written-out attention's modules."""
    mods = set().union(*(m for m, _, _ in written_attention_modules(c.items).values()))
    return {(i.module, i.phase, i.op) for i in c.items if i.module in mods}


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    for pattern, (mods, ms, n_ops) in written_attention_modules(c.items).items():
        f.add(
            Kind.ATTENTION,
            f"attention written out in {pattern}: the scores go through memory",
            ms / c.calls,
            Bound.MEMORY,
            f"{n_ops} ops on the T x T scores between its two matmuls, forward and backward, "
            f"{fmt_ms(ms / c.calls)} per call" + (f" in {len(mods)} modules" if len(mods) > 1 else ""),
            ADVICE["attention"] + ": one kernel, the scores never written (is_causal=True for a causal "
            "mask, attn_mask= for another; dropout_p= for attention dropout)",
            where=where_called(pattern, "attention", c.sites),
            site=Site(pattern),
            ops=n_ops,
            modules=len(mods),
        )
    return f.found
