"""What kind of bound a profiled call is, the evidence in numbers, and the next step.

The lecture's framework: launch-bound -> fuse or capture a CUDA graph;
memory-bound with many kernels -> fuse (torch.compile for standard ops, Triton
for new access patterns); memory-bound in one kernel near the copy ceiling ->
move fewer bytes (lower precision); compute-bound -> tensor cores, lower
precision; hardware-specific tricks -> CUDA C++.
"""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.findings import Diagnosis, Evidence, Finding, Kind
from perfloop.harness.ceilings import ceilings as measured_ceilings
from perfloop.harness.measurement import Work, fmt_ms, matmul_ceiling

LAUNCH_BUSY = 0.5  # the device idle more than half the wall time
SHORT_KERNEL_US = 20.0
MEMORY_NEAR = 0.6  # achieved GB/s at least this share of the copy ceiling
COMPUTE_NEAR = 0.5
RIDGE_MARGIN = 2.0  # compute's side of the roofline: intensity past the ridge by this factor


def _verdict(bound: Bound, ev: dict, advice: str, saves_ms: float = 0.0) -> tuple:
    return bound, ev, advice, saves_ms


def classify(
    *,
    device_ms: float,
    wall_ms: float,
    busy_fraction: float,
    distinct_kernels: int,
    launches: float,
    work: Work | None,
    ceilings: dict | None,
    kind: str = "cuda",
) -> Diagnosis:
    """The rules, on plain numbers (so they are tested without a GPU); `kind` "cpu" where the
    CPU ran the ops (no launches, no CUDA graphs: its ops' time and the gaps between them)."""
    mean_kernel_us = device_ms * 1e3 / launches if launches else 0.0
    ev: dict = {
        "kernels": distinct_kernels,
        "launches_per_call": launches,
        "device_time": fmt_ms(device_ms),
        "wall_time": fmt_ms(wall_ms),
        "busy": f"{busy_fraction:.0%}",
        "mean_kernel": fmt_ms(mean_kernel_us / 1e3),
    }
    if busy_fraction < LAUNCH_BUSY and mean_kernel_us < SHORT_KERNEL_US:
        verdict = _launch_bound(ev, device_ms, wall_ms, busy_fraction, launches, mean_kernel_us, kind)
    elif work is None or not (ceilings and ceilings.get("copy_gbps")):
        verdict = _verdict(
            Bound.UNCLEAR,
            ev,
            "give the work (bytes, flops) and measured ceilings to tell memory from compute.",
        )
    else:
        verdict = _on_the_roofline(ev, device_ms, distinct_kernels, launches, work, ceilings)
    bound, ev, advice, saves = verdict
    text = ", ".join(f"{k}={x:.3g}" if isinstance(x, float) else f"{k}={x}" for k, x in ev.items())
    one = Finding(
        f"{bound}-bound",
        saves,
        saves / (max(wall_ms, device_ms) or 1e-12),
        bound,
        Evidence(text, dict(ev)),
        advice,
        kind=Kind.LAUNCH if bound == Bound.LAUNCH else Kind.ROOFLINE,
    )
    return Diagnosis([one], wall_ms, device_ms, busy_fraction, single=True, values=ev)


def _launch_bound(ev: dict, device_ms, wall_ms, busy_fraction, launches, mean_kernel_us, kind) -> tuple:
    gain = wall_ms / device_ms if device_ms else float("inf")
    saves = max(0.0, wall_ms - device_ms)
    if kind != "cuda":
        return _verdict(
            Bound.LAUNCH,
            ev,
            f"dispatch-bound: torch's ops run {busy_fraction:.0%} of the time, {launches:g} ops of "
            f"~{mean_kernel_us:.1f} us each, Python and dispatch between them. Fewer, larger ops: "
            f"fuse them (torch.compile): up to ~{gain:.0f}x if only the ops' time remained.",
            saves,
        )
    return _verdict(
        Bound.LAUNCH,
        ev,
        f"launch-bound: the GPU is busy {busy_fraction:.0%} of the time, {launches:g} launches "
        f"of ~{mean_kernel_us:.1f} us each. Fuse the ops (torch.compile), or capture a CUDA "
        f"graph (bench(graph=True), torch.compile(mode='reduce-overhead')): up to ~{gain:.0f}x "
        "if only device time remained.",
        saves,
    )


