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
    # 80 at the sampler's pace; with both cores busy a run read 26 (the sampler gets less CPU):
    # a tenth of the pace is the floor a sampler that runs at all keeps
    assert len(s.samples) >= 0.1 * busy_s / 1e-3, len(s.samples)
    places = {p.place for p in s.samples}
    assert any(p.startswith("test_stacks.py:") for p in places), places  # the busy function's own lines


def test_the_interpreters_switch_interval_is_given_back():
    before = sys.getswitchinterval()
    with Sampler(interval_s=2e-3):
        assert sys.getswitchinterval() < before
    assert sys.getswitchinterval() == before


def test_a_thread_inside_torchs_own_call_is_tagged_torch_at_the_line_that_called_it():
    """Inside `.backward()` (the engine in C, under torch's Python) the samples say "torch" and
    still name the caller's line; the Python of a collate-like loop is not torch's."""
    x = torch.randn(64, requires_grad=True)
    y = x
    for _ in range(2000):
        y = y * 1.0001
    loss = y.sum()
    until = time.perf_counter() + 0.08
    with Sampler(interval_s=1e-3) as inside:
        while time.perf_counter() < until:
            loss.backward(retain_graph=True)  # the line the samples should name
    with Sampler(interval_s=1e-3) as outside:
        _collate_like(torch.arange(2000), time.perf_counter() + 0.08)
    tagged = [s for s in inside.samples if "torch" in s.tags]
    assert len(tagged) > 0.8 * len(inside.samples) > 0, [(s.place, s.tags) for s in inside.samples]
    assert all(s.place.startswith("test_stacks.py:") and "(test_a_thread_inside" in s.place for s in tagged)
    assert sum("torch" in s.tags for s in outside.samples) < 0.2 * len(outside.samples)


def test_a_frame_in_inductors_generated_code_is_charged_to_the_users_line_that_called_it():
    """Issue 54: the "where" of a compiled decode's host time named Inductor's generated file by
    its hash. A frame of a file in Inductor's cache folder is tagged "compiled"; the place is the
    user's line that called into it."""
    import os

    from perfloop.analysis.stacks import generated_code_dir

    generated = os.path.join(generated_code_dir(), "cy", "cyoadqv4example.py")
    code = compile("def call(read):\n    return read(sys._getframe())\n", generated, "exec")
    scope = {"sys": sys}
    exec(code, scope)
    s = Sampler()
    sample = scope["call"](s._read)  # the line the place should name
    assert sample.place.startswith("test_stacks.py:") and "(test_a_frame_in_inductors" in sample.place
    assert "compiled" in sample.tags
