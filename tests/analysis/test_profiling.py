"""Profile, annotate, diagnose and diff on the CPU (the same code paths the GPU uses)."""

import json
import os

import pytest
import torch

import perfloop as pl
from perfloop.ops.gelu.torch_impl import naive

CEIL = {"copy_gbps": 4200.0, "matmul_bf16_tflops": 790.0, "matmul_fp32_tflops": 50.0}
GELU = pl.Work(bytes=2 * 16384**2 * 4, flops=10 * 16384**2, dtype="torch.float32")


@pytest.mark.gpu
def test_profile_counts_the_naive_gelu_kernels():
    from perfloop.ops.gelu.torch_impl import naive

    x = torch.randn(4096, 4096, device="cuda")
    p = pl.profile(naive, x, calls=5)
    assert p.launches_per_call == 8
    assert p.distinct_kernels == 6
    assert p.kind == "cuda" and 0 < p.gpu_busy_fraction <= 1


@pytest.mark.gpu
def test_memory_snapshot_is_written_for_memory_viz(tmp_path):
    import pickle

    x = torch.randn(1024, 1024, device="cuda")
    path = tmp_path / "snap.pickle"
    p = pl.profile(lambda: (x @ x).relu(), memory_snapshot=path)
    assert p.peak_memory_bytes >= 4 * 1024 * 1024
    snap = pickle.loads(path.read_bytes())
    assert "segments" in snap and "device_traces" in snap


def test_profile_counts_the_naive_gelu_ops_and_exports_a_trace(tmp_path):
    x = torch.randn(256, 256)
    p = pl.profile(naive, x, calls=3, work=pl.ops.get("gelu").work((256, 256), torch.float32))
    assert p.launches_per_call == 8  # pow, mul, add, mul, tanh, add, mul, mul
    names = {k.short for k in p.kernels}
    assert {"aten::pow", "aten::tanh", "aten::mul", "aten::add"} <= names
    assert abs(sum(k.share for k in p.kernels) - 1) < 1e-6
    assert p.kernels == sorted(p.kernels, key=lambda k: -k.total_ms)
    assert "launches/call" in p.table()
    trace = p.export_trace(tmp_path / "t.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::tanh" for e in events)


def test_export_trace_to_an_unwritable_place_is_a_clear_error(tmp_path):
    p = pl.profile(torch.exp, torch.randn(10))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        p.export_trace(tmp_path / "no" / "such" / "t.json")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions
        pytest.skip("running as root: a read-only folder is still writable")
    with pytest.raises(PermissionError, match="cannot write"):
        p.export_trace(ro / "t.json")


def test_a_raising_function_surfaces_and_the_profiler_is_stopped():
    calls = {"n": 0}

    def sometimes():
        calls["n"] += 1
        if calls["n"] > 2:  # past the warm-up: inside the profiled region
            raise ArithmeticError("inside the profile")
        return torch.randn(4)

    with pytest.raises(ArithmeticError, match="inside the profile"):
        pl.profile(sometimes, warmup=2)
    assert not torch.autograd.profiler._is_profiler_enabled
    assert pl.profile(torch.exp, torch.randn(8)).launches_per_call >= 1  # profiling still works


def test_annotate_shows_in_traces_and_costs_little_when_nothing_listens(tmp_path):
    @pl.annotate("my-step")
    def step(x):
        return x * 2

    p = pl.profile(step, torch.randn(100), calls=2)
    trace = json.loads(p.export_trace(tmp_path / "t.json").read_text())
    assert sum(e.get("name") == "my-step" for e in trace["traceEvents"]) == 2
    assert [k.name for k in p.kernels] == ["aten::mul"]  # a range is not work
    with pl.annotate("inline"):
        pass
    idle = pl.bench(lambda: pl.annotate("idle").__enter__().__exit__(None, None, None), budget_s=0.3)
    assert idle.median_ms < 0.01  # under 10 us per range with no profiler attached
    with pytest.raises(ValueError, match="name"):
        pl.annotate("")


def test_diff_names_the_kernels_that_went_away():
    x = torch.randn(128, 128)
    before = pl.profile(naive, x)
    after = pl.profile(torch.nn.functional.gelu, x, approximate="tanh")
    d = pl.diff(before, after)
    assert "aten::tanh" in d.removed and "aten::gelu" in d.added
    assert d.launches == (8, 1)


def test_memory_snapshot_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.raises(ValueError, match="memory_snapshot: CUDA memory snapshots need a CUDA GPU"):
        pl.profile(torch.exp, torch.randn(8), memory_snapshot=tmp_path / "s.pickle")
    with pytest.raises(ValueError, match="calls"):
        pl.profile(torch.exp, torch.randn(8), calls=0)


