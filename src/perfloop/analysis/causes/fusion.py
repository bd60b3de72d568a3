"""Runs of memory-bound ops in one module: fused, a run reads its inputs and writes its outputs
once (the tensors it touches say how many bytes that is) instead of moving every intermediate
through memory; a run of tiny kernels is launch-bound instead. The written-out attention's ops
are the attention finding's."""

from __future__ import annotations

from collections import defaultdict

from perfloop.analysis import roofline
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import data_prep
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.patterns import (
    chain_advice,
    chain_kinds,
    chains,
    matches,
    ops_list,
    where_called,
    written_attention_modules,
)
from perfloop.harness.measurement import fmt_ms

FUSE_PASSES = 1.5  # a run that moves at least this many times the bytes it needs fused


def _runs(c: Capture) -> list[tuple[dict, str | None]]:
    """(chain, its kind) of each run outside the written-out attention's modules and the batch's
    preparation (data_prep's)."""
    prep = {id(i) for i in data_prep.items(c.items)}
    a_ms: dict = defaultdict(float)
    for i in c.items:
        if id(i) not in prep:
            a_ms[(i.module, i.phase, i.op)] += i.ms / c.calls
    counted = c.counted_items or []
    prep_counted = {id(i) for i in data_prep.items(counted)}
    found = chains(c.records or [], [i for i in counted if id(i) not in prep_counted], a_ms)
    written = [mods for mods, _, _ in written_attention_modules(c.items).values()]
    return [
        (ch, kind)
        for ch, kind in zip(found, chain_kinds(found), strict=True)
        if not any(matches(ch["module"], mods) for mods in written)
    ]


def _tiny(f: Findings, ch: dict) -> bool:
    return roofline.latency_bound(
        ch["ms"], f.at_copy_ms(ch["bytes"]), ch["bytes"] / max(ch["kernels"], 1), ch["kernels"]
    )


def _passes(ch: dict) -> float:
    return ch["bytes"] / ch["ideal_bytes"] if ch["ideal_bytes"] else float("inf")


def covered(c: Capture, ceilings: dict) -> set:
    """The (module, phase, op) keys the runs found here explain: the tiny ones and the fusable."""
    f = Findings(c, ceilings)
    out: set = set()
    for ch, _ in _runs(c):
        if _tiny(f, ch) or _passes(ch) >= FUSE_PASSES:
            out |= ch["keys"]
    return out


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    for ch, kind in _runs(c):
        ideal = f.at_copy_ms(ch["ideal_bytes"])
        where = f"{ch['module']} ({ch['phase']}{', x' + str(ch['count']) if ch['count'] > 1 else ''})"
        if _tiny(f, ch):
            _tiny_ops(f, ch, where, ideal)
        elif _passes(ch) >= FUSE_PASSES:
            moved, needed = ch["bytes"] / 1e6, ch["ideal_bytes"] / 1e6
            evidence = (
                f"{ops_list(ch['ops'])}: {moved:.1f} MB moved where {needed:.1f} MB (its inputs and outputs) "
                f"would do, {_passes(ch):.1f}x; {fmt_ms(ch['ms'])} -> ~{fmt_ms(ideal)} fused"
            )
            f.add(
                Kind.FUSION,
                f"{len(ch['ops'])} memory-bound ops in a row in {where}: fuse them",
                ch["ms"] - ideal,
                Bound.MEMORY,
                evidence,
                chain_advice(ch["ops"], kind),
                where_called(ch["module"], kind, c.sites),
                Site(ch["module"]),
                bytes=ch["bytes"],
                ideal_bytes=ch["ideal_bytes"],
                passes=_passes(ch),
            )
    return f.found


def _tiny_ops(f: Findings, ch: dict, where: str, ideal: float) -> None:
    on_gpu = f.c.device == "cuda"
    fix = (
        "fuse them into one kernel (torch.compile), or replay the step as a CUDA graph "
        "(torch.compile(mode='reduce-overhead'), torch.cuda.graphs)"
        if on_gpu
        else "fuse them into one (torch.compile): each op's dispatch costs ~its work"
    )
    unit = "kernels" if on_gpu else "ops"
    mean_us = ch["ms"] * 1e3 / max(ch["kernels"], 1)
    f.add(
        Kind.TINY_OPS,
        f"{ch['kernels']} tiny {unit} in a row in {where}",
        ch["ms"] - ideal,
        Bound.LAUNCH,
        f"{ops_list(ch['ops'])}; mean {mean_us:.1f} us each, {fmt_ms(ch['ms'])} per call",
        fix,
        site=Site(ch["module"]),
        kernels=ch["kernels"],
        mean_us=mean_us,
    )
