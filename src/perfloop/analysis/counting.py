"""The counted call: one more call of the profiled code under a WorkCounter (each aten op's
FLOPs and bytes from its real tensors) and the profiler, each kernel tied to the counted op that
launched it; where the code ran compiled, with the profiler recording shapes too (the generated
kernels' buffers are their bytes)."""

from __future__ import annotations

import torch

from perfloop.analysis.attribution import annotations, device_events, items
from perfloop.analysis.compilation import live_metrics
from perfloop.analysis.inductor import GRAPH_CALL, placed, replays
from perfloop.analysis.recording import start_profiler, stop_profiler, with_dtypes
from perfloop.analysis.work import WorkCounter


def by_shapes(events) -> bool:
    """Whether the counted call records its ops' shapes too: where the profiled calls (`events`)
    ran compiled code, whose generated kernels no WorkCounter sees (their launches' recorded
    buffers are their bytes)."""
    return any(e.name.startswith(GRAPH_CALL) for e in events)


def counted(prof, records: list, on_cuda: bool, trees: list | None = None):
    """(records, items, 1) of a call counted by a WorkCounter under the (stopped) profiler."""
    events = with_dtypes(prof)
    kind = "cuda" if on_cuda and device_events(events, annotations(events)) else "cpu"
    metrics = live_metrics()
    return records, items(events, kind, placed(events, metrics, trees), replays(metrics, trees)), 1


def counted_call(call, on_cuda: bool, warnings: list[str], timed, trees: list | None = None):
    """(records, items, 1): one more call under the WorkCounter and the profiler, each kernel
    tied to the counted op that launched it; None, with a warning, where the call cannot run
    under a dispatch mode."""
    shapes = by_shapes(timed.events())
    prof = start_profiler(on_cuda, [], shapes=shapes)
    try:
        with WorkCounter() as wc:
            call()
        if on_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        warnings.append(f"FLOPs and bytes not counted: the call failed under the counting mode ({exc})")
        return None
    finally:
        stop_profiler(prof)
    return counted(prof, wc.records, on_cuda, trees)
