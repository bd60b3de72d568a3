"""Idle time by cause, on timelines built event by event (the profiler's own event type)."""

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from perfloop.analysis.timeline import HostCompiled, gaps, idle

_ids = iter(range(1, 10**6))


def ev(name, start, end, parent=None):
    e = FunctionEvent(
        id=next(_ids), name=name, thread=1, start_us=start, end_us=end, device_type=DeviceType.CPU
    )
    if parent is not None:
        e.cpu_parent = parent
    return e


def test_gaps_are_what_no_interval_covers():
    assert gaps([(10, 20), (15, 30), (40, 50)], 0, 60) == [(0, 10), (30, 40), (50, 60)]
    assert gaps([(0, 60)], 0, 60) == []


def test_each_gap_is_charged_to_its_cause():
    step = ev("step", 0, 1000)
    item = ev("aten::_local_scalar_dense", 300, 410, step)
    sync = ev("cudaStreamSynchronize", 310, 405, item)  # returns once the device drained at 400
    events = [step, item, sync, ev("aten::mm", 50, 60, step)]
    kernels = [(100, 300), (300, 400), (500, 600), (640, 1000)]
    r = idle(events, kernels, sites={"aten::_local_scalar_dense": {"train.py:88"}})
    assert r.by_cause["host work outside torch"] == pytest.approx(0.1)  # 0 -> 100 us: no op running
    # 400 -> 500: waited, then launched; and the .item()'s 15 us of host time outside its wait
    # (300 -> 310, 405 -> 410), which the host would spend launching ahead without it
    assert r.by_cause["synchronizing calls"] == pytest.approx(0.1 + 0.015)
    assert r.by_cause["host launch overhead"] == pytest.approx(0.04 - 0.015)  # 600 -> 640, less that
    assert r.wall_ms == pytest.approx(1.0) and r.busy_ms == pytest.approx(0.76)
    assert r.idle_share == pytest.approx(0.24)
    [(op, calls, ms, sites)] = r.syncs
    assert (op, calls, sites) == ("aten::_local_scalar_dense", 1, ["train.py:88"]) and ms == pytest.approx(
        0.115
    )


def test_nothing_on_the_device_is_no_idle_breakdown():
    assert idle([ev("aten::add", 0, 10)], []) is None


def test_the_breakdown_scales_to_the_wall_time_without_the_profiler():
    step = ev("step", 0, 1000)
    # under the profiler: 900 us to the last kernel, 300 idle (100 before the first kernel, 200 between)
    r = idle([step], [(100, 300), (500, 900)])
    assert r.wall_ms == pytest.approx(0.9) and r.idle_ms == pytest.approx(0.3)
    plain = r.scaled_to(0.8)  # the same calls took 800 us unprofiled: 200 us idle, shared 1:2
    assert plain.busy_ms == pytest.approx(0.6) and plain.idle_ms == pytest.approx(0.2) and plain.scaled
    assert plain.scale == pytest.approx(2 / 3) and r.scale == 1.0  # its factor kept, for the record
    assert plain.by_cause["host work outside torch"] == pytest.approx(0.2 / 3 + 0.4 / 3)
    # both stretches (100 and 200 us) ran no torch op: host work
    assert r.scaled_to(0.5).idle_ms == 0  # faster than the busy time: no idle, never negative


def test_a_stretch_inside_a_named_host_range_is_charged_to_it():
    step = ev("step", 0, 2000)
    opt = ev("Optimizer.step#AdamW.step", 1000, 1900, step)
    loader = ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 200, step)
    ops = [ev("aten::add_", t, t + 40, opt) for t in range(1000, 1900, 50)]  # the host is launching
    kernels = [(500, 1000)] + [(t + 45, t + 50) for t in range(1000, 1900, 50)]
    r = idle([step, opt, loader, *ops], kernels)
    assert r.by_cause["the optimizer's host loop"] == pytest.approx(0.045 * 17 + 0.045, rel=0.05)
    assert r.by_cause["host launch overhead"] == 0
    # a stretch less than half inside a range is not the range's: 500 us with no op is host work
    assert r.by_cause["host work outside torch"] == pytest.approx(0.5)