@pytest.mark.parametrize(
    "name, short",
    [
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, "
            "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, ...)",
            "elementwise[mul, scalar]",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda(at::Tensor"
            "IteratorBase&)::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >",
            "elementwise[tanh]",
        ),
        (
            "void (anonymous namespace)::gelu_vec_kernel<float, 1>(uint4 const*, uint4*, long)",
            "gelu_vec_kernel",
        ),
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT"),
        ("triton_poi_fused_add_mul_pow_tanh_0", "triton_poi_fused_add_mul_pow_tanh_0"),
    ],
)
def test_kernel_names_are_shortened_readably(name, short):
    from perfloop.analysis.kernels import short_name

    assert short_name(name) == short


def test_the_profilers_usdt_lines_are_held_back_and_other_output_kept(capfd):
    import os

    from perfloop.analysis.recording import _without_usdt_lines

    with _without_usdt_lines():
        os.write(2, b"USDT: profiler_start probe\n")
        os.write(1, b"a real message\n")
        os.write(2, b"a real warning\n")
    out, err = capfd.readouterr()
    assert "USDT" not in out + err
    assert "a real message" in out and "a real warning" in err  # each on the stream it was written to


def test_cli_says_each_library_warning_once_as_a_note(capsys, monkeypatch):
    import warnings

    from perfloop.cli import env, main

    def noisy(args):
        for _ in range(3):
            warnings.warn("TensorFloat32 tensor cores available but not enabled", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(env, "run", noisy)
    assert main(["env"]) == 0
    err = capsys.readouterr().err
    assert err.count("TensorFloat32") == 1 and err.startswith("note (")


def test_a_cpu_call_profiled_on_a_gpu_machine_says_it_ran_on_the_cpu():
    from perfloop.analysis.profiling import _activity
    from perfloop.analysis.recording import start_profiler, stop_profiler

    prof = start_profiler(False, [])
    torch.randn(64, 64) @ torch.randn(64, 64)
    stop_profiler(prof)
    warnings = []
    kind, items, _ = _activity(prof.events(), True, warnings)  # as if on a GPU machine
    assert kind == "cpu" and any(name == "aten::matmul" for name, *_ in items)
    assert "the call ran on the CPU" in warnings[0]


def test_a_librarys_internal_deprecation_is_not_the_last_word_unless_verbose(capsys, monkeypatch):
    import warnings

    from perfloop.cli import env, main

    def deprecated_inside_torch(args):
        warnings.warn_explicit(
            "torch.jit.script_method is deprecated",
            DeprecationWarning,
            "/x/site-packages/torch/jit/_script.py",
            365,
        )
        warnings.warn("TensorFloat32 tensor cores available but not enabled", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(env, "run", deprecated_inside_torch)
    assert main(["env"]) == 0
    err = capsys.readouterr().err
    assert "script_method" not in err and "TensorFloat32" in err  # the actionable one stays
    monkeypatch.setenv("PERFLOOP_VERBOSE", "1")
    assert main(["env"]) == 0
    assert "note (torch DeprecationWarning): torch.jit.script_method is deprecated" in capsys.readouterr().err


def test_on_a_cpu_the_ops_time_is_set_against_the_wall_it_was_measured_in():
    import perfloop as pl

    a = torch.randn(256, 256)
    p = pl.profile(lambda: [a @ a for _ in range(20)], calls=2, count_work=False)
    line = p.table().splitlines()[-1]
    assert "under the profiler" in line and "without it" in line, line
    assert p.device_ms_per_call <= p.profiled_wall_ms_per_call * 1.001  # never more ops than wall


def test_a_diff_whose_profile_caught_no_device_work_says_so_instead_of_a_huge_ratio():
    from perfloop.analysis.compare_profiles import ProfileDiff

    text = str(ProfileDiff([], [], (66.136, 1.98e-13), (3.0, 1.0)))
    assert "66.136 ms -> none recorded" in text and "no ratio" in text and "x)" not in text
    assert "(2.00x)" in str(ProfileDiff([], [], (2.0, 1.0), (3.0, 1.0)))


def test_a_profile_is_read_only_what_its_source_recorded_is_handed_in_whole():
    """Script mode and trace import once set a profile's step, call sites and samples after
    making it; they are build_profile's arguments now, and a profile cannot be changed."""
    import dataclasses

    import torch

    import perfloop as pl

    x = torch.randn(64, 64)
    p = pl.profile(lambda: x @ x, calls=2, count_work=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.step = "optimizer.step"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.sites = {}
    assert p.items() is p.items()  # attributed once, kept
