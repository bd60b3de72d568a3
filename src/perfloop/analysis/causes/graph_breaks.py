"""Each graph break of the compiled code that ran: how much sooner the step would end without the
host's eager code between the graphs around it (on a CPU: the idle while it ran), its reason and
the fix for that reason."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.compilation import BREAK_FIX, RESUME
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.idle_record import Cause
from perfloop.harness.measurement import fmt_ms


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    code, idle = c.code, c.idle
    if code is None or idle is None:
        return []
    for b in code.breaks:
        ms = idle.break_saving_ms.get(b.where)
        said = "the step would end {} per call sooner without the host's eager code between the graphs"
        if ms is None:  # no launch times (a CPU's ops): the idle the break's places hold
            mine = [v for k, p, v in idle.places if k == Cause.GRAPH_BREAK and p.split("/")[0] in b.frames]
            ms = sum(mine)
            said = f"the {idle.device} idle {{}} per call while the host ran the code between the graphs"
        again = [m for m in code.compiles if m.function.startswith(RESUME) and m.where == b.where]
        compile_ms = sum(m.ms for m in again)
        ms = (ms + compile_ms) / c.calls
        evidence = (
            said.format(fmt_ms(ms - compile_ms / c.calls))
            + f" ({b.regions // max(c.calls, 1)} region(s) a call resume after it)"
            + (
                f", and {len(again)} compile(s) of the code after it, {fmt_ms(compile_ms / c.calls)} per call"
                if again
                else ""
            )
            + f"; Dynamo: {b.reason}"
        )
        title = f"graph break in {b.function} at {b.where}: {b.kind}"
        advice = BREAK_FIX[b.kind]
        f.add(
            Kind.GRAPH_BREAK,
            title,
            ms,
            Bound.HOST,
            evidence,
            advice,
            b.where,
            Site(line=b.where),
            reason=b.reason,
        )
    return f.found