def test_allocator_calls_and_pageable_copies_are_named():
    step = ev("step", 0, 1000)
    malloc = ev("cudaMalloc", 210, 390, step)
    copy = ev("aten::copy_", 500, 900, step)
    memcpy = ev("cudaMemcpyAsync", 505, 895, copy)
    kernels = [(0, 200), (400, 500), (900, 1000)]
    r = idle([step, malloc, copy, memcpy], kernels, pageable=[(880, 900)])
    assert r.by_cause["the caching allocator"] == pytest.approx(0.2)
    assert r.by_cause["pageable host-to-device copy"] == pytest.approx(0.4)


def test_a_long_stretch_inside_cudnn_attention_is_its_plan_being_built_and_a_short_one_is_launching():
    """SDPA's cuDNN backend builds a plan (a cuDNN graph) for each shape it has not seen: 40 ms
    of host time in the op, on the H200 for a KV cache grown a token at a time (run40). A few
    microseconds inside the same op between its kernels are its launches."""
    step = ev("step", 0, 50_000)
    sdpa = ev("aten::scaled_dot_product_attention", 1_000, 42_000, step)
    cudnn = ev("aten::_scaled_dot_product_cudnn_attention", 1_010, 41_990, sdpa)
    again = ev("aten::_scaled_dot_product_cudnn_attention", 44_000, 44_030, step)
    kernels = [(0, 1_000), (41_980, 42_100), (42_100, 44_010), (44_020, 50_000)]
    r = idle([step, sdpa, cudnn, again], kernels)
    assert r.by_cause["cuDNN building an attention plan"] == pytest.approx(40.98)
    assert r.by_cause["host launch overhead"] == pytest.approx(0.01)  # 44,010 -> 44,020: launching


def test_the_stretches_after_a_sync_while_the_host_is_behind_belong_to_the_sync():
    step = ev("step", 0, 2000)
    item = ev("aten::_local_scalar_dense", 90, 210, step)
    sync = ev("cudaStreamSynchronize", 95, 203, item)  # returns just after the device drained
    later = [ev("aten::mul", t, t + 30, step) for t in (210, 300, 400, 500, 520)]
    later.append(ev("aten::mul", 805, 890, step))  # the host launching, 800 -> 900
    # after the sync: three kernels each launched after the last ended (the host behind), then
    # two launched back to back while the device was busy (the host ahead again)
    kernels = [(0, 200), (250, 260), (340, 350), (440, 450), (560, 700), (700, 800), (900, 950)]
    launched = [0, 240, 330, 430, 510, 530, 850]
    r = idle([step, item, sync, *later], kernels, launched_at=launched)
    # and the .item()'s 12 us outside its wait (90 -> 95, 203 -> 210): every launch after it later
    assert r.by_cause["synchronizing calls"] == pytest.approx((50 + 80 + 90 + 110 + 12) / 1e3)
    assert r.by_cause["host launch overhead"] == pytest.approx(0.1 - 0.012)  # 800 -> 900: the host was ahead
    [(op, calls, ms, _)] = r.syncs
    assert op == "aten::_local_scalar_dense" and ms == pytest.approx(0.342)


def test_host_work_outside_torch_is_charged_to_the_sampled_line():
    from perfloop.analysis.stacks import Sample

    step = ev("step", 0, 3000)
    mm = ev("aten::mm", 0, 20, step)
    kernels = [(10, 500), (2500, 3000)]
    samples = [Sample(t, "train.py:42 (step)", frozenset({"numpy"})) for t in range(600, 2400, 100)]
    samples += [Sample(2450, "train.py:50 (step)", frozenset())]
    r = idle([step, mm], kernels, samples=samples)
    assert r.by_cause["host work outside torch"] == pytest.approx(2.0)
    assert r.places[0] == ("host work outside torch", "train.py:42 (step) (in NumPy)", pytest.approx(2.0))
    assert r.sampled


