"""The stack sampler: a thread busy in Python and in torch's C calls is sampled at about the
sampler's pace, each sample at the user's own line."""

import sys
import time

import torch

from perfloop.analysis.stacks import Sampler


def _collate_like(x: torch.Tensor, until: float) -> int:
    rounds = 0
    while time.perf_counter() < until:  # Python over every element, then a torch call: a slow collate
        torch.tensor([float(v) ** 0.5 for v in x.tolist()])
        rounds += 1
    return rounds


def test_a_thread_busy_in_python_and_torch_is_sampled_at_the_samplers_pace():
    x = torch.arange(2000)
    busy_s = 0.08
    with Sampler(interval_s=1e-3) as s:
        _collate_like(x, time.perf_counter() + busy_s)
    # with the interpreter's switch interval at the sampler's own, 1-2 samples in 80 ms here
    assert len(s.samples) >= 0.4 * busy_s / 1e-3, len(s.samples)
    places = {p.place for p in s.samples}
    assert any(p.startswith("test_stacks.py:") for p in places), places  # the busy function's own lines


def test_the_interpreters_switch_interval_is_given_back():
    before = sys.getswitchinterval()
    with Sampler(interval_s=2e-3):
        assert sys.getswitchinterval() < before
    assert sys.getswitchinterval() == before
