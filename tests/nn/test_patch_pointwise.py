"""Issue 40: GELU written out inline in a forward (nanoGPT's early `new_gelu`, an erf form),
found in Dynamo's capture by what it computes and replaced by the fused GELU, checked like every
swap; a tanh that is not a GELU is left alone. The kernels run under TRITON_INTERPRET=1."""

import math

import torch
import torch.nn as nn

import perfloop as pl
from perfloop.nn import rewrite


def new_gelu(x):
    """
    Implementation of the GELU activation function currently in Google BERT repo (identical to OpenAI GPT).
    Reference: Gaussian Error Linear Units (GELU) paper: https://arxiv.org/abs/1606.08415
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    """nanoGPT's MLP before nn.GELU: the activation a function of the model's file."""

    def __init__(self, n_embd=32):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = self.c_fc(x)
        x = new_gelu(x)
        x = self.c_proj(x)
        return x


class ErfMLP(MLP):
    def forward(self, x):
        h = self.c_fc(x)
        return self.c_proj(h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))))


class TanhMLP(MLP):
    def forward(self, x):
        return self.c_proj(torch.tanh(self.c_fc(x)) * 2.0)


class AlmostGELU(MLP):
    """The tanh form's constants, another curve (no 0.5 * x in front)."""

    def forward(self, x):
        h = self.c_fc(x)
        return self.c_proj(torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def _ops(fn) -> set:
    fn()  # the first call captures
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def _replaced(model: nn.Module, kind: str):
    """The model's one swap, after checking it was made, of this kind, and left its output as it was."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    want = model(x)
    report = pl.patch(model, (x,), loss_fn=lambda m, b: m(*b).square().mean())
    [swap] = report.swaps
    assert swap.replaced and swap.kind == kind, str(report)
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    return swap, x


def test_gelu_written_inline_in_either_form_is_replaced_by_the_fused_gelu():
    for cls, form in ((MLP, "tanh"), (ErfMLP, "none")):
        torch.manual_seed(0)
        model = cls()
        swap, x = _replaced(model, rewrite.GELU)
        assert swap.via == f"GELU ({form} form) -> perfloop's fused GELU"
        ops = _ops(lambda m=model, x=x: m(x))
        assert "aten::tanh" not in ops and "aten::erf" not in ops, ops


def test_plan_says_patch_reaches_an_inline_gelu():
    from perfloop.nn.plan import plan

    assert "pl.patch rewrites it to the fused GELU" in plan(MLP())["MLP"]["gelu"]
    assert "pl.patch rewrites it to the fused norm" in plan(Block())["Block"]["normalization"]


def test_a_tanh_that_is_not_gelu_is_left_alone_with_the_reason():
    """A plain tanh is no candidate (nothing captured, nothing said); one with the tanh form's
    constants is captured, probed, and left alone with the reason."""
    from perfloop.nn.plan import plan

    plain = TanhMLP()
    assert pl.patch(plain, (torch.randn(2, 3, 32),), loss_fn=lambda m, b: m(*b).sum()).swaps == []
    assert not plan(plain) and "forward" not in vars(plain)
    model = AlmostGELU()
    report = pl.patch(model, (torch.randn(2, 3, 32),), loss_fn=lambda m, b: m(*b).sum())
    [swap] = report.swaps
    assert not swap.replaced and "holds none of the written forms" in swap.reason, str(report)
    assert "forward" not in vars(model)


class Block(nn.Module):
    """A block that writes its RMSNorm inline (as some compact training code does) and a
    LayerNorm by hand, each with its weight."""

    def __init__(self, d=32, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.attn_norm_weight = nn.Parameter(torch.rand(d) + 0.5)
        self.ln_weight, self.ln_bias = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.attn_norm_weight
        h = x + self.proj(h)
        mean = h.mean(-1, keepdim=True)
        var = ((h - mean) ** 2).mean(-1, keepdim=True)
        return (h - mean) / torch.sqrt(var + 1e-5) * self.ln_weight + self.ln_bias


def test_norms_written_inline_are_replaced_by_the_fused_norms():
    torch.manual_seed(0)
    model = Block()
    swap, x = _replaced(model, rewrite.NORM)
    rms = "RMS norm (eps 1e-06) with its weight -> perfloop's fused RMSNorm"
    layer = "layer norm (eps 1e-05) with its weight and bias -> perfloop's fused LayerNorm"
    assert swap.via == f"{rms}; {layer}", swap.via
    ops = _ops(lambda: model(x))
    assert "aten::rsqrt" not in ops and "aten::sqrt" not in ops, ops