def test_a_stretch_spent_inside_torchs_own_calls_is_not_host_work_outside_torch():
    """The thread was in torch's own code the whole stretch (the autograd engine between backward
    ops on a CPU, where another process's time slice can land): torch's time, not the user's
    host work, though the samples' user line is the one that called `.backward()`."""
    from perfloop.analysis.stacks import Sample

    step = ev("step", 0, 3000)
    mm = ev("aten::mm", 0, 20, step)
    kernels = [(10, 500), (2500, 3000)]
    samples = [Sample(t, "train.py:47 (step)", frozenset({"torch"})) for t in range(600, 2400, 100)]
    r = idle([step, mm], kernels, samples=samples)
    assert r.by_cause["host work outside torch"] == 0.0
    assert r.by_cause["host launch overhead"] == pytest.approx(2.0)


def test_a_stretch_mostly_inside_the_dataloaders_iterator_is_data_loading():
    step = ev("step", 0, 2000)
    nxt = ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 150, 1800, step)
    kernels = [(0, 100), (1900, 2000)]  # the hole 100 -> 1900 spills past the iterator at both ends
    r = idle([step, nxt], kernels)
    assert r.by_cause["data loading"] == pytest.approx(1.8)


def test_a_short_wait_for_the_first_kernel_is_its_own_cause():
    step = ev("step", 0, 1000)
    launch = ev("aten::mm", 10, 60, step)  # the host dispatching the first op
    r = idle([step, launch], [(60, 1000)])
    assert r.by_cause["before the first kernel"] == pytest.approx(0.06)


def test_where_the_host_would_run_ahead_but_for_the_syncs_every_launch_gap_is_theirs():
    step = ev("step", 0, 1000)
    evs, kernels, launched = [step], [], []
    for t in range(0, 1000, 250):  # four layers: a long kernel, a sync, then three short ones
        item = ev("aten::_local_scalar_dense", t + 10, t + 205, step)
        evs += [
            item,
            ev("cudaStreamSynchronize", t + 12, t + 203, item),
            ev("aten::mm", t + 205, t + 215, step),
        ]
        kernels += [(t + 20, t + 200), (t + 210, t + 215), (t + 215, t + 220), (t + 240, t + 245)]
        launched += [t + 15, t + 205, t + 212, t + 235]  # the third launched ahead: a 20 us launch gap after
    r = idle(evs, kernels, launched_at=launched)
    # the host waits 764 us and works 236 of 1000, less than the device's 780 busy: no launch gap
    # would show without the syncs
    assert r.by_cause["host launch overhead"] == 0, r.by_cause
    assert r.by_cause["synchronizing calls"] == pytest.approx(0.04 * 4 - 0.01 + 0.02 * 4, abs=0.03)
    [(op, calls, ms, _)] = r.syncs
    assert (
        op == "aten::_local_scalar_dense"
        and calls == 4
        and ms == pytest.approx(r.by_cause["synchronizing calls"])
    )


def test_the_syncs_take_the_launch_gaps_judged_at_the_unprofiled_pace():
    """Under the profiler the host is slow enough to look launch-bound; at the calls' wall time
    without it, its own time is below the device's: the gaps are the syncs' after all."""
    step = ev("step", 0, 1000)
    item = ev("aten::_local_scalar_dense", 0, 205, step)
    evs = [step, item, ev("cudaStreamSynchronize", 5, 203, item)]
    evs += [ev("aten::mm", t, t + 40, step) for t in range(205, 1000, 100)]
    kernels, launched = [(10, 200)], [5]
    for t in range(205, 1000, 100):  # pairs, the second launched while the first runs: the host ahead
        kernels += [(t + 45, t + 60), (t + 60, t + 100)]
        launched += [t + 40, t + 50]
    r = idle(evs, kernels, launched_at=launched)
    assert r.by_cause["host launch overhead"] > 0  # profiled: the host's own 0.8 ms > the 0.63 ms busy
    fast = r.scaled_to(0.75)  # unprofiled: 0.75 ms, of which 0.198 waiting: 0.55 < 0.63 busy
    assert fast.by_cause["host launch overhead"] == 0
    assert fast.by_cause["synchronizing calls"] == pytest.approx(
        fast.idle_ms - fast.by_cause["before the first kernel"]
    )


