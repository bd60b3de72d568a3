"""The diagnosis rules: launch-, memory-, compute-bound, from the evidence in numbers."""

import pytest
import torch
import torch.nn.functional as F

import perfloop as pl
from perfloop.analysis.diagnose import classify

CEIL = {"copy_gbps": 4200.0, "matmul_bf16_tflops": 790.0, "matmul_fp32_tflops": 50.0}
GELU = pl.Work(bytes=2 * 16384**2 * 4, flops=10 * 16384**2, dtype="torch.float32")


@pytest.mark.gpu
def test_diagnose_classifies_launch_bound():
    x = torch.randn(1024, device="cuda")
    w = pl.ops.get("gelu").work((1024,), torch.float32)
    p = pl.profile(F.gelu, x, calls=20, work=w)
    assert p.diagnose().bound == "launch"


def test_rules_naive_gelu_is_memory_bound_with_about_9_passes():
    d = classify(
        device_ms=4.5,
        wall_ms=4.6,
        busy_fraction=0.97,
        distinct_kernels=6,
        launches=8,
        work=GELU,
        ceilings=CEIL,
    )
    assert d.bound == "memory"
    assert 8 < d.evidence["hbm_passes"] < 10
    assert "fused into one kernel it is at most ~9x faster" in d.advice and "torch.compile" in d.advice


def test_rules_fused_gelu_near_copy_is_memory_bound_at_the_limit():
    d = classify(
        device_ms=0.51,
        wall_ms=0.52,
        busy_fraction=0.98,
        distinct_kernels=1,
        launches=1,
        work=GELU,
        ceilings=CEIL,
    )
    assert d.bound == "memory" and "near the limit" in d.advice


def test_rules_tiny_op_is_launch_bound():
    w = pl.Work(bytes=8192, flops=10240, dtype="torch.float32")
    d = classify(
        device_ms=0.001,
        wall_ms=0.04,
        busy_fraction=0.025,
        distinct_kernels=1,
        launches=1,
        work=w,
        ceilings=CEIL,
    )
    assert d.bound == "launch" and "CUDA graph" in d.advice
    on_cpu = classify(
        device_ms=0.001,
        wall_ms=0.04,
        busy_fraction=0.025,
        distinct_kernels=1,
        launches=1,
        work=w,
        ceilings=CEIL,
        kind="cpu",
    )
    assert on_cpu.bound == "launch" and "torch.compile" in on_cpu.advice
    assert "CUDA graph" not in on_cpu.advice and "GPU" not in on_cpu.advice, on_cpu.advice


def test_rules_big_bf16_matmul_is_compute_bound():
    n = 8192
    w = pl.Work(bytes=3 * n * n * 2, flops=2 * n**3, dtype="torch.bfloat16")
    d = classify(
        device_ms=1.4, wall_ms=1.5, busy_fraction=0.93, distinct_kernels=1, launches=1, work=w, ceilings=CEIL
    )
    assert d.bound == "compute"
    assert d.evidence["intensity"] > d.evidence["ridge"]


def test_rules_gelu_just_past_a_noisy_ridge_is_not_called_compute_bound():
    """Ceilings measured on a busy 2-core CPU (copy 65 GB/s, fp32 matmul 0.07 TFLOP/s) put the
    ridge at 1.07 flop/B, under the naive GELU's 1.25: the rules said "compute-bound at 2% of the
    matmul ceiling" for 8 elementwise launches (the demo, under load). Within a factor of two of
    the ridge the measured ceilings cannot tell the roofs apart; the kernels are near neither."""
    w = pl.Work(bytes=2 * 2048**2 * 4, flops=10 * 2048**2, dtype="torch.float32")
    noisy = {"copy_gbps": 65.0, "matmul_fp32_tflops": 0.0697}
    d = classify(
        device_ms=35.5,
        wall_ms=36.4,
        busy_fraction=0.98,
        distinct_kernels=4,
        launches=8,
        work=w,
        ceilings=noisy,
    )
    assert d.evidence["intensity"] > d.evidence["ridge"]  # the case: just past the ridge
    assert d.bound == "memory", str(d)
    assert "fused into one kernel it is at most" in d.advice


def test_rules_without_work_say_what_is_missing():
    d = classify(
        device_ms=1.0,
        wall_ms=1.1,
        busy_fraction=0.9,
        distinct_kernels=1,
        launches=1,
        work=None,
        ceilings=CEIL,
    )
    assert d.bound == "unclear" and "work" in d.advice


def test_one_bound_vocabulary_prints_compares_and_serializes_as_its_word():
    import json

    from perfloop.analysis.bound import Bound
    from perfloop.analysis.findings import Diagnosis, Finding

    o = Finding("x", 1.0, 0.5, Bound.MEMORY, "e", "a")
    assert o.bound == "memory" and f"{o.bound}-bound" == "memory-bound" and str(o.bound) == "memory"
    assert "1.000 ms per call (50% of the step), memory-bound" in str(o)
    step = Diagnosis([], 1.0, 1.0, 1.0)
    assert step.bound is Bound.NONE and json.loads(json.dumps(step.to_dict()))["bound"] == "none"
    assert {b.value for b in Bound} >= {"launch", "memory", "compute", "latency", "host", "precision"}


def test_diagnose_is_one_type_with_or_without_work_and_its_findings_serialize():
    """One op with its Work is a one-finding diagnosis of the same type a step gets; each
    finding carries its kind, bound, saving, structured evidence and site, through JSON."""
    import json

    import torch

    from perfloop.analysis.findings import Diagnosis, Finding

    n = 256
    x = torch.randn(n, n)
    work = pl.Work(bytes=2 * n * n * 4, flops=n * n, dtype="fp32")
    one = pl.profile(lambda: torch.relu(x), calls=3, work=work).diagnose(ceilings=CEIL)
    step = pl.profile(lambda: torch.relu(x @ x), calls=3).diagnose(ceilings=CEIL)
    assert type(one) is Diagnosis and type(step) is Diagnosis
    [f] = one.findings
    assert isinstance(f, Finding) and f.bound == one.bound and f.kind in ("launch", "roofline")
    assert f.saves_ms >= 0 and f.evidence.values["kernels"] == one.evidence["kernels"]
    assert str(one).startswith(f"{one.bound}-bound\n  evidence: ")  # said as one op's verdict
    back = json.loads(json.dumps(one.to_dict()))
    assert back["opportunities"][0]["kind"] == f.kind and back["opportunities"][0]["values"]["kernels"] >= 1
    assert set(back["opportunities"][0]["site"]) == {"module", "line"}


def test_a_findings_kind_is_one_of_a_closed_set():
    """Each analyzer names its findings with a Kind; a word outside the set is refused where the
    finding is made, not carried as a stray string."""
    from perfloop.analysis.capture import Capture
    from perfloop.analysis.causes.base import Findings
    from perfloop.analysis.findings import Kind

    s = Findings(Capture(device="cpu", calls=1, wall_ms=10.0), {})
    s.add(Kind.GRAPH_BREAK, "t", 5.0, "host", "e", "a")
    assert s.found[0].kind is Kind.GRAPH_BREAK and s.found[0].kind == "graph break"
    with pytest.raises(TypeError, match="kind: a findings.Kind"):
        s.add("graph break", "t", 5.0, "host", "e", "a")
