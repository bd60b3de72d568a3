"""pl.patch fuses an activation times a gate written out in a model's forward (`F.silu(a) * b`,
`b * F.gelu(a)`) into one kernel each way (issue 23): verified at its source line, its operands
evaluated in the order written, refused with the reason where the kernel cannot take it."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import silu

import perfloop as pl

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class GeGLU(nn.Module):
    """A GeGLU MLP with the gate on the left and the tanh GELU on the right."""

    def __init__(self, d=16, h=24):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        self.order = []
        self.gate.register_forward_hook(lambda *_: self.order.append("gate"))
        self.up.register_forward_hook(lambda *_: self.order.append("up"))

    def forward(self, x):
        return self.down(self.up(x) * F.gelu(self.gate(x), approximate="tanh"))


class BareSwiGLU(nn.Module):
    def __init__(self, d=16, h=24):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)

    def forward(self, x):
        h = silu(self.w1(x)) * self.w3(x)  # silu imported bare
        return h.sum(-1)


class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return F.silu(self.w(x)) * self.scale  # b broadcast over the rows


def _grads(model, x):
    model(x).float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_gate_on_the_right_is_fused_its_operands_run_in_the_order_written(monkeypatch):
    torch.manual_seed(0)
    model, x = GeGLU(), torch.randn(3, 5, 16)
    ref = copy.deepcopy(model)
    report = pl.patch(model, (x,))
    assert [s.kind for s in report.swaps if s.replaced] == ["F.gelu(a) * b"], str(report)
    from perfloop.ops.swiglu import triton_impl as sw

    acts = []
    real = sw.GatedFunction.apply
    monkeypatch.setattr(sw.GatedFunction, "apply", lambda a, b, act: acts.append(act) or real(a, b, act))
    model.order.clear()
    got = model(x)
    assert acts == [sw.GELU_TANH]  # the gated operand is the GELU's, in its form
    assert model.order == ["up", "gate"]  # as written: self.up(x) first
    torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=1e-5)
    want_g, got_g = _grads(ref, x), _grads(model, x)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4, msg=n)


def test_a_bare_silu_gate_is_fused():
    torch.manual_seed(0)
    model, x = BareSwiGLU(), torch.randn(4, 16)
    ref = copy.deepcopy(model)
    report = pl.patch(model, (x,))
    assert [s.kind for s in report.swaps if s.replaced] == ["F.silu(a) * b"], str(report)
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_a_broadcast_gate_is_refused_with_the_reason_and_left_as_written():
    torch.manual_seed(0)
    model, x = Broadcast(), torch.randn(4, 16)
    want = model(x).detach()
    report = pl.patch(model, (x,))
    assert report.replaced == []
    (why,) = report.refused.values()
    assert "broadcast" in why
    assert "forward" not in model.__dict__  # nothing rerouted
    torch.testing.assert_close(model(x).detach(), want)


def test_a_patched_gate_model_pickles_and_copies():
    import pickle

    torch.manual_seed(0)
    model, x = GeGLU(), torch.randn(2, 16)
    model.order = None  # hooks' lambdas do not pickle; the list goes with them
    model.gate._forward_hooks.clear()
    model.up._forward_hooks.clear()
    pl.patch(model, (x,))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(clone(x), model(x))


class KeepsItsLoss(nn.Module):
    """Stores the loss on itself in forward, as llama2.c's Transformer does (`self.last_loss`)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 10)
        self.last_loss = None

    def forward(self, x, y):
        self.last_loss = F.cross_entropy(self.w(x), y)
        return self.last_loss


def test_measure_copes_with_a_model_that_keeps_a_tensor_of_its_last_graph():
    torch.manual_seed(0)
    model, x, y = KeepsItsLoss(), torch.randn(8, 16), torch.randint(0, 10, (8,))
    model(x, y)  # the user ran a step first: last_loss is a tensor with a graph
    report = pl.patch(model, (x, y), measure=True, budget_s=0.2)
    assert report.timing is not None
    assert model.last_loss is not None and model.last_loss.grad_fn is not None  # the user's, untouched
