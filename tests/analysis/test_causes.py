"""The causes a diagnosis looks for: one module each in analysis/causes, listed once in
ANALYZERS, each reading one frozen Capture; a new cause is one module and one list line."""

import dataclasses
import importlib
import pkgutil

import pytest
import torch
import torch.nn as nn

import perfloop as pl
from fixtures.record import HERE, ConvNet
from perfloop.analysis import causes
from perfloop.analysis.attribution import Item
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture, CaptureFormatError, dumps, load, loads
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Kind
from perfloop.analysis.ranking import rank

HELPERS = {"base"}  # modules of the package that are not causes


def test_every_cause_module_is_in_the_list_once_and_the_list_holds_nothing_else():
    modules = [m.name for m in pkgutil.iter_modules(causes.__path__) if m.name not in HELPERS]
    finds = [importlib.import_module(f"perfloop.analysis.causes.{m}").find for m in modules]
    assert sorted(f.__module__ for f in causes.ANALYZERS) == sorted(f.__module__ for f in finds)
    assert len(set(causes.ANALYZERS)) == len(causes.ANALYZERS) == len(modules)


def test_a_cause_added_to_the_list_is_ranked_with_no_other_change(monkeypatch):
    """The list is the only registry: an analyzer appended to it is run by pl.profile's
    diagnose and its finding ranked among the others, by its saving."""
    capture, ceilings = load(HERE / "softmax-in-six-ops.json.gz")

    def planted_cause(c, ceilings):
        f = Findings(c, ceilings)
        f.add(Kind.HOST, "a planted cause", c.step_ms * 0.99, Bound.HOST, "its evidence", "its fix")
        return f.found

    before = rank(capture, ceilings)
    monkeypatch.setattr(causes, "ANALYZERS", [*causes.ANALYZERS, planted_cause])
    after = rank(capture, ceilings)
    assert after.findings[0].title == "a planted cause"
    assert [f.title for f in after.findings[1:]] == [f.title for f in before.findings]


def _items(kernels: list[tuple[str, str, str, float]], calls: int) -> tuple:
    return tuple(
        Item(k, op, module, "forward", ms, 0, 1) for _ in range(calls) for k, op, module, ms in kernels
    )


TRANSPOSE_IN = "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false>"
TRANSPOSE_OUT = "void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, true>"
CONV = "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64"


def test_convolutions_in_nchw_are_one_finding_saving_the_transposes_around_them():
    """cuDNN's tensor-core convolutions run NHWC: on NCHW tensors it transposes in and out
    around each one. The finding saves the transposes' time, says channels_last, and names the
    module that spends the most on them; the transposes are not also counted as op rows."""
    calls = 2
    kernels = [
        (TRANSPOSE_IN, "aten::cudnn_convolution", "body.0", 0.3),
        (CONV, "aten::cudnn_convolution", "body.0", 1.0),
        (TRANSPOSE_OUT, "aten::cudnn_convolution", "body.0", 0.2),
        (TRANSPOSE_IN, "aten::cudnn_convolution", "body.3", 0.1),
        (CONV, "aten::cudnn_convolution", "body.3", 1.0),
    ]
    c = Capture("cuda", calls, 2.6, _items(kernels, calls))
    d = rank(c, {"copy_gbps": 4000.0, "matmul_bf16_tflops": 700.0})
    [f] = [f for f in d.findings if f.kind == Kind.CONV_LAYOUT]
    assert d.findings[0] is f, str(d)
    assert f.saves_ms == pytest.approx(0.6) and f.evidence.values["transposes"] == 3
    assert f.site.module == "body.0" and "channels_last" in f.advice
    assert not any("nchwToNhwc" in g.title or "nhwcToNchw" in g.title for g in d.findings)


def test_convolutions_already_channels_last_are_not_told_to_be():
    kernels = [
        (CONV, "aten::cudnn_convolution", "body.0", 1.0),
        (CONV, "aten::cudnn_convolution", "body.3", 1.0),
    ]
    d = rank(Capture("cuda", 1, 2.0, _items(kernels, 1)), {"copy_gbps": 4000.0})
    assert not any(f.kind == Kind.CONV_LAYOUT for f in d.findings), str(d)


def test_a_profiles_capture_saves_and_loads_unchanged_and_ranks_the_same():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    p = pl.profile(lambda: net(x).square().mean().backward(), calls=2)
    c = p.capture()
    assert c.items and c.records and c.idle is not None and c.work
    back = loads(dumps(c))
    assert back == c
    ceilings = {"copy_gbps": 20.0, "matmul_fp32_tflops": 0.5}
    assert str(rank(back, ceilings)) == str(rank(c, ceilings)) == str(p.diagnose(ceilings))