def _on_the_roofline(ev: dict, device_ms, distinct_kernels, launches, work: Work, ceilings: dict) -> tuple:
    """Compute- or memory-bound, from the achieved rates against the measured ceilings."""
    copy = ceilings["copy_gbps"]
    peak = matmul_ceiling(ceilings, work.dtype)
    gbps = work.gbps(device_ms) or 0.0
    tflops = work.tflops(device_ms) or 0.0
    ridge = (peak * 1e12) / (copy * 1e9) if peak else None
    ev.update({"GB/s": gbps, "of_copy": f"{gbps / copy:.0%}"})
    if tflops:
        ev["TFLOP/s"] = tflops
        if peak:
            ev["of_matmul"] = f"{tflops / peak:.0%}"
    if work.intensity is not None and ridge:
        ev["intensity"] = work.intensity
        ev["ridge"] = ridge
    # within a factor of the ridge, measured ceilings (a busy CPU's moved it 4x) cannot tell the
    # roofs apart: compute-bound there only when the kernels are near the matmul ceiling
    compute_side = (work.intensity or 0) > RIDGE_MARGIN * ridge if ridge else False
    at_ceiling = max(work.bytes / (copy * 1e9), (work.flops or 0) / (peak * 1e12) if peak else 0.0) * 1e3
    saves = max(0.0, device_ms - at_ceiling)
    if peak and tflops and (tflops / peak >= COMPUTE_NEAR or compute_side):
        return _verdict(
            Bound.COMPUTE,
            ev,
            f"compute-bound at {tflops / peak:.0%} of the measured matmul ceiling "
            f"(intensity {work.intensity:.0f} flop/B > ridge {ridge:.0f}). Keep it on tensor cores "
            "(bf16/fp16, or TF32 for fp32), fuse epilogues (bias, activation) so the output is "
            "written once; past ~80% only lower precision (fp8) buys much.",
            saves,
        )
    ideal_ms = work.bytes / (copy * 1e9) * 1e3
    passes = device_ms / ideal_ms if ideal_ms else 0
    if gbps / copy >= MEMORY_NEAR:
        return _verdict(
            Bound.MEMORY,
            ev,
            f"memory-bound at {gbps / copy:.0%} of the copy ceiling, in {distinct_kernels} "
            f"kernel(s): near the limit. Only moving fewer bytes helps: a narrower dtype "
            "(bf16/fp8), or fusing this op into its neighbours.",
            saves,
        )
    ev["hbm_passes"] = passes
    if launches > 1.5:
        return _verdict(
            Bound.MEMORY,
            ev,
            f"memory-bound: {distinct_kernels} kernels, {launches:g} launches, "
            f"~{passes:.0f} passes over memory (device time x copy bandwidth / minimum bytes) "
            f"where 1 read + 1 write suffice: fused into one kernel it is at most "
            f"~{passes:.0f}x faster ({fmt_ms(device_ms)} -> ~{fmt_ms(ideal_ms)} at the copy ceiling; "
            "arithmetic that does not hide behind the loads, as tanh on a CPU, keeps it slower). "
            "torch.compile does this for standard ops; write Triton when the access "
            "pattern is new.",
            saves,
        )
    if not compute_side:
        return _verdict(
            Bound.MEMORY,
            ev,
            f"memory-bound (intensity under the ridge) but one kernel reaches only "
            f"{gbps / copy:.0%} of the copy ceiling: ~{passes:.1f}x from the limit. Look at its "
            "accesses (`perfloop asm`): 16-byte vector loads, several loads in flight per "
            "thread, enough blocks to fill every SM, no re-reads.",
            saves,
        )
    return _verdict(Bound.UNCLEAR, ev, "neither near the copy nor the matmul ceiling; look at the kernels.")


def diagnose(profile, ceilings: dict | None = None) -> Diagnosis:
    """Classify a Profile with the measured ceilings (measured now if not cached)."""
    if ceilings is None and profile.work is not None:
        ceilings = measured_ceilings()
    wall, busy = profile.wall_ms_per_call, profile.gpu_busy_fraction
    if profile.kind != "cuda" and profile.profiled_wall_ms_per_call:  # a CPU's ops: the profiler's pace
        wall = profile.profiled_wall_ms_per_call
        busy = min(1.0, profile.busy_ms_per_call / wall) if wall else 0.0
    return classify(
        device_ms=profile.device_ms_per_call,
        wall_ms=wall,
        busy_fraction=busy,
        distinct_kernels=profile.distinct_kernels,
        launches=profile.launches_per_call,
        work=profile.work,
        ceilings=ceilings,
        kind=profile.kind,
    )