def test_launches_from_a_thread_that_was_not_sampled_are_said():
    from perfloop.analysis.stacks import CLOCK_RANGE, unsampled_launcher

    def on(thread, name, t):
        return FunctionEvent(
            id=next(_ids), name=name, thread=thread, start_us=t, end_us=t + 1, device_type=DeviceType.CPU
        )

    clock = on(1, CLOCK_RANGE, 0)
    mine = [on(1, "cudaLaunchKernel", t) for t in range(10)]
    backward = [on(3, "autograd::engine::evaluate_function: MmBackward0", 50)] + [
        on(3, "cudaLaunchKernel", t) for t in range(50, 60)
    ]
    worker = [on(7, "cudaLaunchKernel", t) for t in range(100, 110)]
    assert unsampled_launcher([clock, *mine, *backward]) is None  # autograd's thread: the caller's backward
    why = unsampled_launcher([clock, *mine, *backward, *worker])
    assert why.startswith("thread 7 issued 10 of the 30 launches")


def test_the_saving_of_removing_the_syncs_is_the_timeline_replayed_without_their_waits():
    from perfloop.analysis.timeline import without

    # four layers: a 100 us kernel launched at +25, the host waiting in a sync from +40 until the
    # kernel ends, then 30 us of its own before the next launch
    kernels = [(t + 30, t + 130) for t in range(0, 520, 130)]
    launched = [t + 25 for t in range(0, 520, 130)]
    waits = [(t + 40, t + 131) for t in range(0, 520, 130)]
    # without the waits the launches come early and the kernels run back to back: 30 + 400 us
    assert without(kernels, launched, waits, host_end=520) == pytest.approx(90)
    assert without(kernels, launched, [], host_end=520) == 0


def test_host_work_before_a_copy_is_its_own_lines_not_the_copys_sync():
    """NumPy builds a table mid-step while the device drains, then a blocking copy moves it: the
    hole up to the copy is the host's NumPy work at its line; the sync has only what follows."""
    from perfloop.analysis.stacks import Sample

    step = ev("step", 0, 5000)
    copy = ev("aten::copy_", 4000, 4060, step)
    sync = ev("cudaStreamSynchronize", 4040, 4055, copy)
    kernels = [(0, 500), (4070, 4200)]  # the device drained at 500
    samples = [Sample(t, "model.py:31 (forward)", frozenset({"numpy"})) for t in range(600, 4000, 100)]
    samples.append(Sample(4050, "model.py:32 (forward)", frozenset({"torch"})))
    r = idle([step, copy, sync], kernels, samples=samples, launched_at=[0, 4060])
    assert r.by_cause["host work outside torch"] == pytest.approx(3.54)  # 500 -> 4040
    assert r.by_cause["synchronizing calls"] < 0.05  # 4040 -> 4070, and the copy's own 25 us
    assert r.places[0] == ("host work outside torch", "model.py:31 (forward) (in NumPy)", pytest.approx(3.54))


