"""Each row of a breakdown against the machine's measured ceilings: achieved GB/s and TFLOP/s,
their share of the copy and matmul ceilings for the row's dtype, arithmetic intensity, the
bound, and the headroom -- its time minus its time at the ceiling."""

from __future__ import annotations

from dataclasses import replace

from perfloop.analysis.bound import Bound
from perfloop.harness.measurement import matmul_ceiling

SMALL_BYTES = 2**20  # a kernel moving less than this cannot hide its launch and ramp-up ...
LATENCY_US = 50.0  # ... if it is this short ...
LATENCY_SHARE = 0.3  # ... and is latency-bound when it reaches under this share of its ceiling
SUSPECT = 1.05


def ceiling_ms(flops: float, nbytes: float, dtype: str, ceilings: dict) -> tuple[float, float]:
    """(memory ms, compute ms): the time its bytes take at the copy ceiling and its FLOPs at
    the matmul ceiling of its dtype."""
    copy = ceilings.get("copy_gbps") or 0.0
    peak = matmul_ceiling(ceilings, dtype or None) or 0.0
    mem = nbytes / (copy * 1e9) * 1e3 if copy else 0.0
    comp = flops / (peak * 1e12) * 1e3 if peak and flops else 0.0
    return mem, comp


def latency_bound(ms: float, at_ceiling_ms: float, bytes_per_kernel: float, kernels: int) -> bool:
    """Short, small kernels far from their ceiling: launch and ramp-up, not bandwidth, set
    their time."""
    short = ms * 1e3 / max(kernels, 1) < LATENCY_US
    return short and bytes_per_kernel < SMALL_BYTES and at_ceiling_ms < LATENCY_SHARE * ms


def apply(row, ceilings: dict, memory_ms: float, compute_ms: float, l2_bytes: int = 0):
    """The row with its roofline columns filled in (memory_ms and compute_ms summed over the
    row's ops, each op at the ceiling of its own dtype)."""
    ms = row.device_ms
    if row.bytes is None or ms <= 0:
        return row
    copy = ceilings.get("copy_gbps")
    gbps = row.bytes / (ms * 1e-3) / 1e9
    tflops = (row.flops or 0.0) / (ms * 1e-3) / 1e12
    peak = (
        (row.flops / (compute_ms * 1e-3) / 1e12)
        if compute_ms
        else matmul_ceiling(ceilings, row.dtype or None)
    )
    of_copy = gbps / copy if copy else None
    of_matmul = tflops / peak if peak and row.flops else None
    at_ceiling = max(memory_ms, compute_ms)
    if at_ceiling <= 0 or latency_bound(ms, at_ceiling, row.bytes / max(row.calls, 1), row.calls):
        bound = Bound.LATENCY
    else:
        bound = Bound.COMPUTE if compute_ms > memory_ms else Bound.MEMORY
    note = ""
    if of_copy is not None and of_copy > SUSPECT:
        if l2_bytes and row.bytes / row.calls < l2_bytes:
            note = (
                f"{of_copy:.0%} of the copy ceiling: its operands fit in the L2 cache "
                f"({l2_bytes / 2**20:.0f} MiB), which serves them faster than DRAM"
            )
        else:
            note = (
                f"{of_copy:.0%} of the copy ceiling: the byte estimate is suspect (the kernel "
                "may read less than its whole tensors); check it with ncu"
            )
    if of_matmul is not None and of_matmul > SUSPECT:
        note = (
            f"{of_matmul:.0%} of the {row.dtype or 'fp32'} matmul ceiling: the FLOP formula or the "
            "dtype is suspect (a kernel that skips work, or a narrower dtype than recorded)"
        )
    return replace(
        row,
        gbps=gbps,
        tflops=tflops if row.flops else None,
        intensity=(row.flops or 0.0) / row.bytes if row.bytes else None,
        of_copy=of_copy,
        of_matmul=of_matmul,
        bound=bound,
        headroom_ms=max(0.0, ms - at_ceiling),
        note="; ".join(x for x in (row.note, note) if x),
    )
