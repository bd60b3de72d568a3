"""Which candidates tune proposes, from what the diagnosis found; names and errors."""

import pytest

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates import CANDIDATES, get
from perfloop.workflows.tune.tuner import Options, propose, untried


def _keys(findings, cuda, **kw):
    return [k for k, _, _ in propose(findings, cuda, Options("x.py", **kw))]


def test_compile_is_always_tried_and_each_finding_proposes_its_fix():
    findings = [
        {"kind": Kind.PRECISION.value, "share": 0.45, "saves_ms": 4.5},
        {"kind": Kind.OPTIMIZER.value, "share": 0.10, "saves_ms": 1.0},
    ]
    assert _keys([], cuda=True) == ["compile"]  # CUDA graphs where the step waits on the host
    keys = _keys(findings, cuda=True)
    assert {"tf32", "fused-optimizer", "compile"} <= set(keys)
    shares = {k: s for k, _, s in propose(findings, True, Options("x.py"))}
    assert shares["tf32"] == pytest.approx(0.45) and shares["fused-optimizer"] == pytest.approx(0.10)


def test_on_the_cpu_what_needs_cuda_is_left_out():
    findings = [{"kind": Kind.PRECISION.value, "share": 0.45}, {"kind": Kind.OPTIMIZER.value, "share": 0.1}]
    keys = _keys(findings, cuda=False)
    assert "tf32" not in keys and "compile-reduce-overhead" not in keys
    assert {"compile", "fused-optimizer"} <= set(keys)


def test_what_changes_numerics_is_tried_only_when_allowed():
    findings = [{"kind": Kind.PRECISION.value, "share": 0.45}]
    assert "autocast-bf16" not in _keys(findings, cuda=True)
    assert "autocast-bf16" in _keys(findings, cuda=True, allow_numerics=True)


def test_names_are_unique_and_unknown_ones_are_refused_with_the_list():
    names = [c.name for c in CANDIDATES]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="no such candidate; known: tf32"):
        get("tf23")
    with pytest.raises(ValueError, match="cannot load"):
        get("no_such_module_here:X")
    with pytest.raises(ValueError, match="is not a perfloop tune Candidate"):
        get("os:sep")


def test_pl_tune_names_its_bad_arguments():
    import perfloop as pl

    with pytest.raises(ValueError, match="script: nothere.py is not a file"):
        pl.tune("nothere.py")
    with pytest.raises(ValueError, match="budget: cannot read 'soon'"):
        pl.tune(__file__, budget="soon")
    with pytest.raises(ValueError, match="steps: must be an integer >= 1, got 0"):
        pl.tune(__file__, steps=0)
    with pytest.raises(ValueError, match="--try tf23: no such candidate"):
        pl.tune(__file__, tried=["tf23"])


def test_a_finding_no_candidate_answers_is_said_as_the_users_own_change_with_its_share():
    """The small-batch finding of a graphed decode (the batch is the script's to choose) and a
    sync in the loop: said with their share and advice; what a candidate tries (fusion: patch)
    and what saves little are not."""
    findings = [
        {"kind": "small batch", "title": "1 token(s) a step", "share": 0.97, "advice": "batch the requests"},
        {"kind": "fusion", "title": "a run of ops", "share": 0.4, "advice": "pl.patch"},
        {"kind": "sync", "title": "the GPU waits", "share": 0.02, "advice": "no .item()"},
    ]
    [note] = untried(findings)
    assert "1 token(s) a step (97% of the profiled step); batch the requests" in note, note
    assert not untried(findings[1:])
