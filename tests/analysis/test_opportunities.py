"""Planted bottlenecks: small models with one known problem each; the ranked diagnosis must put
that problem first, with the right bound."""

import pytest
import torch
import torch.nn as nn

import perfloop as pl
from perfloop.analysis.opportunities import StepDiagnosis


class SoftmaxBySixOps(nn.Module):
    def forward(self, x):
        m = x.amax(dim=-1, keepdim=True)
        e = (x - m).exp()
        return e / e.sum(dim=-1, keepdim=True) * 1.0 + 0.0


class LayerNormByHand(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + 1e-5) * self.weight + self.bias


class ThousandTinyKernels(nn.Module):
    def forward(self, x):
        for _ in range(1000):
            x = x * 1.0001
        return x


def _planted(body: nn.Module, rows: int, d: int, dev: str = "cpu", linear: bool = False):
    """A step whose time is the planted module's (a Linear before it only where asked: on a
    2-core CPU a large one would outweigh anything planted after it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(d, d) if linear else nn.Identity(), body).to(dev)
    x = torch.randn(rows, d, device=dev, requires_grad=True)

    def step():
        net(x).sum().backward()

    return step


@pytest.mark.parametrize("body, rows, d, module, bound", [
    (SoftmaxBySixOps(), 2048, 1024, "1", "memory"),
    (LayerNormByHand(1024), 2048, 1024, "1", "memory"),
    (ThousandTinyKernels(), 4, 8, "1", "launch"),
], ids=["softmax-in-six-ops", "unfused-layernorm", "thousand-tiny-kernels"])  # fmt: skip
def test_the_planted_problem_ranks_first(body, rows, d, module, bound):
    d_ = pl.profile(_planted(body, rows, d), calls=2).diagnose()
    assert isinstance(d_, StepDiagnosis)
    top = d_.opportunities[0]
    assert f"in {module} (" in top.title, str(d_)
    assert top.bound == bound, str(d_)
    assert top.saves_ms > 0 and 0 < top.share <= 1


def test_a_call_that_ran_work_is_never_unclear():
    d = pl.profile(lambda x: x @ x, torch.randn(256, 256)).diagnose()
    assert isinstance(d, StepDiagnosis) and d.bound != "unclear"
    assert d.opportunities or d.at_ceiling, str(d)  # something to gain, or the ceiling it runs at


@pytest.mark.gpu
def test_on_the_gpu_an_fp32_matmul_with_tf32_off_is_a_precision_problem():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        d = pl.profile(_planted(nn.GELU(), 4096, 4096, "cuda", linear=True), calls=3).diagnose()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    top = d.opportunities[0]
    assert top.bound == "precision" and "TF32" in top.title, str(d)


@pytest.mark.gpu
def test_on_the_gpu_an_item_in_the_step_is_found_with_its_line():
    # kernels long enough that, without the .item(), the host would run ahead of the device
    lin = nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        y = x
        for _ in range(20):
            y = lin(y).relu()
            if y.sum().item() < 0:  # a host round trip every layer
                break
        return y

    d = pl.profile(step, calls=3).diagnose()
    top = d.opportunities[0]
    assert top.bound == "host" and "test_opportunities.py:" in top.evidence, str(d)
