"""The sampling pieces under bench: the graph replay's gap warning."""

import types

import pytest

from perfloop.harness import sampling


@pytest.mark.parametrize(
    "launches, advice", [(8, "fusing them into fewer kernels"), (1, "give each call more work")]
)
def test_graph_gap_warning_fits_the_number_of_kernels(monkeypatch, launches, advice):
    """The replay's excess over its kernels' CUPTI time: between many dependent kernels, fuse
    them; with one kernel a call there is nothing to fuse -- the advice must say so."""
    reps = 4
    monkeypatch.setattr(sampling, "replay_kernel_time", lambda replay: (reps * 0.002, reps * launches))
    sampler = types.SimpleNamespace(graph=types.SimpleNamespace(replay=lambda: None), calls_per_sample=reps)
    meta, warnings = sampling.graph_gaps(sampler, [0.004, 0.0041, 0.0039])
    assert meta == {"graph_kernel_ms": 0.002, "graph_kernels_per_call": launches}
    assert len(warnings) == 1 and "2.00x the kernels' own time" in warnings[0] and advice in warnings[0]
    gap = (0.004 - 0.002) * 1e3 / launches
    assert f"~{gap:.2f} us" in warnings[0]
    meta, warnings = sampling.graph_gaps(sampler, [0.0021])  # within 15%: no warning
    assert warnings == []


def test_no_cupti_record_leaves_the_replay_time_alone(monkeypatch):
    monkeypatch.setattr(sampling, "replay_kernel_time", lambda replay: None)
    sampler = types.SimpleNamespace(graph=types.SimpleNamespace(replay=lambda: None), calls_per_sample=2)
    assert sampling.graph_gaps(sampler, [0.004]) == ({}, [])