def test_a_capture_of_another_format_is_refused_with_the_version():
    text = dumps(Capture("cpu", 1, 1.0)).replace('"format": 1', '"format": 99')
    with pytest.raises(CaptureFormatError, match="format 99; this perfloop reads format 1"):
        loads(text)


def test_a_capture_is_frozen():
    c = Capture("cpu", 1, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.calls = 2


@pytest.mark.gpu
def test_on_the_gpu_bf16_convolutions_in_nchw_are_found_and_channels_last_are_not():
    def step_of(fmt):
        torch.manual_seed(0)
        net = ConvNet().to("cuda", memory_format=fmt)
        x = torch.randn(32, 128, 56, 56, device="cuda").to(memory_format=fmt)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                net(x).float().square().mean().backward()

        return step

    nchw = pl.profile(step_of(torch.contiguous_format), calls=3).diagnose()
    [f] = [f for f in nchw.findings if f.kind == Kind.CONV_LAYOUT]
    assert f.share > 0.05 and "channels_last" in f.advice, str(nchw)
    last = pl.profile(step_of(torch.channels_last), calls=3).diagnose()
    assert not any(f.kind == Kind.CONV_LAYOUT for f in last.findings), str(last)


def test_recorded_on_the_gpu_nchw_convolutions_are_found_and_channels_last_ones_are_not():
    """bf16 convolutions recorded on the H200: NCHW pays cuDNN's transposes (24 a step: in and out
    of three convolutions, forward and backward); channels_last pays none, and its batch norms are
    not told to use a fused LayerNorm."""
    nchw, ceilings = load(HERE / "gpu-conv-nchw.json.gz")
    d = rank(nchw, ceilings)
    [f] = [f for f in d.findings if f.kind == Kind.CONV_LAYOUT]
    assert f.evidence.values["transposes"] == 24 and f.share > 0.1, str(d)
    assert set(f.evidence.values["by_module"]) == {"body.0", "body.3", "body.6"}
    norms = [g for g in d.findings if "batch_norm" in g.title]
    assert norms and all("channels_last" in g.advice and "pl.patch" not in g.advice for g in norms), str(d)
    last, ceilings = load(HERE / "gpu-conv-channels-last.json.gz")
    assert not any(g.kind == Kind.CONV_LAYOUT for g in rank(last, ceilings).findings)


def test_on_the_gpu_sdpa_is_read_as_math_from_its_ops_and_as_fused_from_its_kernel_op():
    """On a GPU each SDPA call's kernels carry their own op under aten::scaled_dot_product_attention:
    bmm and softmax for the math backend, one flash / efficient op for a fused one."""

    def sdpa(ops: list[tuple[str, str, float]]) -> Capture:
        items = tuple(
            Item(k, op, "attn", "forward", ms, 0, 1, outer_op="aten::scaled_dot_product_attention")
            for k, op, ms in ops
        )
        return Capture("cuda", 1, 1.0, items)

    math = sdpa(
        [
            ("gemm", "aten::bmm", 0.3),
            ("softmax_warp_forward", "aten::_safe_softmax", 0.3),
            ("gemm", "aten::bmm", 0.3),
        ]
    )
    fused = sdpa([("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "aten::_efficient_attention_forward", 0.1)])
    ceilings = {"copy_gbps": 4000.0, "matmul_bf16_tflops": 700.0}
    [f] = [f for f in rank(math, ceilings).findings if f.kind == Kind.SDPA_MATH]
    assert f.saves_ms == pytest.approx(0.9) and f.where == "attn"  # no records: nothing known to subtract
    assert not any(f.kind == Kind.SDPA_MATH for f in rank(fused, ceilings).findings)


def test_recorded_on_the_gpu_a_graph_replays_matmuls_are_read_as_the_weights_an_fp32_decode_reads():
    """The bf16 CUDA-graphed decode recorded on the H100, its rows as that code read them (replayed
    kernels unmatched: `(CUDA graph)`, no op): read as fp32 weights, its matmul kernels are still the
    weight matmuls (none were before: the finding predicted 0 and was not listed), ranked first and
    halved; the bf16 control has no such finding."""
    c, ceilings = load(HERE / "gpu-decode-cuda-graphs.json.gz")
    assert not [f for f in rank(c, ceilings).findings if f.kind == Kind.DECODE_WEIGHTS]
    fp32 = dataclasses.replace(c, model={**c.model, "dtypes": {"float32": c.model["weights"]}})
    d = rank(fp32, ceilings)
    top = d.findings[0]
    assert top.kind == Kind.DECODE_WEIGHTS, str(d)
    gemm = ("nvjet", "splitK")
    gemms = sum(i.ms for i in c.items if i.replayed and any(g in i.kernel for g in gemm)) / c.calls
    assert top.saves_ms == pytest.approx(gemms / 2, rel=0.02), (top.saves_ms, gemms)


def test_recorded_on_the_gpu_the_eager_decode_is_launch_bound_and_the_graphed_one_is_told_it_replays():
    """The two decode captures of the H100 (run38): eager waits on its launches first; graphed, the
    step says how much of it replays CUDA graphs, and nothing advises the CUDA graphs it has."""
    eager = rank(*load(HERE / "gpu-decode-eager.json.gz"))
    assert eager.findings[0].kind == Kind.LAUNCH and "reduce-overhead" in eager.findings[0].advice, str(eager)
    graphed = rank(*load(HERE / "gpu-decode-cuda-graphs.json.gz"))
    assert graphed.values["cuda_graphs_replayed"] > 0.9, str(graphed)
    assert not any("reduce-overhead" in f.advice for f in graphed.findings), str(graphed)


def test_cudnn_plans_built_each_token_are_told_at_the_sdpa_line_and_tune_proposes_leaving_cudnn_out():
    """The eager decode recorded on the H100, its idle given 40 ms a call of cuDNN building SDPA
    plans at the attention's line (what run40 measured on the H200 for a KV cache grown by cat):
    told first, at that line, with the fixed shapes or cuDNN left out as the fix; tune then
    proposes its sdpa-no-cudnn candidate, which turns cuDNN's SDPA off in the script's process."""
    from perfloop.analysis.idle_record import Cause
    from perfloop.workflows.tune.candidates import get
    from perfloop.workflows.tune.tuner import Options, propose

    c, ceilings = load(HERE / "gpu-decode-eager.json.gz")
    plan = 40.0 * c.calls
    idle = dataclasses.replace(
        c.idle,
        wall_ms=c.idle.wall_ms + plan,
        by_cause={**c.idle.by_cause, Cause.CUDNN_PLAN: plan},
        places=[(Cause.CUDNN_PLAN, "model.py:403 (forward)", plan), *c.idle.places],
    )
    d = rank(dataclasses.replace(c, idle=idle, wall_ms=c.wall_ms + 40.0), ceilings)
    top = d.findings[0]
    assert top.kind == Kind.CUDNN_PLAN and top.saves_ms == pytest.approx(40.0), str(d)
    assert "model.py:403" in top.where and "enable_cudnn_sdp(False)" in top.advice
    assert not any(f.kind == Kind.HOST for f in d.findings if "cuDNN" in f.title)  # told once
    proposed = [k for k, _, _ in propose([{"kind": top.kind.value, "share": 0.8}], True, Options("x.py"))]
    assert "sdpa-no-cudnn" in proposed
    assert "sdpa-no-cudnn" not in [k for k, _, _ in propose([], True, Options("x.py"))]
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        get("sdpa-no-cudnn").apply(None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_sdpa_math_on_16_bit_inputs_is_read_against_a_fused_kernel_in_16_bits():
    """SDPA's math backend upcasts bf16 q, k, v to fp32 and runs its matmuls there; a fused kernel
    runs them in bf16 on tensor cores. run41 (H100, a prefill of 8,192 tokens) predicted 80 of
    the 115 ms saved, its fused kernel timed at the fp32 ceiling. The bf16 decode recorded on the
    H200 under SDPBackend.MATH, its matmuls' FLOPs made large enough to bound the fused kernel:
    that kernel's time is their FLOPs at the bf16 ceiling."""
    from perfloop.analysis.causes import sdpa_math

    c, ceilings = load(HERE / "gpu-decode-sdpa-math.json.gz")
    big = tuple(
        dataclasses.replace(r, flops=r.flops * 2000) if r and r.op == "aten::bmm" else r for r in c.records
    )
    c = dataclasses.replace(c, records=big)
    ran = sdpa_math._records(c, sdpa_math._counted(c))
    assert {r.dtype for r in ran if r.op == "aten::bmm"} == {"fp32"}  # the math path's upcast
    flops = sum(r.flops for r in ran if r.op == "aten::bmm")
    [f] = sdpa_math.find(c, ceilings)
    assert f.evidence.values["fused_ms"] == pytest.approx(
        flops / (ceilings["matmul_bf16_tflops"] * 1e12) * 1e3
    )
