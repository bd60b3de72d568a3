"""pl.patch reaches the functional calls a model makes inside its own forward (issue 23): a
GPT-2 written as popular training code writes it (examples/nanogpt_model.py) gets its
F.layer_norm and F.cross_entropy calls fused, each verified at its call site."""

import copy
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import layer_norm

import perfloop as pl
from perfloop.nn.reroute import Rerouted

pytest.importorskip("triton")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _gpt(nanogpt, bias=True):
    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=32, bias=bias)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    y[0, :3] = -1  # ignored, as the model's ignore_index=-1 says
    return nanogpt.GPT(cfg), (x, y)


def _loss(m, b):
    return m(*b)[1]


@pytest.mark.parametrize("bias", [True, False])
def test_the_functional_norms_and_loss_of_a_gpt_are_verified_and_fused_at_their_call_sites(
    nanogpt, bias, monkeypatch
):
    model, batch = _gpt(nanogpt, bias)
    ref = copy.deepcopy(model)
    report = pl.patch(model, batch, loss_fn=_loss)
    sites = {s.name.split(" (")[0] for s in report.swaps if s.replaced}
    assert sites == {
        "transformer.h.0.ln_1: F.layer_norm",
        "transformer.h.0.ln_2: F.layer_norm",
        "transformer.ln_f: F.layer_norm",
        "GPT: F.cross_entropy",
        "transformer.h.0.mlp.gelu",
    }  # nn.GELU(), the exact form
    assert "nanogpt_model.py:" in str(report)
    from perfloop.ops.cross_entropy import triton_impl as ce
    from perfloop.ops.layernorm import triton_impl as ln

    used = []
    monkeypatch.setattr(ce.CrossEntropyFunction, "apply", _spy(ce.CrossEntropyFunction.apply, "ce", used))
    monkeypatch.setattr(ln.NormFunction, "apply", _spy(ln.NormFunction.apply, "norm", used))
    got, want = _loss(model, batch), _loss(ref, batch)
    assert used.count("norm") == 3 and used.count("ce") == 1  # the fused kernels ran
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.backward()
    want.backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_a_patched_gpt_evaluated_the_way_nanogpt_does_runs_the_kernels_without_autograd(nanogpt, monkeypatch):
    """nanoGPT's estimate_loss: @torch.no_grad() around model.eval() and the forward. The fused
    call sites run their forward alone there (no autograd Function) and give the loss torch's
    code gives."""
    model, batch = _gpt(nanogpt)
    ref = copy.deepcopy(model)
    pl.patch(model, batch, loss_fn=_loss)
    from perfloop.ops.cross_entropy import triton_impl as ce
    from perfloop.ops.layernorm import triton_impl as ln

    def refused(*a):
        raise AssertionError("an autograd Function ran under no_grad")

    used = []
    monkeypatch.setattr(ce.CrossEntropyFunction, "apply", refused)
    monkeypatch.setattr(ln.NormFunction, "apply", refused)
    monkeypatch.setattr(ln, "forward_parts", _spy(ln.forward_parts, "norm", used))
    monkeypatch.setattr(ce, "forward_parts", _spy(ce.forward_parts, "ce", used))

    @torch.no_grad()
    def estimate_loss(m):
        m.eval()
        out = _loss(m, batch)
        m.train()
        return out

    got, want = estimate_loss(model), estimate_loss(ref)
    assert used.count("norm") == 3 and used.count("ce") == 1 and got.grad_fn is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _spy(fn, label, used):
    def call(*a, **k):
        used.append(label)
        return fn(*a, **k)

    return call


def test_a_patched_model_deepcopies_pickles_and_keeps_its_state_dict(nanogpt):
    model, batch = _gpt(nanogpt)
    keys = list(model.state_dict())
    pl.patch(model, batch, loss_fn=_loss)
    assert list(model.state_dict()) == keys
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        fwd = other.transformer.ln_f.__dict__["forward"]
        assert isinstance(fwd, Rerouted) and fwd.owner is other.transformer.ln_f
        torch.testing.assert_close(_loss(other, batch), _loss(model, batch))


class Smoothed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y, label_smoothing=0.1)


class BareNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.rand(16) + 0.5), nn.Parameter(torch.randn(16))

    def forward(self, x):
        return layer_norm(x, (16,), self.w, self.b).square().mean()


