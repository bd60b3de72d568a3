"""The device's idle time by its host cause (timeline.Cause), each at the line of the user's
code that held the host: synchronizing calls (and data-dependent shapes, named as such), launch
overhead, the allocator, data loading, host work outside torch. The compiles', the graph breaks',
the optimizer loop's, the pageable copies' and skipped CUDA graphs' idle are their own findings'."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import cudagraph_skips, decode_weights, optimizer, pageable
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.idle_record import Cause
from perfloop.harness.measurement import fmt_ms

HOST = {  # the idle's cause -> (what the host was doing, what removes it)
    Cause.SYNC: (
        "synchronizing calls, and the emptied queue after them",
        "remove the synchronization from the step: keep values on the GPU (no .item(), "
        ".cpu(), print of a tensor, or data-dependent shapes) or read them every N steps",
    ),
    Cause.LAUNCH: (
        "the host launches work slower than the device runs it",
        "fewer launches: torch.compile, or CUDA graphs "
        "(torch.compile(mode='reduce-overhead')); keep the host ahead (no Python work between "
        "kernels)",
    ),
    Cause.PAGEABLE: ("a host-to-device copy from pageable memory", pageable.ADVICE),
    Cause.ALLOCATOR: (
        "the caching allocator asks the driver for memory (cudaMalloc/cudaFree)",
        "no torch.cuda.empty_cache() in the step; steady shapes; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    Cause.CUDNN_PLAN: (
        "SDPA's cuDNN backend builds an attention plan for each shape it has not seen",
        "keep the attention's shapes fixed: a KV cache preallocated to the longest sequence and "
        "attended in full with a mask (gpt-fast's form), not one grown or sliced a token at a time; "
        "or leave cuDNN out: with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
        "SDPBackend.EFFICIENT_ATTENTION]) around the call, or torch.backends.cuda.enable_cudnn_sdp(False)",
    ),
    Cause.DATA: (
        "data loading in the step's thread (the DataLoader's iterator)",
        "DataLoader(num_workers=N, pin_memory=True, persistent_workers=True): collate in "
        "worker processes, ahead of the step",
    ),
    Cause.OPTIMIZER: (
        "the optimizer's per-parameter host loop",
        "a fused or foreach optimizer: torch.optim.AdamW(..., fused=True) (a few launches "
        "per step instead of several per parameter)",
    ),
    Cause.OUTSIDE: (
        "host work outside torch (Python, NumPy; time in C code is charged to the Python line "
        "that called it) in the step",
        "move it out of the step (precompute it, or into DataLoader workers), or do it in "
        "torch on the device",
    ),
}


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    idle, loop, copies = c.idle, optimizer.loop_ms(c), bool(pageable.copies(c))
    if idle is None:
        return []
    for cause, ms in idle.by_cause.items():
        if cause in (Cause.FIRST, Cause.COMPILE, Cause.GRAPH_BREAK) or not ms:
            continue  # the compiles' and the breaks' idle are theirs (compilation_found, graph_breaks_found)
        if cause == Cause.OPTIMIZER and loop:
            continue  # the optimizer's loop is in the optimizer's opportunity
        if cause == Cause.PAGEABLE and copies:
            continue  # in the pageable copies' opportunity
        if idle.device == "CPU" and cause == Cause.LAUNCH:
            continue  # a CPU's time between ops mixes dispatch, the allocator and the profiler's cost
        if cause == Cause.LAUNCH and cudagraph_skips.takes_launch_gaps(c):
            continue  # CUDA graphs were asked for and skipped: that finding's, with its reason
        if idle.device == "CPU" and cause == Cause.OUTSIDE:  # only what a line of the user's explains
            ms = sum(v for k, p, v in idle.places if k == cause and p)
            if not ms:
                continue
        in_graphs = cause == Cause.LAUNCH and c.compiled is not None and idle.launch_in_graphs_ms is not None
        if in_graphs:  # what CUDA graphs replay: the compiled graphs' own launches
            ms = min(ms, idle.launch_in_graphs_ms)
        elif cause == Cause.LAUNCH:
            ms += idle.by_cause[Cause.FIRST]
        ms /= c.calls
        if cause == Cause.SYNC and idle.sync_saving_ms:  # the timeline replayed without the waits
            ms = max(ms, min(idle.sync_saving_ms / c.calls, idle.idle_ms / c.calls))
        title, advice = HOST[cause]
        evidence = (
            f"idle {fmt_ms(ms)} per call"
            + (" inside the compiled graphs' calls" if in_graphs else "")
            + (f"; busy {idle.busy_ms / idle.wall_ms:.0%}" if cause == Cause.LAUNCH else "")
        )
        kind = {Cause.LAUNCH: Kind.LAUNCH, Cause.CUDNN_PLAN: Kind.CUDNN_PLAN}.get(cause, Kind.HOST)
        if cause == Cause.SYNC:
            kind, title, advice, evidence = _syncs(c, idle, title, advice, evidence)
        places = [(p, v / c.calls) for k, p, v in idle.places if k == cause and p][:3]
        waits = "the GPU waits" if idle.device == "GPU" else "between the step's ops"
        bound = Bound.LAUNCH if cause == Cause.LAUNCH else Bound.HOST
        where = "; ".join(f"{p} {fmt_ms(v)}" for p, v in places)
        site = Site(line=places[0][0]) if places else None
        f.add(kind, f"{waits}: {title}", ms, bound, evidence, advice, where, site, cause=cause, idle_ms=ms)
    return f.found


DATA_DEPENDENT_USE = {  # the user's op around a data-dependent sync -> how the code says it
    "aten::index": "boolean-mask indexing (x[mask])",
    "aten::index_put_": "boolean-mask assignment (x[mask] = y)",
    "aten::index_put": "boolean-mask assignment (x[mask] = y)",
    "aten::_index_put_impl_": "boolean-mask assignment (x[mask] = y)",
    "aten::masked_select": "masked_select",
    "aten::nonzero": "nonzero (or torch.where with one argument)",
    "aten::repeat_interleave": "repeat_interleave with tensor repeats",
}


SAMPLING = {
    "aten::multinomial": "torch.multinomial checks its probabilities on the host",
    "aten::item": ".item()",
}
SAMPLING_ADVICE = (
    "sample on the device: torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1, "
    "keepdim=True) draws as torch.multinomial(probs, 1) does, without its host check (gpt-fast's "
    "multinomial_sample_one_no_sync); keep the tokens in a device tensor and read them once after the loop "
    "(or every N tokens for streaming), and stop on EOS by checking every N tokens"
)


def _sampling(c: Capture, idle) -> str:
    """How the first synchronizing call samples in a generation step ('' where it does not)."""
    if not idle.syncs or decode_weights.generation_tokens(c) is None:
        return ""
    around = idle.outer.get(idle.syncs[0][0]) or {idle.syncs[0][0]}
    return ", ".join(SAMPLING[op] for op in sorted(around) if op in SAMPLING)


def _syncs(c: Capture, idle, title: str, advice: str, evidence: str) -> tuple[Kind, str, str, str]:
    """(kind, title, advice, evidence) of the synchronizing calls' finding: data-dependent
    shapes named as such, with the device-side rewrite."""
    if idle.syncs:
        evidence += " after " + "; ".join(
            f"{op.split('::')[-1]} x{n // c.calls}" + (f" at {', '.join(sites[:3])}" if sites else "")
            for op, n, _, sites in idle.syncs[:3]
        )
    own = idle.sync_host_ms - idle.waited_ms
    if own > 0:
        evidence += f"; their ops' own host time {fmt_ms(own / c.calls)} per call, the queue empty after it"
    sampling = _sampling(c, idle)
    if sampling:
        return Kind.SAMPLING_SYNC, f"the sampling syncs each token ({sampling})", SAMPLING_ADVICE, evidence
    dependent = idle.data_dependent()
    if not dependent or dependent[0][0] != idle.syncs[0][0]:
        return Kind.SYNC, title, advice, evidence
    uses = sorted({DATA_DEPENDENT_USE.get(outer, outer.split("::")[-1]) for _, outer in dependent})
    return (
        Kind.DATA_DEPENDENT,
        f"data-dependent shapes ({', '.join(uses)}): the host waits for the device to count each "
        "output, and the emptied queue after it",
        "keep the shapes static: compute every row and select with torch.where(mask[..., None], new, old) "
        "(or multiply by the mask) instead of x[mask]; masked_fill for x[mask] = value; where rows must "
        "be gathered (routing), gather once a step and reuse the indices, or give the size "
        "(torch.nonzero_static, repeat_interleave(output_size=))",
        evidence,
    )
