"""CUDA graphs asked for and not used: `torch.compile(mode="reduce-overhead")` where Inductor
skipped the CUDA graphs of a graph it compiled and said why ("skipping cudagraphs due to mutated
inputs ... Found from: File "model.py", line 88"). The step then launches every kernel from the
host, as eager code does, and the advice to replay it as CUDA graphs is advice to do what the
code already asks for: the fix is what the reason names. The saving is what the replay would
take away: the launch gaps inside the compiled graphs' calls (all launch gaps where those are
not known)."""

from __future__ import annotations

import os
import re

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site
from perfloop.analysis.idle_record import Cause

_LINE = re.compile(r'File "([^"]+)", line (\d+)')
FIXES = (  # a word of the reason -> what removes it
    (
        "mutated inputs",
        "the graph updates a tensor it takes as an input in place (a cache written with index_put_ or "
        "copy_, a running statistic): keep that tensor a buffer of a module the compiled function "
        "owns (static address), or make the update outside the compiled function",
    ),
    (
        "cpu",  # "cpu device", "non gpu ops" / "cpu ops"
        "the graph holds CPU tensors or ops: create its tensors on the GPU (torch.tensor(..., "
        "device='cuda'), no .cpu() inside), and pass device scalars as Python numbers",
    ),
    (
        "dynamic shape",
        "its shapes change from call to call: pad inputs to a few fixed sizes (or mark them "
        "static with torch._dynamo.mark_static), so each size is one graph recorded once",
    ),
    (
        "index_put_ fallback with boolean",
        "boolean-mask assignment (x[mask] = y) has a data-dependent size: write it as "
        "torch.where(mask, y, x) or x.masked_fill(mask, value)",
    ),
    (
        "control flow operator",
        "torch.cond / torch.while_loop in the graph: decide the branch outside the compiled "
        "function, or compute both sides and select with torch.where",
    ),
    (
        "multiple devices",
        "the graph's tensors are on several devices: keep one compiled function to one GPU",
    ),
    (
        "incompatible op",
        "an op CUDA graphs cannot record (it syncs or allocates on the host): move it out of the "
        "compiled function or replace it with a device-side form",
    ),
)


def _fix(reason: str) -> str:
    low = reason.lower()
    default = "remove what the reason names from the compiled function"
    return next((fix for word, fix in FIXES if word in low), default)


def _short(reason: str) -> str:
    """The reason without Inductor's stack trace ("Found from: ...")."""
    head = reason.split("Found from", 1)[0].split("\n", 1)[0].strip().rstrip(".:")
    return head.removeprefix("skipping cudagraphs due to ").removeprefix("disabling cudagraphs due to ")


def _line(reason: str) -> str:
    """The user's line the reason points at: the last "File ..., line N" outside torch."""
    lines = [(f, n) for f, n in _LINE.findall(reason) if f"{os.sep}torch{os.sep}" not in f]
    return f"{os.path.basename(lines[-1][0])}:{lines[-1][1]}" if lines else ""


def takes_launch_gaps(c: Capture) -> bool:
    """Whether this finding explains the compiled step's launch gaps (the idle finding then
    leaves them to it, and no advice says to use CUDA graphs)."""
    return c.code is not None and bool(c.code.cudagraph_skips)


def find(c: Capture, ceilings: dict) -> list[Finding]:
    if not takes_launch_gaps(c):
        return []
    code, idle, gaps = c.code, c.idle, 0.0
    if idle is not None:
        gaps = idle.launch_in_graphs_ms
        if gaps is None:
            gaps = idle.by_cause.get(Cause.LAUNCH, 0.0) + idle.by_cause.get(Cause.FIRST, 0.0)
    f = Findings(c, ceilings)
    reasons = list(dict.fromkeys(code.cudagraph_skips))
    first, line = reasons[0], _line(reasons[0])
    others = "; ".join(_short(r) for r in reasons[1:3])
    more = f" (and {len(reasons) - 1} other reason(s): {others})" if reasons[1:] else ""
    f.add(
        Kind.CUDA_GRAPHS_SKIPPED,
        f"CUDA graphs asked for and skipped: {_short(first)}",
        gaps / c.calls,
        Bound.LAUNCH,
        f"Inductor did not record the compiled graph as CUDA graphs: {_short(first)}{more}; the "
        f"step launches its kernels from the host, {gaps / c.calls:.3f} ms of launch gaps a call",
        _fix(first),
        line,
        Site(line=line),
        reasons=len(reasons),
    )
    return f.found
