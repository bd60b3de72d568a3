"""pl.patch reaches functional calls where models hide them (issue 37): a forward wrapped by a
decorator (functools.wraps), calls inside a comprehension; and says why where it cannot (a
class-based decorator). The fused GELU keeps its input's memory order, as torch's does."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl

pytest.importorskip("triton")


def logged(fn):  # the shape of a timing / tracing / autocast decorator in training code
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        wrapper.calls += 1
        return fn(self, *args, **kwargs)

    wrapper.calls = 0
    return wrapper


class Counted:  # a class-based decorator: what it wraps is an attribute, not a closure cell
    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __get__(self, obj, objtype=None):
        return functools.partial(self.__call__, obj)

    def __call__(self, obj, *args, **kwargs):
        return self.fn(obj, *args, **kwargs)


class Decorated(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))
        self.proj = nn.Linear(d, d)

    @logged
    def forward(self, x):
        return self.proj(F.layer_norm(x, x.shape[-1:], self.w, self.b))


class Heads(nn.Module):
    def __init__(self, d=48, n=3):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(d)) for _ in range(n)])
        self.bs = nn.ParameterList([nn.Parameter(torch.randn(d)) for _ in range(n)])

    def forward(self, x):
        outs = [F.layer_norm(x, x.shape[-1:], w, b) for w, b in zip(self.ws, self.bs, strict=True)]
        return torch.stack(outs).sum(0)


class ClassDecorated(Decorated):
    @Counted
    def forward(self, x):
        return self.proj(F.layer_norm(x, x.shape[-1:], self.w, self.b))


def _used(monkeypatch):
    from perfloop.ops.layernorm import triton_impl as ln

    used = []
    real = ln.NormFunction.apply
    monkeypatch.setattr(ln.NormFunction, "apply", lambda *a: used.append(1) or real(*a))
    return used


@pytest.mark.parametrize("cls, calls", [(Decorated, 1), (Heads, 3)])
def test_calls_in_a_decorated_forward_or_a_comprehension_are_reached_verified_and_fused(
    monkeypatch, cls, calls
):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(5, 7, 48)
    ref = copy.deepcopy(model)
    report = pl.patch(model, (x,))
    assert len(report.replaced) == 1 and "F.layer_norm" in report.replaced[0], str(report)
    used = _used(monkeypatch)
    got, want = model(x), ref(x)
    assert len(used) == calls  # every call in the comprehension, the decorated forward's one
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if cls is Decorated:  # the decorator still runs around the rerouted code
        before = type(model).forward.calls
        model(x)
        assert type(model).forward.calls == before + 1


def test_a_class_based_decorator_is_said_not_silently_skipped():
    report = pl.patch(ClassDecorated(), (torch.randn(5, 7, 48),))
    assert report.replaced == [] and len(report.swaps) == 1
    assert "decorator" in str(report) and "cannot rebuild it" in str(report)


def test_the_fused_gelu_keeps_a_transposed_inputs_memory_order():
    from perfloop.nn import functional as plf

    x = torch.randn(37, 64).t()  # (64, 37), strides (1, 64)
    got, want = plf.gelu(x), F.gelu(x)
    assert got.stride() == want.stride() == (1, 64)
    torch.testing.assert_close(got, want)
    x3 = torch.randn(3, 5, 8).permute(2, 0, 1).requires_grad_()
    got = plf.gelu(x3, approximate="tanh")
    assert got.stride() == F.gelu(x3, approximate="tanh").stride()
    got.sum().backward()
    torch.testing.assert_close(x3.grad, torch.autograd.grad(F.gelu(x3, approximate="tanh").sum(), x3)[0])