def test_a_call_site_without_a_kernel_is_refused_with_the_reason_and_its_module_left_as_it_was():
    torch.manual_seed(0)
    model = Smoothed()
    report = pl.patch(model, (torch.randn(8, 16), torch.randint(0, 10, (8,))))
    assert report.replaced == [] and "label smoothing" in next(iter(report.refused.values()))
    assert "forward" not in model.__dict__


def test_a_function_imported_bare_is_reached_too():
    torch.manual_seed(0)
    model = BareNorm()
    report = pl.patch(model, (torch.randn(8, 16),))
    assert [s.site[1] for s in report.swaps if s.replaced] == ["layer_norm"]
    assert isinstance(model.__dict__["forward"], Rerouted)


def test_a_patched_model_compiles_to_torchs_own_code(nanogpt):
    model, batch = _gpt(nanogpt)
    want = _loss(copy.deepcopy(model), batch)
    pl.patch(model, batch, loss_fn=_loss)
    compiled = torch.compile(model)
    torch.testing.assert_close(_loss(compiled, batch), want, atol=1e-5, rtol=1e-5)


def test_a_llama_style_model_gets_its_norm_classes_its_swiglu_and_its_loss_call_fused(monkeypatch, llama):
    torch.manual_seed(0)
    args = llama.ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=128, multiple_of=16, max_seq_len=16)
    model = llama.Transformer(args)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g))

    def loss_fn(m, b):
        m(*b)
        return m.last_loss

    ref = copy.deepcopy(model)
    report = pl.patch(model, batch, loss_fn=loss_fn)
    kinds = [s.kind for s in report.swaps if s.replaced]
    assert kinds.count("RMSNorm") == 2 * 2 + 1 and kinds.count("F.cross_entropy") == 1, str(report)
    assert kinds.count("F.silu(a) * b") == 2, str(report)  # SwiGLU, written out in FeedForward.forward
    line = next(
        i
        for i, t in enumerate((EXAMPLES / "llama_model.py").read_text().splitlines(), 1)
        if "return self.w2(F.silu(self.w1(x)) * self.w3(x))" in t
    )
    assert f"layers.0.feed_forward: F.silu(a) * b (llama_model.py:{line})" in report.replaced
    from perfloop.ops.swiglu import triton_impl as sw

    used = []
    monkeypatch.setattr(sw.GatedFunction, "apply", _spy(sw.GatedFunction.apply, "gate", used))
    got, want = loss_fn(model, batch), loss_fn(ref, batch)
    assert used == ["gate", "gate"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.backward()
    want.backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_a_patched_call_site_refuses_what_torch_refuses_with_torchs_error(nanogpt):
    model, (x, y) = _gpt(nanogpt)
    ref = copy.deepcopy(model)
    pl.patch(model, (x, y), loss_fn=_loss)
    bad = y.clone()
    bad[1, 4] = 128 + 3  # a class the vocabulary has not
    for m in (ref, model):
        with pytest.raises(IndexError, match="Target 131 is out of bounds"):
            _loss(m, (x, bad))
    with pytest.raises(RuntimeError, match="expected target dtype to be Long"):
        _loss(model, (x, y.int()))


@pytest.mark.parametrize("width, shape", [(16, (8,)), (8, (16,))])
def test_the_fused_norm_refuses_a_normalized_shape_torch_refuses(width, shape):
    from perfloop.nn import functional as pf

    x, w, b = torch.randn(4, width), torch.rand(16) + 0.5, torch.randn(16)
    for fn in (F.layer_norm, pf.layer_norm):
        with pytest.raises(RuntimeError):
            fn(x, shape, w, b)
    with pytest.raises(RuntimeError):
        pf.rms_norm(x, shape, w)


SCALE = 1.0


class ScaledNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return F.layer_norm(x, (16,), self.weight) * SCALE


def test_a_rerouted_forward_reads_its_modules_globals_live(monkeypatch):
    """A global the model's module changes after pl.patch (a flag, a scale) is seen by the
    patched forward, as by the original."""
    torch.manual_seed(0)
    model, x = ScaledNorm(), torch.randn(4, 16)
    report = pl.patch(model, (x,))
    assert len(report.replaced) == 1
    before = model(x).detach()
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    torch.testing.assert_close(model(x).detach(), 2 * before)
