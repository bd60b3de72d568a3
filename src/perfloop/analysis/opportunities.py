"""A whole step's diagnosis: the opportunities in it, largest time saved first, each with its
evidence, its bound and the next step.

Where the saving comes from:
- fusion: a run of memory-bound ops in one module moves every intermediate through memory;
  fused, it reads its inputs and writes its outputs once (the tensors it touches say how many
  bytes that is); a run of tiny kernels is launch-bound instead;
- precision: an fp32 matmul with TF32 off, when the TF32 or bf16 ceiling is higher;
- an op below its ceiling: its time minus its time at the ceiling (the roofline's headroom);
- dtype casts and copies: the time of the casts autocast inserts;
- idle: the time the device waited on the host, after synchronizing calls or while it launched.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from perfloop.analysis import attribution as attr
from perfloop.analysis import roofline, timeline
from perfloop.analysis.bound import Bound
from perfloop.analysis.compilation import CompiledCode
from perfloop.analysis.compiled_found import (
    COMPILED_ADVICE,
    blockers_first,
    compilation_found,
    graph_blockers,
    graph_breaks_found,
)
from perfloop.analysis.findings import Diagnosis, Evidence, Finding, Kind, Site, count_words
from perfloop.analysis.inductor import COMPILED_OP
from perfloop.analysis.patterns import (
    ADVICE,
    LAYOUT_OPS,
    chain_advice,
    chain_kind,
    chain_kinds,
    chains,
    matches,
    ops_list,
    where_any,
    where_called,
    written_attention_modules,
)
from perfloop.harness.measurement import fmt_ms, matmul_ceiling

MIN_SHARE = 0.01  # opportunities saving less of the step are not listed
FUSE_PASSES = 1.5  # a run that moves at least this many times the bytes it needs fused
HOST = {  # timeline's cause -> (what the host was doing, what removes it)
    timeline.SYNC: (
        "synchronizing calls, and the emptied queue after them",
        "remove the synchronization from the step: keep values on the GPU (no .item(), "
        ".cpu(), print of a tensor, or data-dependent shapes) or read them every N steps",
    ),
    timeline.LAUNCH: (
        "the host launches work slower than the device runs it",
        "fewer launches: torch.compile, or CUDA graphs "
        "(torch.compile(mode='reduce-overhead')); keep the host ahead (no Python work between "
        "kernels)",
    ),
    timeline.PAGEABLE: (
        "a host-to-device copy from pageable memory",
        "pin the host tensor (tensor.pin_memory(), DataLoader(pin_memory=True)) and copy "
        "with .to(device, non_blocking=True), or keep the data on the GPU",
    ),
    timeline.ALLOCATOR: (
        "the caching allocator asks the driver for memory (cudaMalloc/cudaFree)",
        "no torch.cuda.empty_cache() in the step; steady shapes; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    timeline.DATA: (
        "data loading in the step's thread (the DataLoader's iterator)",
        "DataLoader(num_workers=N, pin_memory=True, persistent_workers=True): collate in "
        "worker processes, ahead of the step",
    ),
    timeline.OPTIMIZER: (
        "the optimizer's per-parameter host loop",
        "a fused or foreach optimizer: torch.optim.AdamW(..., fused=True) (a few launches "
        "per step instead of several per parameter)",
    ),
    timeline.OUTSIDE: (
        "host work outside torch (Python, NumPy; time in C code is charged to the Python line "
        "that called it) in the step",
        "move it out of the step (precompute it, or into DataLoader workers), or do it in "
        "torch on the device",
    ),
}


Opportunity = Finding  # the names before one Finding type served every analysis
StepDiagnosis = Diagnosis


@dataclass
class Step:
    """What every analyzer below reads (one profiled step, times per call) and what it adds to:
    the opportunities found, and the (module, phase, op) keys an earlier analyzer explained."""

    items: list
    work: dict | None
    records: list | None
    b_items: list | None
    idle: timeline.Idle | None
    ceilings: dict
    calls: int
    step_ms: float
    l2_bytes: int
    sites: dict | None
    kind: str
    compiled: CompiledCode | None = None  # what ran compiled: its advice is not "torch.compile"
    found: list[Finding] = field(default_factory=list)
    covered: set = field(default_factory=set)

    @property
    def copy(self) -> float:
        return self.ceilings.get("copy_gbps") or 0.0

    def at_copy_ms(self, nbytes: float) -> float:
        return nbytes / (self.copy * 1e9) * 1e3 if self.copy else 0.0

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
    ) -> None:
        """A finding of analyzer `kind` (a Kind or its word), kept where it saves MIN_SHARE of
        the step or more; `values`: the numbers its evidence says."""
        kind = Kind(kind)
        if self.compiled is not None and (kind in COMPILED_ADVICE or "torch.compile" in advice):
            advice = COMPILED_ADVICE.get(kind, COMPILED_ADVICE[Kind.ROOFLINE])
            if "CUDA graphs" in advice:
                advice += graph_blockers(self)
        if saves / self.step_ms >= MIN_SHARE:
            ev = Evidence(evidence, values)
            share = saves / self.step_ms
            self.found.append(Finding(title, saves, share, bound, ev, advice, where, kind, site or Site()))


def rank(
    items,
    work,
    records,
    b_items,
    idle,
    ceilings: dict,
    calls: int,
    wall_ms: float,
    l2_bytes: int = 0,
    sites: dict | None = None,
    kind: str = "cuda",
    compiled: CompiledCode | None = None,
) -> Diagnosis:
    """The ranked opportunities of a profile: `items` and `work` from the timed calls (`calls`
    of them), `records` and `b_items` from the counted call, `idle` from timeline.idle; times
    per call. `sites` (nn.patch.plan's, by module name) names the call site of each fusable
    chain; `kind` is the profile's device ("cuda", or "cpu" where the ops are the work);
    `compiled`: what ran compiled (compilation.CompiledCode), or None. Each
    analyzer below answers one question; the order matters only where one explains time that a
    later one would count again (`covered`, `kept`)."""
    device_ms = sum(i.ms for i in items) / calls
    s = Step(
        items,
        work,
        records,
        b_items,
        idle,
        ceilings,
        calls,
        max(wall_ms, device_ms) or 1e-12,
        l2_bytes,
        sites,
        kind,
        compiled,
    )
    compilation_found(s)
    graph_breaks_found(s)
    attention = written_attention(s)
    fusablechains(s, attention)
    kept = [i for i in items if (i.module, i.phase, i.op) not in s.covered and i.phase != "optimizer"]
    kept, pageable = pageable_copies(s, kept)
    kept = layout_copies(s, kept)
    loop_ms = optimizer_step(s)
    top_row = op_rows(s, kept)
    idle_causes(s, loop_ms, bool(pageable))
    s.found = blockers_first(s.found, compiled)
    busy = (
        idle.busy_ms / idle.wall_ms if idle is not None and idle.wall_ms else min(1.0, device_ms / s.step_ms)
    )
    out = Diagnosis(s.found, s.step_ms, device_ms, busy)
    if not s.found and top_row is not None and top_row.bound in (Bound.COMPUTE, Bound.MEMORY):
        of = top_row.of_matmul if top_row.bound == Bound.COMPUTE else top_row.of_copy
        if of is not None:
            ceiling = "matmul" if top_row.bound == Bound.COMPUTE else "copy"
            out.at_ceiling = f"{top_row.name} runs at {of:.0%} of the measured {ceiling} ceiling"
            out.ceiling_bound = top_row.bound
    return out


def written_attention(s: Step) -> dict:
    """Attention computed op by op (its scores through memory); its ops are covered."""
    attention = written_attention_modules(s.items)
    for pattern, (mods, ms, n_ops) in attention.items():
        s.add(
            "attention",
            f"attention written out in {pattern}: the scores go through memory",
            ms / s.calls,
            Bound.MEMORY,
            f"{n_ops} ops on the T x T scores between its two matmuls, forward and backward, "
            f"{fmt_ms(ms / s.calls)} per call" + (f" in {len(mods)} modules" if len(mods) > 1 else ""),
            ADVICE["attention"] + ": one kernel, the scores never written (is_causal=True for a causal "
            "mask, attn_mask= for another; dropout_p= for attention dropout)",
            where=where_called(pattern, "attention", s.sites),
            site=Site(pattern),
            ops=n_ops,
            modules=len(mods),
        )
        s.covered |= {(i.module, i.phase, i.op) for i in s.items if i.module in mods}
    return attention


def fusablechains(s: Step, attention: dict) -> None:
    """Runs of memory-bound ops in one module: launch-bound where tiny, else fusable."""
    a_ms: dict = defaultdict(float)
    for i in s.items:
        a_ms[(i.module, i.phase, i.op)] += i.ms / s.calls
    found = chains(s.records or [], s.b_items or [], a_ms)
    for c, kind in zip(found, chain_kinds(found), strict=True):
        if any(matches(c["module"], mods) for mods, _, _ in attention.values()):
            continue  # its ops are the written-out attention's
        ideal = s.at_copy_ms(c["ideal_bytes"])
        where = f"{c['module']} ({c['phase']}{', x' + str(c['count']) if c['count'] > 1 else ''})"
        if roofline.latency_bound(
            c["ms"], s.at_copy_ms(c["bytes"]), c["bytes"] / max(c["kernels"], 1), c["kernels"]
        ):
            fix = (
                "fuse them into one kernel (torch.compile), or replay the step as a CUDA graph "
                "(torch.compile(mode='reduce-overhead'), torch.cuda.graphs)"
                if s.kind == "cuda"
                else "fuse them into one (torch.compile): each op's dispatch costs ~its work"
            )
            unit = "kernels" if s.kind == "cuda" else "ops"
            mean_us = c["ms"] * 1e3 / max(c["kernels"], 1)
            evidence = f"{ops_list(c['ops'])}; mean {mean_us:.1f} us each, {fmt_ms(c['ms'])} per call"
            s.add(
                "tiny ops",
                f"{c['kernels']} tiny {unit} in a row in {where}",
                c["ms"] - ideal,
                Bound.LAUNCH,
                evidence,
                fix,
                site=Site(c["module"]),
                kernels=c["kernels"],
                mean_us=mean_us,
            )
            s.covered |= c["keys"]
            continue
        passes = c["bytes"] / c["ideal_bytes"] if c["ideal_bytes"] else float("inf")
        if passes < FUSE_PASSES:
            continue  # little to fuse: its ops are judged one by one
        s.covered |= c["keys"]
        moved, needed = c["bytes"] / 1e6, c["ideal_bytes"] / 1e6
        evidence = (
            f"{ops_list(c['ops'])}: {moved:.1f} MB moved where {needed:.1f} MB (its inputs and outputs) "
            f"would do, {passes:.1f}x; {fmt_ms(c['ms'])} -> ~{fmt_ms(ideal)} fused"
        )
        site = where_called(c["module"], kind, s.sites)
        title = f"{len(c['ops'])} memory-bound ops in a row in {where}: fuse them"
        s.add(
            "fusion",
            title,
            c["ms"] - ideal,
            Bound.MEMORY,
            evidence,
            chain_advice(c["ops"], kind),
            site,
            Site(c["module"]),
            bytes=c["bytes"],
            ideal_bytes=c["ideal_bytes"],
            passes=passes,
        )


def pageable_copies(s: Step, kept: list) -> tuple[list, list]:
    """Host-to-device copies from unpinned memory, with the host's staging time."""
    pageable = [i for i in kept if "Pageable" in i.kernel]
    if not pageable:
        return kept, []
    dev_ms = sum(i.ms for i in pageable) / s.calls
    staging = s.idle.by_cause[timeline.PAGEABLE] / s.calls if s.idle is not None else 0.0
    n = len(pageable) // s.calls
    copies = "1 host-to-device copy" if n == 1 else f"{n} host-to-device copies"
    s.add(
        "pageable copy",
        f"{copies} from pageable memory per call",
        dev_ms + staging,
        Bound.HOST,
        f"{fmt_ms(dev_ms)} per call of device copies from pageable memory (staged by the host, at a "
        f"fraction of the link's speed)"
        + (f"; the GPU idle {fmt_ms(staging)} while the host staged it" if staging else ""),
        HOST[timeline.PAGEABLE][1],
        device_ms=dev_ms,
        staging_ms=staging,
    )
    return [i for i in kept if "Pageable" not in i.kernel], pageable


def layout_copies(s: Step, kept: list) -> list:
    """Copies that change a layout only (.contiguous(), clone)."""
    layout = [i for i in kept if (i.outer_op or i.op) in LAYOUT_OPS]
    if not layout:
        return kept
    ms = sum(i.ms for i in layout) / s.calls
    by_module: dict = defaultdict(float)
    for i in layout:
        by_module[f"{i.module} ({i.phase})"] += i.ms / s.calls
    ops = sorted({(i.outer_op or i.op).split("::")[-1] for i in layout})
    top = sorted(by_module.items(), key=lambda kv: -kv[1])[:3]
    s.add(
        "layout copy",
        f"layout copies: {len(layout) // s.calls} per call ({', '.join(ops)})",
        ms,
        Bound.MEMORY,
        f"{fmt_ms(ms)} per call copying tensors to a new layout, in "
        + "; ".join(f"{m} {fmt_ms(v)}" for m, v in top),
        "keep the layout the next op takes: matmul and scaled_dot_product_attention read transposed "
        "operands (drop the .contiguous()), transpose after the op rather than before, or "
        "torch.compile, which folds the copy into the op that reads it",
        site=Site(top[0][0].rsplit(" (", 1)[0]),
        by_module=dict(top),
    )
    return [i for i in kept if (i.outer_op or i.op) not in LAYOUT_OPS]


def optimizer_step(s: Step) -> float:
    """The optimizer's kernels against its bytes, and its host loop; the loop's idle ms."""
    opt = [i for i in s.items if i.phase == "optimizer"]
    if not opt:
        return 0.0
    idle = s.idle
    loop_ms = idle.by_cause[timeline.OPTIMIZER] / s.calls if idle is not None else 0.0
    opt_ms = sum(i.ms for i in opt) / s.calls
    nbytes = sum(w[1] for k, w in (s.work or {}).items() if k[1] == "optimizer") / s.calls
    ideal = s.at_copy_ms(nbytes)
    waits = "the GPU" if idle is None or idle.device == "GPU" else "the CPU's ops"
    loop = f"; {waits} idle {fmt_ms(loop_ms)} per call in its host loop between them" if loop_ms else ""
    unit = "kernels" if idle is None or idle.device == "GPU" else "ops"
    s.add(
        "optimizer",
        f"optimizer: {len(opt) // s.calls} {unit} per step",
        opt_ms - ideal + loop_ms,
        Bound.HOST if loop_ms > opt_ms - ideal else Bound.MEMORY,
        f"{fmt_ms(opt_ms)} per call"
        + (
            f" for {nbytes / 1e6:.1f} MB of parameters, gradients and "
            f"moments: {nbytes / (opt_ms * 1e-3) / 1e9 / s.copy:.0%} of copy"
            if nbytes and s.copy
            else ""
        )
        + loop,
        ADVICE["optimizer"] + " (one pass over the parameters, its state and gradients)",
        site=Site("optimizer"),
        kernels_ms=opt_ms,
        bytes=nbytes,
        loop_ms=loop_ms,
    )
    return loop_ms


def op_rows(s: Step, kept: list):
    """Each op (and phase) against its roofline: fp32 matmuls with TF32 off, ops below their
    ceiling, and the casts autocast inserts together (an Inductor kernel named for a cast is a
    fused kernel with the cast folded in: a row like any other). Returns the heaviest row."""
    casts, top_row, fp32 = 0.0, None, []
    sites = _row_sites(kept)
    for row in attr.group(kept, "op/phase", work=s.work, ceilings=s.ceilings, l2_bytes=s.l2_bytes):
        cat = attr.category(row.name.rsplit(" (", 1)[0])
        if top_row is None or row.device_ms > top_row.device_ms:
            top_row = row
        if cat == "dtype cast/copy" and not row.name.startswith(COMPILED_OP):
            casts += row.device_ms / s.calls
        elif _tf32_off(s, row, cat):
            fp32.append(row)
        else:
            _below_ceiling(s, row, cat, sites.get(row.name))
    if fp32:
        _fp32_matmuls(s, fp32, sites)
    if casts:
        eager = [i for i in kept if not i.op.startswith(COMPILED_OP)]
        n = sum(1 for i in eager if attr.category(i.op or i.kernel) == "dtype cast/copy") // s.calls
        s.add(
            "dtype cast",
            f"dtype casts and copies: {n} per call",
            casts,
            Bound.MEMORY,
            f"{fmt_ms(casts)} per call in copy kernels (autocast casts each weight on every use)",
            "keep the weights in the compute dtype (bf16 parameters with an fp32 master copy), or "
            "torch.compile, which folds the casts into the kernels that use them",
        )
    return top_row


def _row_sites(kept: list) -> dict:
    """op/phase row name -> the Site of its heaviest placed module (compiled code's kernels and
    extern calls carry the line they came from)."""
    ms: dict = {}
    for i in kept:
        if i.line:
            key = (attr.key_of(i, "op/phase"), i.module, i.line)
            ms[key] = ms.get(key, 0.0) + i.ms
    out: dict = {}
    for (name, module, line), _ms in sorted(ms.items(), key=lambda kv: kv[1]):
        out[name] = Site(module, line)  # the heaviest last
    return out


def _faster_ceiling(s: Step) -> float:
    return max(
        filter(None, [s.ceilings.get("matmul_tf32_tflops"), s.ceilings.get("matmul_bf16_tflops")]), default=0
    )


def _tf32_off(s: Step, row, cat: str) -> bool:
    """Whether a row is an fp32 matmul where a TF32 or bf16 ceiling is much higher."""
    fp32 = matmul_ceiling(s.ceilings, "fp32") or 0
    return bool(
        cat == "matmul" and row.dtype == "fp32" and row.flops and fp32 and _faster_ceiling(s) > 1.5 * fp32
    )


def _fp32_matmuls(s: Step, rows: list, sites: dict) -> None:
    """The fp32 matmul rows with TF32 off, as one finding: one switch fixes them all. Each saves
    its time less its time at the faster ceiling (or at the copy rate, where that is longer)."""
    faster = _faster_ceiling(s)
    rows = sorted(rows, key=lambda r: -r.device_ms)
    at = [max(s.at_copy_ms(r.bytes), r.flops / (faster * 1e12) * 1e3) for r in rows]
    saves = sum(r.device_ms - t for r, t in zip(rows, at, strict=True)) / s.calls
    each = "; ".join(f"{r.name}: {r.calls // s.calls} call(s), {r.tflops:.1f} TFLOP/s" for r in rows[:3])
    site = sites.get(rows[0].name)
    s.add(
        "precision",
        f"{rows[0].name}{f' and {len(rows) - 1} more' if len(rows) > 1 else ''}: fp32 matmuls with TF32 off",
        saves,
        Bound.PRECISION,
        f"{each}; the TF32 ceiling is {faster:.0f}",
        "torch.backends.cuda.matmul.allow_tf32 = True (torch.set_float32_matmul_precision('high')), "
        "or bf16 autocast",
        str(site or ""),
        site,
        tflops=rows[0].tflops,
        tf32_ceiling_tflops=faster,
    )


def _below_ceiling(s: Step, row, cat: str, site: Site | None = None) -> None:
    if row.headroom_ms is None or row.bound is None:
        return
    of = row.of_matmul if row.bound == Bound.COMPUTE else row.of_copy
    ceiling = "matmul" if row.bound == Bound.COMPUTE else "copy"
    ev = (
        f"{count_words(row.calls // s.calls, 'call', 'calls')}, {fmt_ms(row.device_ms / s.calls)} per call"
        + (f", {of:.0%} of the {ceiling} ceiling" if of is not None else "")
    )
    if row.bound == Bound.LATENCY:
        short = "the GPU" if s.kind == "cuda" else "the CPU's threads, its dispatch a large share"
        ev += f", mean {row.device_ms * 1e3 / row.calls:.1f} us: too short to fill {short}"
    latency = (
        "fewer, larger launches: fuse (torch.compile) or batch them; CUDA graphs"
        if s.kind == "cuda"
        else "fewer, larger ops: fuse (torch.compile) or batch them"
    )
    advice = ADVICE.get(cat, ADVICE["other"]) if row.bound != Bound.LATENCY else latency
    if cat == "attention" and row.name.startswith("aten::") and "attention" in row.name:  # already fused
        advice = (
            "already scaled_dot_product_attention: only another backend measured faster at this "
            "shape helps (perfloop bench attention, with torch.nn.attention.sdpa_kernel to pick it)"
        )
    s.add(
        "latency" if row.bound == Bound.LATENCY else "roofline",
        f"{row.name} below its ceiling",
        row.headroom_ms / s.calls,
        row.bound,
        ev,
        advice,
        str(site) if site else where_any(chain_kind([row.name.rsplit(" (", 1)[0]]), s.sites),
        site,
    )


def idle_causes(s: Step, loop_ms: float, pageable: bool) -> None:
    """The device's idle time by its host cause (timeline.idle), each at its line."""
    idle = s.idle
    if idle is None:
        return
    for cause, ms in idle.by_cause.items():
        if cause in (timeline.FIRST, timeline.COMPILE, timeline.GRAPH_BREAK) or not ms:
            continue  # the compiles' and the breaks' idle are theirs (compilation_found, graph_breaks_found)
        if cause == timeline.OPTIMIZER and loop_ms:
            continue  # the optimizer's loop is in the optimizer's opportunity
        if cause == timeline.PAGEABLE and pageable:
            continue  # in the pageable copies' opportunity
        if idle.device == "CPU" and cause == timeline.LAUNCH:
            continue  # a CPU's time between ops mixes dispatch, the allocator and the profiler's cost
        if idle.device == "CPU" and cause == timeline.OUTSIDE:  # only what a line of the user's explains
            ms = sum(v for c, p, v in idle.places if c == cause and p)
            if not ms:
                continue
        in_graphs = (
            cause == timeline.LAUNCH and s.compiled is not None and idle.launch_in_graphs_ms is not None
        )
        if in_graphs:  # what CUDA graphs replay: the compiled graphs' own launches
            ms = min(ms, idle.launch_in_graphs_ms)
        elif cause == timeline.LAUNCH:
            ms += idle.by_cause[timeline.FIRST]
        ms /= s.calls
        if cause == timeline.SYNC and idle.sync_saving_ms:  # the timeline replayed without the waits
            ms = max(ms, min(idle.sync_saving_ms / s.calls, idle.idle_ms / s.calls))
        title, advice = HOST[cause]
        evidence = (
            f"idle {fmt_ms(ms)} per call"
            + (" inside the compiled graphs' calls" if in_graphs else "")
            + (f"; busy {idle.busy_ms / idle.wall_ms:.0%}" if cause == timeline.LAUNCH else "")
        )
        kind = "launch" if cause == timeline.LAUNCH else "host"
        if cause == timeline.SYNC:
            kind, title, advice, evidence = _syncs(s, idle, title, advice, evidence)
        places = [(p, v / s.calls) for c, p, v in idle.places if c == cause and p][:3]
        waits = "the GPU waits" if idle.device == "GPU" else "between the step's ops"
        bound = Bound.LAUNCH if cause == timeline.LAUNCH else Bound.HOST
        where = "; ".join(f"{p} {fmt_ms(v)}" for p, v in places)
        site = Site(line=places[0][0]) if places else None
        s.add(kind, f"{waits}: {title}", ms, bound, evidence, advice, where, site, cause=cause, idle_ms=ms)


DATA_DEPENDENT_USE = {  # the user's op around a data-dependent sync -> how the code says it
    "aten::index": "boolean-mask indexing (x[mask])",
    "aten::index_put_": "boolean-mask assignment (x[mask] = y)",
    "aten::index_put": "boolean-mask assignment (x[mask] = y)",
    "aten::_index_put_impl_": "boolean-mask assignment (x[mask] = y)",
    "aten::masked_select": "masked_select",
    "aten::nonzero": "nonzero (or torch.where with one argument)",
    "aten::repeat_interleave": "repeat_interleave with tensor repeats",
}


def _syncs(s: Step, idle, title: str, advice: str, evidence: str) -> tuple[str, str, str, str]:
    """(kind, title, advice, evidence) of the synchronizing calls' finding: data-dependent
    shapes named as such, with the device-side rewrite."""
    if idle.syncs:
        evidence += " after " + "; ".join(
            f"{op.split('::')[-1]} x{n // s.calls}" + (f" at {', '.join(sites[:3])}" if sites else "")
            for op, n, _, sites in idle.syncs[:3]
        )
    own = idle.sync_host_ms - idle.waited_ms
    if own > 0:
        evidence += f"; their ops' own host time {fmt_ms(own / s.calls)} per call, the queue empty after it"
    dependent = idle.data_dependent()
    if not dependent or dependent[0][0] != idle.syncs[0][0]:
        return "sync", title, advice, evidence
    uses = sorted({DATA_DEPENDENT_USE.get(outer, outer.split("::")[-1]) for _, outer in dependent})
    return (
        "data-dependent",
        f"data-dependent shapes ({', '.join(uses)}): the host waits for the device to count each "
        "output, and the emptied queue after it",
        "keep the shapes static: compute every row and select with torch.where(mask[..., None], new, old) "
        "(or multiply by the mask) instead of x[mask]; masked_fill for x[mask] = value; where rows must "
        "be gathered (routing), gather once a step and reuse the indices, or give the size "
        "(torch.nonzero_static, repeat_interleave(output_size=))",
        evidence,
    )
