"""Idle time by cause, on timelines built event by event (the profiler's own event type)."""

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from perfloop.analysis.timeline import gaps, idle

_ids = iter(range(1, 10**6))


def ev(name, start, end, parent=None):
    e = FunctionEvent(id=next(_ids), name=name, thread=1, start_us=start, end_us=end,
                      device_type=DeviceType.CPU)  # fmt: skip
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
    assert r.by_cause["before the first kernel"] == pytest.approx(0.1)  # 0 -> 100 us
    assert r.by_cause["synchronizing calls"] == pytest.approx(0.1)  # 400 -> 500: waited, then launched
    assert r.by_cause["host launch overhead"] == pytest.approx(0.04)  # 600 -> 640
    assert r.wall_ms == pytest.approx(1.0) and r.busy_ms == pytest.approx(0.76)
    assert r.idle_share == pytest.approx(0.24)
    [(op, calls, ms, sites)] = r.syncs
    assert (op, calls, sites) == ("aten::_local_scalar_dense", 1, ["train.py:88"]) and ms == pytest.approx(
        0.1
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
    assert plain.by_cause["before the first kernel"] == pytest.approx(0.2 / 3)
    assert plain.by_cause["host launch overhead"] == pytest.approx(0.4 / 3)
    assert r.scaled_to(0.5).idle_ms == 0  # faster than the busy time: no idle, never negative
