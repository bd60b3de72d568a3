"""Compilation inside the profiled steps: a recompile (its failed guard, said plainly, and the fix
that fits it), or a first compile (warm-up, not the step's cost)."""

from __future__ import annotations

from collections import defaultdict

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.compilation import RESUME, guard_source, guard_text, recompile_fix, recompile_in_words
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.harness.measurement import fmt_ms


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    code = c.code
    by_function: dict = defaultdict(list)
    for m in code.compiles if code is not None else []:
        if m.function.startswith(RESUME):
            continue  # the code after a graph break: its compiles are the break's (graph_breaks)
        by_function[(m.function or m.compile_id.split("/")[0], m.where, m.recompile)].append(m)
    for (function, where, recompile), cs in by_function.items():
        ms = sum(m.ms for m in cs) / c.calls * code.pace  # at the unprofiled pace
        at = f"{function} ({where})" if where else function
        reason = next((m.reason for m in cs if m.reason), "")
        every = len({m.compile_id for m in cs}) >= c.calls  # a lazily compiled backward shares its id
        if recompile:
            said = recompile_in_words(reason) if reason else "a guard failed"
            title = f"recompiles {'every step' if every else 'in the profiled steps'}: {at}: {said}"
            advice = recompile_fix(reason)
        else:
            title = f"compilation inside the profiled steps: {at}"
            advice = "warm-up, not the step's cost: profile later steps (--skip N)"
        guard = guard_text(reason) if reason else ""
        read = guard_source(reason) if " == " in guard else None  # a Python value: fixed where it is read
        evidence = f"{len(cs)} compile(s) in {c.calls} call(s), {fmt_ms(ms)} per call" + (
            f"; Dynamo's guard: `{guard}`" if guard else ""
        )
        place = read[0] if read else where
        if read:
            evidence += f", read at {place}: `{read[1]}`"
        kind = Kind.RECOMPILE if recompile else Kind.COMPILE
        f.add(kind, title, ms, Bound.HOST, evidence, advice, place, Site(line=place), compiles=len(cs))
    return f.found
