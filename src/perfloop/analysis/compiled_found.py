"""What the ranking says of compiled code: recompiles and first compiles inside the profiled
steps, graph breaks with the cost of the eager code between graphs, and the next step where the
code already is compiled (never "torch.compile"), CUDA graphs with what in the step blocks them."""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from perfloop.analysis import timeline
from perfloop.analysis.bound import Bound
from perfloop.analysis.compilation import (
    BREAK_FIX,
    RESUME,
    CompiledCode,
    guard_source,
    guard_text,
    recompile_fix,
    recompile_in_words,
)
from perfloop.analysis.findings import Kind, Site, count_words
from perfloop.harness.measurement import fmt_ms


class StepView(Protocol):
    """What these analyzers read of opportunities.Step, and add to it."""

    compiled: CompiledCode | None
    idle: timeline.Idle | None
    calls: int

    def add(
        self,
        kind: Kind | str,
        title: str,
        saves: float,
        bound: Bound,
        evidence: str,
        advice: str,
        where: str = "",
        site: Site | None = None,
        **values,
    ) -> None: ...


COMPILED_ADVICE = {  # a finding's next step where the step ran compiled code
    Kind.LAUNCH: "the compiled step waits on its launches: replay it as CUDA graphs, torch.compile(..., "
    "mode='reduce-overhead'); they need a step without CPU syncs, graph breaks or changing shapes (the "
    "other findings say which of those this step has)",
    Kind.TINY_OPS: "these ops run outside the compiled graphs (eager code around a graph break, or code not "
    "compiled): bring them into the compiled function, or replay the step as CUDA graphs "
    "(mode='reduce-overhead')",
    Kind.FUSION: "these ops run outside the compiled graphs (eager code around a graph break, or code not "
    "compiled): bring them into the compiled function, or a fused op (pl.patch)",
    Kind.LATENCY: "short kernels: CUDA graphs (mode='reduce-overhead') take their launch cost away; "
    "mode='max-autotune' tries larger tiles",
    Kind.LAYOUT_COPY: "keep the layout the next op takes: matmul and scaled_dot_product_attention read "
    "transposed operands (drop the .contiguous()), transpose after the op rather than before",
    Kind.DTYPE_CAST: "keep the weights in the compute dtype (bf16 parameters with an fp32 master copy)",
    Kind.ROOFLINE: "in compiled code this op ran as its own kernel: mode='max-autotune' searches faster "
    "kernels for it, and a fused op (pl.patch) can take its place where perfloop has one",
}


def graph_blockers(s: StepView) -> str:
    """What in this step keeps CUDA graphs from replaying it (syncs, graph breaks, recompiles)."""
    said = []
    if s.compiled is not None and s.compiled.breaks:
        b = s.compiled.breaks[0]
        said.append(f"{count_words(len(s.compiled.breaks), 'graph break', 'graph breaks')} ({b.where})")
    if s.compiled is not None and any(c.recompile for c in s.compiled.compiles):
        said.append("recompiles inside the step")
    syncs = s.idle.syncs if s.idle is not None else []
    if syncs:
        op = syncs[0][0]
        place = s.idle.sync_places.get(op, "")
        said.append(f"a CPU sync ({op.split('::')[-1]}{' at ' + place if place else ''})")
    if not said:
        return "; this step has none of what blocks them (CPU syncs, graph breaks, recompiles)"
    return "; in this step, first remove: " + ", ".join(said)


BLOCKERS = (Kind.GRAPH_BREAK, Kind.RECOMPILE, Kind.SYNC, Kind.DATA_DEPENDENT)


