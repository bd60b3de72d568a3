"""On a CPU another process's time slices land inside whichever op was running (the suite under
load saw one step's backward time at 744 ms against ~20): a CPU profile times each op at its
fastest over the calls, and its wall at the fastest call."""

import time

import torch

import perfloop as pl
from perfloop.analysis.attribution import Item, fastest_of_calls

_SEEN = [0]


@torch.library.custom_op("perfloop_test::every_other_call_stalls", mutates_args=())
def stalls(x: torch.Tensor) -> torch.Tensor:
    _SEEN[0] += 1
    if _SEEN[0] % 2:
        time.sleep(0.08)  # what a preempted op looks like from inside the process
    return x.clone()


def test_an_op_stalled_in_one_call_is_timed_at_its_fast_call():
    x = torch.randn(256, 256)

    def step():
        return stalls(torch.relu(x @ x)).sum()

    p = pl.profile(step, calls=2, warmup=1)
    rows = {r.name: r for r in p.breakdown(by="op")}
    [stalled] = [r for n, r in rows.items() if "every_other_call_stalls" in n]
    assert stalled.device_ms / 2 < 20, rows  # per call: the fast call's, not (80 + fast) / 2
    d = p.diagnose(ceilings={"copy_gbps": 20.0})
    assert d.wall_ms < 40 and d.device_ms < 40, str(d)


def _item(op, ms, at):
    return Item(kernel=op, op=op, module="m", phase="forward", ms=ms, start_us=at, end_us=at + ms * 1e3,
                launch_us=at)  # fmt: skip


def test_calls_that_ran_different_ops_keep_their_own_times():
    same = [_item("mm", 5.0, 10), _item("relu", 1.0, 20), _item("mm", 50.0, 110), _item("relu", 1.5, 120)]
    assert [i.ms for i in fastest_of_calls(same, [(0, 100), (100, 200)])] == [5.0, 1.0, 5.0, 1.0]
    other = [_item("mm", 5.0, 10), _item("relu", 1.0, 20), _item("mm", 50.0, 110), _item("gelu", 1.5, 120)]
    assert fastest_of_calls(other, [(0, 100), (100, 200)]) == other