def test_a_boolean_mask_index_is_a_data_dependent_sync_and_takes_the_launch_gaps_its_ops_cost():
    """Each layer indexes with a boolean mask: aten::index runs nonzero, whose copy of the count
    waits for the device; the index's own host work (40 us a layer) keeps the host behind the
    emptied queue. Without it the host is ahead (its 40 us of launches against 80 us of
    kernels): the launch gaps are the sync's, charged to the line that indexed."""
    from perfloop.analysis.stacks import Sample

    step = ev("step", 0, 1200)
    evs, kernels, launched, samples = [step], [], [], []
    for t in range(0, 1200, 200):  # a layer: 80 us of kernels, then the index
        index = ev("aten::index", t + 20, t + 100, step)
        nz = ev("aten::nonzero", t + 25, t + 95, index)
        evs += [index, nz, ev("cudaStreamSynchronize", t + 30, t + 82, nz)]
        evs += [ev("aten::mm", a, a + 3, step) for a in (t + 102, t + 112, t + 157, t + 177)]
        # after it, one kernel queued behind another (the host ahead for a moment), then two
        # launched late: launch gaps by the rule of the emptied queue
        kernels += [
            (t + 2, t + 80),
            (t + 108, t + 138),
            (t + 138, t + 143),
            (t + 162, t + 167),
            (t + 182, t + 187),
        ]
        launched += [t, t + 105, t + 115, t + 160, t + 180]
        samples.append(Sample(t + 50, "model.py:12 (forward)", frozenset({"torch"})))
        samples += [Sample(t + a, "model.py:13 (forward)", frozenset({"torch"})) for a in (150, 170, 190)]
    r = idle(evs, kernels, samples=samples, launched_at=launched)
    assert r.data_dependent() == [("aten::nonzero", "aten::index")]
    assert r.sync_host_ms == pytest.approx(6 * 0.08)
    # before: 80 -> 108 a layer the sync's (it ends there); 143 -> 162, 167 -> 182 and 187 -> 202
    # (but after the last layer) launch gaps: the block before each had a queued kernel
    assert r.raw.by_cause["synchronizing calls"] == pytest.approx(6 * 0.028)
    assert r.raw.by_cause["host launch overhead"] == pytest.approx(6 * 0.034 + 5 * 0.015)
    # the index's host time outside its wait (28 us a layer) taken from the launch gaps
    assert r.by_cause["synchronizing calls"] == pytest.approx(6 * 0.056)
    assert r.by_cause["host launch overhead"] == pytest.approx(6 * 0.034 + 5 * 0.015 - 6 * 0.028)
    top = max((p for p in r.places if p[0] == "synchronizing calls"), key=lambda p: p[2])
    assert top[1] == "model.py:12 (forward)"  # the indexing line, not the line the host went on to


def test_the_stretch_between_two_compiled_graphs_and_the_emptied_queue_after_it_are_the_breaks():
    """A graph break's eager code runs between two compiled graphs (100 -> 300 on the host); the
    device drains meanwhile, and the host is behind the emptied queue for the next two kernels:
    all of it is the break's, named by the compiled region that resumes after it."""
    step = ev("step", 0, 1000)
    kernels = [(0, 100), (310, 320), (340, 350), (360, 900)]
    launched = [0, 305, 335, 352]  # each of the two after the break launched after the last ended
    r = idle([step], kernels, launched_at=launched, compiled=HostCompiled(between=((100, 300, "4/0"),)))
    assert r.by_cause["eager code between compiled graphs"] == pytest.approx(0.21 + 0.02 + 0.01)
    assert r.by_cause["host launch overhead"] == 0
    assert {p for c, p, _ in r.places if c == "eager code between compiled graphs"} == {"4/0"}