def blockers_first(found: list, compiled: CompiledCode | None) -> list:
    """The findings, largest saving first, except that in compiled code the ones whose fix comes
    first go before the CUDA-graphs finding they block (a graph break, a recompile, a CPU sync:
    CUDA graphs replay none of them, and the launch gaps they leave are partly theirs)."""
    ranked = sorted(found, key=lambda o: -o.saves_ms)
    at = next((i for i, o in enumerate(ranked) if o.kind == Kind.LAUNCH), None)
    if compiled is None or at is None or "CUDA graphs" not in ranked[at].advice:
        return ranked
    blocking = [o for o in ranked[at + 1 :] if o.kind in BLOCKERS]
    rest = [o for o in ranked[at:] if o not in blocking]
    return ranked[:at] + blocking + rest


def compilation_found(s: StepView) -> None:
    """Compilation inside the profiled calls: a recompile (its failed guard, said plainly, and
    the fix that fits it), or a first compile (warm-up, not the step's cost)."""
    made = s.compiled.compiles if s.compiled is not None else []
    by_function: dict = defaultdict(list)
    for c in made:
        if c.function.startswith(RESUME):
            continue  # the code after a graph break: its compiles are the break's (graph_breaks_found)
        by_function[(c.function or c.compile_id.split("/")[0], c.where, c.recompile)].append(c)
    for (function, where, recompile), cs in by_function.items():
        ms = sum(c.ms for c in cs) / s.calls * s.compiled.pace  # at the unprofiled pace
        at = f"{function} ({where})" if where else function
        reason = next((c.reason for c in cs if c.reason), "")
        every = len({c.compile_id for c in cs}) >= s.calls  # a lazily compiled backward shares its id
        if recompile:
            said = recompile_in_words(reason) if reason else "a guard failed"
            title = f"recompiles {'every step' if every else 'in the profiled steps'}: {at}: {said}"
            advice = recompile_fix(reason)
        else:
            title = f"compilation inside the profiled steps: {at}"
            advice = "warm-up, not the step's cost: profile later steps (--skip N)"
        guard = guard_text(reason) if reason else ""
        read = guard_source(reason) if " == " in guard else None  # a Python value: fixed where it is read
        evidence = f"{len(cs)} compile(s) in {s.calls} call(s), {fmt_ms(ms)} per call" + (
            f"; Dynamo's guard: `{guard}`" if guard else ""
        )
        place = read[0] if read else where
        if read:
            evidence += f", read at {place}: `{read[1]}`"
        kind = "recompile" if recompile else "compile"
        s.add(kind, title, ms, Bound.HOST, evidence, advice, place, Site(line=place), compiles=len(cs))


def graph_breaks_found(s: StepView) -> None:
    """Each graph break of the compiled code that ran: how much sooner the step would end without
    the host's eager code between the graphs around it (on a CPU: the idle while it ran), its
    reason and the fix for that reason."""
    if s.compiled is None or s.idle is None:
        return
    idle = s.idle
    for b in s.compiled.breaks:
        ms = idle.break_saving_ms.get(b.where)
        said = "the step would end {} per call sooner without the host's eager code between the graphs"
        if ms is None:  # no launch times (a CPU's ops): the idle the break's places hold
            mine = [v for c, p, v in idle.places if c == timeline.GRAPH_BREAK and p.split("/")[0] in b.frames]
            ms = sum(mine)
            said = f"the {idle.device} idle {{}} per call while the host ran the code between the graphs"
        again = [c for c in s.compiled.compiles if c.function.startswith(RESUME) and c.where == b.where]
        compile_ms = sum(c.ms for c in again)
        ms = (ms + compile_ms) / s.calls
        evidence = (
            said.format(fmt_ms(ms - compile_ms / s.calls))
            + f" ({b.regions // max(s.calls, 1)} region(s) a call resume after it)"
            + (
                f", and {len(again)} compile(s) of the code after it, {fmt_ms(compile_ms / s.calls)} per call"
                if again
                else ""
            )
            + f"; Dynamo: {b.reason}"
        )
        s.add(
            "graph break",
            f"graph break in {b.function} at {b.where}: {b.kind}",
            ms,
            Bound.HOST,
            evidence,
            BREAK_FIX[b.kind],
            b.where,
            Site(line=b.where),
            reason=b.reason,
        )
