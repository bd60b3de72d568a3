"""The pinned-memory candidate (issue 53's "pinned memory + non_blocking copies"): which copies it
changes, how, and the DataLoaders it pins; proposed for a pageable-copy finding on CUDA only."""

import pytest
import torch
import torch.utils.data

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates import get
from perfloop.workflows.tune.candidates.pinned import pinning, to_cuda
from perfloop.workflows.tune.tuner import Options, propose


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("cuda",), {}, True),
        ((torch.device("cuda", 0), torch.float16), {}, True),
        ((), {"device": "cuda:1", "dtype": torch.float16}, True),
        ((torch.float16,), {}, False),  # a cast, no copy to the GPU
        (("cpu",), {}, False),
        (("cuda",), {"non_blocking": True}, False),  # the caller said
        (("cuda", torch.float32, False), {}, False),  # the old positional non_blocking: left as written
        ((), {"memory_format": torch.channels_last}, False),
        ((torch.ones(1),), {}, False),  # like a CPU tensor
    ],
)
def test_which_calls_copy_to_cuda_with_non_blocking_left_to_the_default(args, kwargs, expected):
    assert to_cuda(args, kwargs) is expected


def test_a_cpu_tensor_bound_for_cuda_is_pinned_and_copied_without_waiting_and_the_rest_pass_on():
    calls, pinned = [], []

    def to(t, *args, **kwargs):
        calls.append((t, args, kwargs))
        return t

    def cuda(t, device=None, non_blocking=False, **kwargs):
        calls.append((t, (device,), {"non_blocking": non_blocking}))
        return t

    def pin(t):
        pinned.append(t.clone())
        return pinned[-1]

    pinned_to, pinned_cuda = pinning(to, cuda, pin)
    x = torch.randn(4, 3)
    pinned_to(x, "cuda", dtype=torch.float16)
    assert calls[-1][0] is pinned[-1] and calls[-1][2] == {"dtype": torch.float16, "non_blocking": True}
    assert torch.equal(pinned[-1], x)
    pinned_to(x, torch.float64)
    assert calls[-1] == (x, (torch.float64,), {}) and len(pinned) == 1
    pinned_cuda(x)
    assert calls[-1][0] is pinned[-1] and calls[-1][2] == {"non_blocking": True} and len(pinned) == 2
    pinned_cuda(x, non_blocking=True)
    assert calls[-1][0] is x and len(pinned) == 2


def test_applied_dataloaders_pin_unless_the_script_said_and_tensor_methods_are_wrapped():
    saved = torch.Tensor.to, torch.Tensor.cuda, torch.utils.data.DataLoader.__init__
    try:
        get("pinned-memory").apply(None)
        data = torch.utils.data.TensorDataset(torch.randn(8, 2))
        assert torch.utils.data.DataLoader(data, batch_size=4).pin_memory  # pinned where a GPU is
        assert not torch.utils.data.DataLoader(data, batch_size=4, pin_memory=False).pin_memory
        x = torch.randn(3)
        assert torch.equal(x.to(torch.float64), x.double()) and torch.Tensor.to is not saved[0]
    finally:
        torch.Tensor.to, torch.Tensor.cuda, torch.utils.data.DataLoader.__init__ = saved


def test_proposed_for_pageable_copies_on_cuda_only():
    found = [{"kind": Kind.PAGEABLE_COPY.value, "share": 0.2}]
    assert "pinned-memory" in [k for k, _, _ in propose(found, True, Options("x.py"))]
    assert "pinned-memory" not in [k for k, _, _ in propose(found, False, Options("x.py"))]
    assert "pinned-memory" not in [k for k, _, _ in propose([], True, Options("x.py"))]
