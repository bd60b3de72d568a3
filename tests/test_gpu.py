"""GPU tests (marker `gpu`): run by `make gpu-check` on a CUDA machine; skipped elsewhere."""

import pytest
import torch
import torch.nn.functional as F

import perfloop as pl

pytestmark = pytest.mark.gpu

CASES = [(op, v) for op in pl.ops.names() for v in pl.ops.get(op).variants]


@pytest.mark.parametrize("op_name, variant", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_every_variant_on_the_gpu(op_name, variant):
    op = pl.ops.get(op_name)
    # torch.compile specializes per shape and dtype: a few shapes keep this test to seconds
    kwargs = {"shapes": op.test_shapes[1:4]} if variant == "compiled" else {}
    recs = op.check(variant, device="cuda", **kwargs)
    assert all(r["bad"] == 0 for r in recs)


def test_events_time_a_known_gpu_sleep():
    # torch.cuda._sleep spins for a number of cycles; calibrate cycles -> ms first.
    # Clocks ramp up under load (345 MHz idle on an H200): calibrate warm.
    cycles = 2_000_000
    for _ in range(50):
        torch.cuda._sleep(cycles)
    ref = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        ref.append(s.elapsed_time(e))
    m = pl.bench(torch.cuda._sleep, cycles, flush_l2=False)
    assert m.median_ms == pytest.approx(sorted(ref)[10], rel=0.1)
    assert m.meta["timer"] == "cuda_event"


def test_graph_replay_removes_launch_overhead():
    x = torch.randn(1024, device="cuda")
    from perfloop.ops.gelu.torch_impl import naive

    plain = pl.bench(naive, x)
    graph = pl.bench(naive, x, graph=True)
    assert graph.median_ms < plain.median_ms
    assert graph.meta["calls_per_sample"] > 1
    # the kernels' own time (CUPTI) is under the replay time, and a few us for 8 tiny kernels
    assert graph.meta["graph_kernels_per_call"] == pytest.approx(8, abs=0.5)
    assert 0 < graph.meta["graph_kernel_ms"] <= graph.median_ms


def test_graph_capture_failure_is_a_clear_error():
    x = torch.randn(1024, device="cuda")
    with pytest.raises(ValueError, match="graph=True"):
        pl.bench(lambda: x.sum().item(), graph=True)


def test_profile_counts_the_naive_gelu_kernels():
    from perfloop.ops.gelu.torch_impl import naive

    x = torch.randn(4096, 4096, device="cuda")
    p = pl.profile(naive, x, calls=5)
    assert p.launches_per_call == 8
    assert p.distinct_kernels == 6
    assert p.kind == "cuda" and 0 < p.gpu_busy_fraction <= 1


def test_diagnose_classifies_launch_bound():
    x = torch.randn(1024, device="cuda")
    w = pl.ops.get("gelu").work((1024,), torch.float32)
    p = pl.profile(F.gelu, x, calls=20, work=w)
    assert p.diagnose().bound == "launch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_flash_attention_gradients_on_the_gpu(dtype):
    from test_attention import test_forward_lse_and_gradients_match_float64

    shapes = [  # ragged (every loop masked), and multiples of the GPU tiles (unmasked loops run)
        (1, 2, 17, 17, 16, True),
        (1, 1, 33, 70, 40, True),
        (2, 1, 100, 37, 32, False),
        (2, 4, 257, 300, 128, True),
        (1, 2, 256, 256, 64, True),
        (1, 1, 256, 384, 128, False),
        (1, 1, 384, 256, 128, True),
    ]
    for shape in shapes:
        test_forward_lse_and_gradients_match_float64(shape, dtype)


def test_flash_attention_memory_grows_linearly_with_sequence():
    from perfloop.ops.attention.triton_impl import flash_attention

    peaks = {}
    for s in (4096, 16384):
        q, k, v = (torch.randn(1, 8, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        flash_attention(q, k, v)
        torch.cuda.synchronize()
        peaks[s] = torch.cuda.max_memory_allocated() - base
        del q, k, v
    assert peaks[16384] / peaks[4096] < 5  # 4x the tokens: ~4x, where S^2 would be 16x


def test_memory_snapshot_is_written_for_memory_viz(tmp_path):
    import pickle

    x = torch.randn(1024, 1024, device="cuda")
    path = tmp_path / "snap.pickle"
    p = pl.profile(lambda: (x @ x).relu(), memory_snapshot=path)
    assert p.peak_memory_bytes >= 4 * 1024 * 1024
    snap = pickle.loads(path.read_bytes())
    assert "segments" in snap and "device_traces" in snap
