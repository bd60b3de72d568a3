"""Batch 1 in a generation step bound by its weights' read (issue 54's napkin-math finding), read
on the decode steps recorded on the H100: the bf16 decode replayed as CUDA graphs (1 token a step,
65% of the copy ceiling) and the same decode eager (launch-bound, 4%)."""

import dataclasses

import pytest

from fixtures.record import HERE
from perfloop.analysis.capture import load
from perfloop.analysis.causes.small_batch import proposed
from perfloop.analysis.findings import Kind
from perfloop.analysis.ranking import rank
from perfloop.analysis.tokens import batch_bound


def _graphed(**model):
    c, ceilings = load(HERE / "gpu-decode-cuda-graphs.json.gz")
    return dataclasses.replace(c, model={**c.model, **model}), ceilings


def _small(d):
    return [f for f in d.findings if f.kind == Kind.SMALL_BATCH]


def test_the_batch_proposed_is_the_largest_power_of_two_within_a_quarter_of_the_napkin_batch():
    assert proposed(1, 258.0) == 64 and proposed(16, 258.0) == 64
    assert proposed(32, 258.0) == 64 and proposed(33, 258.0) is None  # at least twice the tokens
    assert proposed(1, 7.0) is None  # the matmuls' FLOPs bound the step at a couple of tokens


def test_the_graphed_decode_at_one_sequence_is_told_to_batch_first_with_what_the_batch_costs():
    c, ceilings = _graphed()
    d = rank(c, ceilings)
    top = d.findings[0]
    assert top.kind == Kind.SMALL_BATCH and top.bound.value == "memory", str(d)
    v = top.evidence.values
    assert v["batch_bound"] == pytest.approx(batch_bound(c.model, ceilings)) and v["batch"] == 64
    # 64 sequences read the same 3.5 GB of weights and 64 KV caches of 33.6 MB: the step grows by
    # the bytes, at the rate it reads now
    grown = (c.model["weights"] + 64 * c.model["cache"]) / (c.model["weights"] + c.model["cache"])
    assert v["step_ms_then"] == pytest.approx(c.step_ms * grown)
    assert top.saves_ms == pytest.approx(c.step_ms - c.step_ms * grown / 64)
    assert v["tokens_per_s_then"] > 30 * v["tokens_per_s"]
    assert "64 tokens a step" in top.evidence and "KV cache" in top.evidence and "vLLM" in top.advice
    assert not any("reduce-overhead" in f.advice for f in d.findings)  # it replays graphs already


def test_a_bigger_kv_cache_a_sequence_makes_the_batched_step_dearer():
    small, ceilings = _graphed()
    large, _ = _graphed(cache=small.model["cache"] * 20)
    [a], [b] = (_small(rank(c, ceilings)) for c in (small, large))
    assert b.evidence.values["step_ms_then"] > 1.5 * a.evidence.values["step_ms_then"]
    assert b.saves_ms < a.saves_ms


def test_the_matmuls_flops_bound_the_batched_step_where_the_read_would_be_quicker():
    """With a matmul ceiling low enough that 64 tokens of FLOPs take longer than the read, the
    step predicted is the FLOPs' time, not the bytes'."""
    c, ceilings = _graphed()
    slow = {**ceilings, "matmul_bf16_tflops": ceilings["matmul_bf16_tflops"] / 4}
    [f] = _small(rank(c, slow))
    n = f.evidence.values["batch"]
    flops_ms = 2 * c.model["weights"] / 2 * n / (slow["matmul_bf16_tflops"] * 1e12) * 1e3
    assert n == 16 and f.evidence.values["step_ms_then"] == pytest.approx(max(flops_ms, c.step_ms), rel=0.2)
    assert f.evidence.values["step_ms_then"] >= flops_ms


def test_the_control_at_the_proposed_batch_has_no_such_finding():
    c, ceilings = _graphed(tokens=64, batch=64)
    assert not _small(rank(c, ceilings))


def test_an_eager_decode_waiting_on_its_launches_is_told_that_first_and_not_to_batch():
    d = rank(*load(HERE / "gpu-decode-eager.json.gz"))
    assert d.findings[0].kind == Kind.LAUNCH and not _small(d), str(d)


def test_fp32_weights_are_told_before_the_batch():
    c, ceilings = _graphed(dtypes={"float32": 3500285952})
    d = rank(c, ceilings)
    assert d.findings[0].kind == Kind.DECODE_WEIGHTS and not _small(d), str(d)


def test_a_step_of_many_tokens_is_not_a_decode_step_and_is_not_told_to_batch():
    c, ceilings = _graphed(tokens=512)
    assert not _small(rank(c, ceilings))
    assert not _small(rank(*_graphed(tokens=None, batch=None)))