def test_a_graph_breaks_saving_is_the_sooner_end_without_every_stretch_of_eager_code_it_makes():
    """The break at line 33 splits a block in two: the eager code before its resume region
    (frame 2) and the eager code after it, up to the next block's graph (frame 1), both run only
    because of it. Its saving is how much sooner the step would end without both stretches (the
    launches after each that much earlier), not the idle before frame 2's region alone (run31:
    0.73 ms predicted against 3.19 ms realized by torch.where)."""
    from perfloop.analysis.capture import Capture, CompileFacts
    from perfloop.analysis.causes import graph_breaks
    from perfloop.analysis.compilation import CompiledCode, GraphBreak

    step = ev("step", 0, 1000)
    kernels = [(0, 100), (310, 390), (610, 1000)]
    launched = [0, 305, 605]
    between = [(100, 300, "2/0", "1/0"), (400, 600, "1/1", "2/0")]
    r = idle(
        [step],
        kernels,
        launched_at=launched,
        compiled=HostCompiled(between=tuple(between), breaks={"train.py:33": {"2"}}),
    )
    # without them: the second kernel launched at 105 (starts 110, ends 190), the third at 205
    # (starts 210, ends 600): the step ends at 600, not 1000
    assert r.break_saving_ms == {"train.py:33": pytest.approx(0.4)}
    b = GraphBreak("forward", "train.py:33", ("2",), "Data-dependent branching", "data-dependent branch", 1)
    c = Capture("cuda", 1, 1.0, idle=r, compiled=CompileFacts(CompiledCode([], [b], 2.0)))
    [f] = graph_breaks.find(c, {})
    assert f.kind == "graph break" and f.saves_ms == pytest.approx(0.4) and f.where == "train.py:33"


def test_cuda_graphs_saving_in_compiled_code_is_the_launch_gaps_inside_the_graph_calls():
    """CUDA graphs replay the compiled graphs' launches, not the eager loss and optimizer around
    them (run29: 4.48 ms predicted for mode='reduce-overhead', 2.25 realized). Here the host
    runs a compiled graph from 0 to 400 (two gaps between its kernels: 40 us) and then eager
    code (one gap: 60 us); the CUDA-graphs finding saves the 40."""
    from perfloop.analysis import timeline
    from perfloop.analysis.capture import Capture, CompileFacts
    from perfloop.analysis.compilation import CompiledCode
    from perfloop.analysis.ranking import rank

    step = ev("step", 0, 1000)
    kernels = [(10, 200), (220, 300), (320, 400), (460, 1000)]
    launched = [5, 215, 315, 455]  # each after the one before ended: the host behind
    r = idle([step], kernels, launched_at=launched, compiled=HostCompiled(graph_calls=((0, 400),)))
    assert r.by_cause[timeline.Cause.LAUNCH] == pytest.approx(0.1)
    assert r.launch_in_graphs_ms == pytest.approx(0.04)
    d = rank(Capture("cuda", 1, 1.0, idle=r, compiled=CompileFacts(CompiledCode([], [], 1.0))), {})
    [launch] = [f for f in d.findings if f.kind == "launch"]
    assert launch.saves_ms == pytest.approx(0.04) and "mode='reduce-overhead'" in launch.advice
    eager = rank(Capture("cuda", 1, 1.0, idle=r), {})
    [launch] = [f for f in eager.findings if f.kind == "launch"]
    assert launch.saves_ms == pytest.approx(0.1 + r.by_cause[timeline.Cause.FIRST])


def test_a_long_stretch_inside_a_compiled_graphs_call_is_its_launching_not_host_work():
    """Inductor's generated `call` is Python that runs no aten op: a small compiled model's
    graph call spends 150 us there between kernels. run32 called that "host work outside
    torch" at the generated file's line, and left it out of the CUDA-graphs saving (1.25 ms
    predicted, 2.23 realized), though a replayed graph skips it too."""
    from perfloop.analysis import timeline

    step = ev("step", 0, 1000)
    kernels = [(10, 100), (250, 300), (700, 1000)]
    launched = [5, 245, 695]
    r = idle([step], kernels, launched_at=launched, compiled=HostCompiled(graph_calls=((0, 400),)))
    assert r.by_cause[timeline.Cause.OUTSIDE] == pytest.approx(0.4)  # 300 -> 700: after the graph's call
    assert r.by_cause[timeline.Cause.LAUNCH] == pytest.approx(0.15)  # 100 -> 250: inside it
    assert r.launch_in_graphs_ms == pytest.approx(0.15)


