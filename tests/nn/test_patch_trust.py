"""After pl.patch the user's model is the model they had but for the swapped submodules (issue 22):
keyword calls, gradients, buffers, hooks, sharing; a failing call swaps nothing; the fused
modules refuse what torch refuses and agree with it on edge values."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl
import perfloop.nn as pnn

pytest.importorskip("triton")


class KwNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(input=self.fc(x)).square().mean()


def test_a_module_called_with_keywords_is_checked_and_replaced():
    torch.manual_seed(0)
    model = KwNorm()
    report = pl.patch(model, (torch.randn(4, 16),))
    assert report.replaced == ["ln"] and isinstance(model.ln, pnn.LayerNorm)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU("tanh"), nn.Linear(32, 4))


def test_gradients_already_taken_are_kept_on_every_parameter():
    model = _net()
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    report = pl.patch(model, (x,))
    assert "1" in report.replaced
    assert all(p.grad is not None and torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    model(x).square().mean().backward()  # accumulation goes on from the kept gradients
    assert all(not torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop, self.ln = (
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Dropout(0.5),
            nn.LayerNorm(16),
        )

    def forward(self, x):
        return self.ln(self.drop(self.bn(self.fc(x)))).square().mean()


@pytest.mark.parametrize("measure", [False, True])
def test_buffers_training_mode_random_state_and_gradients_are_as_they_were(measure):
    torch.manual_seed(0)
    model = BNNet()
    model.fc.eval()  # a mixed mode, kept as it is
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 16)
    rng = torch.get_rng_state()
    report = pl.patch(model, (x,), measure=measure, budget_s=0.3)
    assert isinstance(model.ln, pnn.LayerNorm) or report.timing is not None
    assert int(model.bn.num_batches_tracked) == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert model.training and not model.fc.training and model.bn.training
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_hooks_on_a_swapped_module_fire_and_their_handles_still_remove_them():
    model = _net()
    calls = []
    handle = model[1].register_forward_hook(lambda m, a, out: calls.append(out.shape))
    pre = model[1].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model[1].tag = "mine"
    report = pl.patch(model, (torch.randn(8, 16),))
    assert "1" in report.replaced and isinstance(model[1], pnn.LayerNorm) and model[1].tag == "mine"
    calls.clear()
    model(torch.randn(8, 16))
    assert calls == ["pre", torch.Size([8, 32])]
    handle.remove()
    pre.remove()
    calls.clear()
    model(torch.randn(8, 16))
    assert calls == []


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln_a = nn.LayerNorm(16)
        self.ln_b = self.ln_a

    def forward(self, x):
        return self.ln_b(self.fc(self.ln_a(x))).square().mean()


def test_a_shared_module_stays_shared_under_every_name_and_the_report_names_them():
    torch.manual_seed(0)
    model = Shared()
    report = pl.patch(model, (torch.randn(4, 16),))
    assert model.ln_a is model.ln_b and isinstance(model.ln_a, pnn.LayerNorm)
    assert "also ln_b" in str(report)


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        y = self.ln(self.fc(x))
        return y.square().mean(), y


def test_measure_on_a_tuple_without_loss_fn_times_the_step_on_its_first_element():
    torch.manual_seed(0)
    report = pl.patch(TupleOut(), (torch.randn(4, 16),), measure=True, budget_s=0.3)
    assert report.timing is not None and not report.skipped


def test_a_failure_inside_patch_puts_every_swapped_module_back(monkeypatch):
    import sys

    patch_mod = sys.modules["perfloop.nn.patch"]

    model = _net()

    def boom(*a, **k):
        raise RuntimeError("timing failed")

    monkeypatch.setattr(patch_mod, "_keep_what_pays", boom)
    with pytest.raises(RuntimeError, match="timing failed"):
        pl.patch(model, (torch.randn(8, 16),), measure=True)
    assert type(model[1]) is nn.LayerNorm and type(model[2]) is nn.GELU


@pytest.mark.parametrize("bad", [10 + 5, -1])
def test_the_fused_loss_refuses_targets_torch_refuses_with_torchs_error(bad):
    logits = torch.randn(4, 10)
    target = torch.tensor([1, 2, bad, 3])
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        F.cross_entropy(logits, target)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        pnn.CrossEntropyLoss()(logits, target)
    with pytest.raises(RuntimeError, match="expected target dtype to be Long"):
        pnn.CrossEntropyLoss()(logits, torch.tensor([1, 2, 3, 4], dtype=torch.int32))


def test_the_fused_loss_agrees_with_torch_when_every_target_is_ignored():
    logits = torch.randn(4, 10, requires_grad=True)
    target = torch.full((4,), -100)
    got = pnn.CrossEntropyLoss()(logits, target)
    want = F.cross_entropy(logits, target)
    assert torch.isnan(got) and torch.isnan(want)
    got.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_fused_gelu_takes_a_scalar_and_a_model_its_kernels_cannot_take_is_not_said_replaced():
    x = torch.tensor(0.7)
    torch.testing.assert_close(pnn.GELU("tanh")(x), nn.GELU("tanh")(x))
    model = _net().double()
    report = pl.patch(model, (torch.randn(8, 16, dtype=torch.float64),))
    assert report.replaced == []
    assert "no fused kernel takes this call (dtype torch.float64)" in report.refused["2"]
    assert type(model[2]) is nn.GELU


@pytest.mark.gpu
def test_on_the_gpu_an_out_of_range_target_stops_with_a_device_assert_as_torchs_loss_does():
    import subprocess
    import sys

    # without a gradient (the forward alone) and with one (the C++ autograd Function)
    code = (
        "import torch, perfloop.nn as pnn; x = torch.randn(64, 1000, device='cuda'){grad}; "
        "t = torch.randint(0, 1000, (64,), device='cuda'); t[5] = {bad}; "
        "pnn.CrossEntropyLoss()(x, t).item()"
    )
    for bad in (1005, -1):
        for grad in ("", ".requires_grad_()"):
            run = [sys.executable, "-c", code.format(bad=bad, grad=grad)]
            r = subprocess.run(run, capture_output=True, text=True)
            assert r.returncode != 0 and "device-side assert" in r.stderr, r.stderr[-2000:]


@pytest.mark.gpu
def test_on_the_gpu_the_fused_loss_gives_nan_with_every_target_ignored_and_patch_keeps_grads():
    logits = torch.randn(64, 1000, device="cuda", requires_grad=True)
    target = torch.full((64,), -100, device="cuda")
    loss = pnn.CrossEntropyLoss()(logits, target)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, target))
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    model = _net().cuda()
    x = torch.randn(8, 16, device="cuda")
    model(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    report = pl.patch(model, (x,))
    assert set(report.replaced) == {"1", "2"}
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


# issue 52's fault probe: each of these was an internal error (AttributeError, RuntimeError from
# deep inside, or "'int' object is not callable") before patch checked its arguments
def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU())


def test_a_torchscript_model_is_refused_with_what_to_patch_instead():
    with pytest.raises(TypeError, match=r"model: a TorchScript module .* patch the nn.Module before"):
        pl.patch(torch.jit.script(_model()), (torch.randn(4, 8),))


def test_an_empty_batch_is_refused_naming_the_tensor_and_its_shape():
    with pytest.raises(ValueError, match=r"example_batch: tensor 0 has no elements \(shape \(0, 8\)\)"):
        pl.patch(_model(), (torch.randn(0, 8),))


def test_a_model_on_the_meta_device_is_refused_with_how_to_materialize_it():
    with torch.device("meta"):
        m = _model()
    with pytest.raises(ValueError, match=r"model: .*meta device.*to_empty"):
        pl.patch(m, (torch.randn(4, 8, device="meta"),))


def test_a_loss_fn_that_is_not_callable_is_named():
    with pytest.raises(TypeError, match=r"loss_fn: expected a callable \(model, batch\) -> loss, got int"):
        pl.patch(_model(), (torch.randn(4, 8),), loss_fn=3)
