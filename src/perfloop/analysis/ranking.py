"""A step's diagnosis: every analyzer in `causes.ANALYZERS` run on one capture, the findings
largest saving first. In compiled code the advice is the one for compiled code (never
"torch.compile"), keyed on the finding's Kind, and what blocks CUDA graphs goes before the
CUDA-graphs finding it blocks."""

from __future__ import annotations

from dataclasses import replace

from perfloop.analysis import causes
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import ops
from perfloop.analysis.findings import REPLAYED, Diagnosis, Finding, Kind, count_words

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
CUDA_GRAPHS = {Kind.LAUNCH, Kind.TINY_OPS, Kind.LATENCY}  # compiled advice that is CUDA graphs
BLOCKERS = (
    Kind.CUDA_GRAPHS_SKIPPED,
    Kind.GRAPH_BREAK,
    Kind.RECOMPILE,
    Kind.SYNC,
    Kind.SAMPLING_SYNC,
    Kind.DATA_DEPENDENT,
)  # what CUDA graphs cannot replay


def rank(c: Capture, ceilings: dict, analyzers: list | None = None) -> Diagnosis:
    """The ranked findings of capture `c` against the measured `ceilings` (`analyzers`: the ones
    to run, all of causes.ANALYZERS by default)."""
    found = [f for find in (causes.ANALYZERS if analyzers is None else analyzers) for f in find(c, ceilings)]
    if c.compiled is not None:
        found = [_for_compiled_code(f, c) for f in found]
    replayed = replayed_share(c)
    if replayed >= REPLAYED_STEP:
        found = [_for_replayed_graphs(f, replayed) for f in found]
    found = blockers_first(found, c.compiled is not None)
    idle = c.idle
    busy = (
        idle.busy_ms / idle.wall_ms
        if idle is not None and idle.wall_ms
        else min(1.0, c.device_ms / c.step_ms)
    )
    out = Diagnosis(found, c.step_ms, c.device_ms, busy)
    if replayed:
        out.values[REPLAYED] = round(replayed, 3)
    top = ops.top_row(c, ceilings) if not found else None
    if top is not None and top.bound in (Bound.COMPUTE, Bound.MEMORY):
        of = top.of_matmul if top.bound == Bound.COMPUTE else top.of_copy
        if of is not None:
            ceiling = "matmul" if top.bound == Bound.COMPUTE else "copy"
            out.at_ceiling = f"{top.name} runs at {of:.0%} of the measured {ceiling} ceiling"
            out.ceiling_bound = top.bound
    return out


SKIPPED_ADVICE = (
    "the step asks for CUDA graphs and Inductor skipped them (its finding): once what it skipped them for "
    "is gone, the replay takes these launches away"
)


def _for_compiled_code(f: Finding, c: Capture) -> Finding:
    if f.kind not in COMPILED_ADVICE:
        return f
    advice = COMPILED_ADVICE[f.kind]
    if f.kind in CUDA_GRAPHS and c.code is not None and c.code.cudagraph_skips:  # asked for already
        tiles = "; mode='max-autotune' tries larger tiles" if f.kind == Kind.LATENCY else ""
        advice = SKIPPED_ADVICE + tiles
    elif f.kind in CUDA_GRAPHS:
        advice += graph_blockers(c)
    return replace(f, advice=advice)


def replayed_share(c: Capture) -> float:
    """The share of the step's device time run by CUDA graphs' replays."""
    total = sum(i.ms for i in c.items)
    return sum(i.ms for i in c.items if i.replayed) / total if total else 0.0


REPLAYED_STEP = 0.5  # of the device time replayed: the step is told it replays CUDA graphs already
REPLAYED_ADVICE = (
    "the step already replays CUDA graphs ({share:.0%} of its device time): what is left between kernels is "
    "the host's time between replays (inputs copied into the graphs' static buffers, code outside the "
    "graphs, the graph breaks between them): compile the whole step into one graph (fullgraph=True), keep "
    "inputs in place (a static KV cache, torch.compiler.cudagraph_mark_step_begin() between steps)"
)


def _for_replayed_graphs(f: Finding, share: float) -> Finding:
    """Launch gaps where the step already replays CUDA graphs are not advised CUDA graphs."""
    if f.kind not in CUDA_GRAPHS:
        return f
    return replace(f, advice=REPLAYED_ADVICE.format(share=share))


def graph_blockers(c: Capture) -> str:
    """What in this step keeps CUDA graphs from replaying it (Inductor's skip reasons, syncs,
    graph breaks, recompiles)."""
    said = []
    code = c.code
    if code is not None and code.cudagraph_skips:
        said.append("what Inductor skipped CUDA graphs for (its finding)")
    if code is not None and code.breaks:
        b = code.breaks[0]
        said.append(f"{count_words(len(code.breaks), 'graph break', 'graph breaks')} ({b.where})")
    if code is not None and any(m.recompile for m in code.compiles):
        said.append("recompiles inside the step")
    syncs = c.idle.syncs if c.idle is not None else []
    if syncs:
        op = syncs[0][0]
        place = c.idle.sync_places.get(op, "")
        said.append(f"a CPU sync ({op.split('::')[-1]}{' at ' + place if place else ''})")
    if not said:
        return "; this step has none of what blocks them (CPU syncs, graph breaks, recompiles)"
    return "; in this step, first remove: " + ", ".join(said)


def blockers_first(found: list[Finding], compiled: bool) -> list[Finding]:
    """The findings, largest saving first, except that in compiled code the ones whose fix comes
    first go before the CUDA-graphs finding they block (a graph break, a recompile, a CPU sync:
    CUDA graphs replay none of them, and the launch gaps they leave are partly theirs)."""
    ranked = sorted(found, key=lambda o: -o.saves_ms)
    at = next((i for i, o in enumerate(ranked) if o.kind == Kind.LAUNCH), None)
    if not compiled or at is None:
        return ranked
    blocking = [o for o in ranked[at + 1 :] if o.kind in BLOCKERS]
    rest = [o for o in ranked[at:] if o not in blocking]
    return ranked[:at] + blocking + rest