def test_a_break_whose_sync_is_the_steps_only_one_saves_all_the_idle_the_host_outruns():
    """Without the break's sync the host, whose own time is less than the device's, runs ahead
    across steps: every idle stretch closes, as for a removed sync (run32: the .item() break's
    1.64 ms predicted against 3.75 realized, the step device-bound once fixed)."""
    step = ev("step", 0, 1000)
    item = ev("aten::_local_scalar_dense", 28, 402, step)
    sync = ev("cudaStreamSynchronize", 30, 400, item)  # waits for the first kernel
    kernels = [(10, 400), (430, 600), (610, 1000)]
    launched = [5, 425, 605]
    between = [(20, 420, "2/0", "1/0")]  # the eager code the break at train.py:36 makes, its sync inside
    r = idle(
        [step, item, sync],
        kernels,
        launched_at=launched,
        compiled=HostCompiled(between=tuple(between), breaks={"train.py:36": {"2"}}),
    )
    # timeline.without alone: the later launches 400 us sooner, the device still busy to 960
    assert r.break_saving_ms == {"train.py:36": pytest.approx(r.idle_ms)} and r.idle_ms == pytest.approx(0.05)
    other = ev("cudaDeviceSynchronize", 602, 609, step)  # a second sync, not the break's: the host cannot
    r = idle(
        [step, item, sync, other],
        kernels,
        launched_at=launched,
        compiled=HostCompiled(between=tuple(between), breaks={"train.py:36": {"2"}}),
    )
    assert r.break_saving_ms == {"train.py:36": pytest.approx(0.04)}


def test_a_breaks_sync_that_waits_little_still_holds_the_host_back_and_saves_the_steps_idle():
    """Profiled, the host is slow enough that the .item() finds the device drained and waits
    6 us; the host's profiled time then looked like the step's floor, and the saving was the
    eager code's stretch alone (run33: 1.73 ms predicted, 3.68 realized: fixed, the step ran
    at the device's pace). A break holding every sync of the step saves all the idle a host
    running ahead hides: after the break, between launches, before the first kernel."""
    step = ev("step", 0, 1000)
    item = ev("aten::_local_scalar_dense", 300, 310, step)
    sync = ev("cudaStreamSynchronize", 302, 308, item)
    kernels = [(10, 100), (430, 500), (520, 600), (620, 1000)]
    launched = [5, 425, 515, 615]
    between = [(120, 420, "2/0", "1/0")]
    r = idle(
        [step, item, sync],
        kernels,
        launched_at=launched,
        compiled=HostCompiled(between=tuple(between), breaks={"t.py:36": {"2"}}),
    )
    assert r.idle_ms == pytest.approx(0.38)
    # the launches 300 us sooner alone would end the step at 695: 0.305 ms
    assert r.break_saving_ms == {"t.py:36": pytest.approx(r.idle_ms)}


def test_the_windows_own_drains_before_the_first_launch_and_after_the_last_are_no_sync_of_the_step():
    """perfloop synchronizes as its window closes (and a profiler may as it starts): a bare
    cudaDeviceSynchronize there is not the user's. run32 told a compiled .item() step to remove
    "a CPU sync (cudaDeviceSynchronize)" its script never called."""
    step = ev("step", 0, 1000)
    item = ev("aten::_local_scalar_dense", 28, 402, step)
    sync = ev("cudaStreamSynchronize", 30, 400, item)
    ours = [ev("cudaDeviceSynchronize", 0, 3, step), ev("cudaDeviceSynchronize", 700, 1000, step)]
    kernels = [(10, 400), (430, 600), (610, 1000)]
    launched = [5, 425, 605]
    between = [(20, 420, "2/0", "1/0")]
    r = idle(
        [step, item, sync, *ours],
        kernels,
        launched_at=launched,
        compiled=HostCompiled(between=tuple(between), breaks={"t.py:36": {"2"}}),
    )
    assert not r.syncs  # the idle is the break's (and the wait for the first kernel)
    assert r.waited_ms == pytest.approx(0.37)  # the .item()'s wait alone
    assert r.break_saving_ms == {"t.py:36": pytest.approx(r.idle_ms)}
