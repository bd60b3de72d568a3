"""The per-call host path of the fused modules (issue 25, item 4): between the module's call and
its kernels, nothing but allocations and views -- no torch op that launches work of its own."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import perfloop.nn as pnn
from perfloop.ops.base import interpreting
from perfloop.ops.cross_entropy import triton_impl as ce
from perfloop.ops.layernorm import triton_impl as ln

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (the CI sets it)")

# ops that allocate or only describe memory: they launch nothing on a GPU
NO_WORK = {
    "empty.memory_format",
    "empty_like.default",
    "new_empty.default",
    "view.default",
    "_unsafe_view.default",
    "detach.default",
    "alias.default",
    "select.int",
}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(f"{func.__name__}")
        return func(*args, **(kwargs or {}))


def _work_ops(monkeypatch, module_of_kernels, run):
    """The torch ops of one forward + backward that launch work, the kernels left out (counted)."""
    launches = []
    monkeypatch.setattr(module_of_kernels, "launch", lambda kernel, grid, *a, **k: launches.append(kernel))
    run()  # the module's checks, once per key, happen here
    launches.clear()
    with Ops() as ops:
        run()
    return [n for n in ops.names if n not in NO_WORK], launches


@pytest.mark.parametrize("cls", [pnn.RMSNorm, pnn.LayerNorm])
@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 64)])
def test_a_fused_norm_call_is_its_launches_and_allocations(monkeypatch, cls, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).requires_grad_()
    dy = torch.randn(shape, generator=g)
    m = cls(64)

    def run():
        torch.autograd.grad(m(x), [x, *m.parameters()], dy)

    work, launches = _work_ops(monkeypatch, ln, run)
    assert work == []
    assert launches == [ln.norm_fwd_kernel, ln.norm_bwd_kernel, ln.colsum_kernel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_loss_call_takes_its_mean_and_cast_in_a_kernel(monkeypatch, dtype):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 40, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (5,), generator=g)
    loss = pnn.CrossEntropyLoss()
    one = torch.ones((), dtype=dtype)  # the upstream gradient, made here (else autograd makes it)

    def run():
        torch.autograd.grad(loss(logits, target), [logits], one)

    # the CPU's bounds check of the targets (torch ops, on the CPU only) left out: on a GPU the
    # kernel checks them
    ok = torch.ones((), dtype=torch.int32)
    monkeypatch.setattr(ce, "check_targets", lambda target, v, ignore: ok)
    work, launches = _work_ops(monkeypatch, ce, run)
    # before: ne, sum, sum, div and a cast forward, the cast's backward (torch ops each)
    assert work == []
    assert launches == [ce.ce_fwd_kernel, ce.ce_mean_kernel, ce.ce_bwd_kernel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignored", [0, 2, 5])
def test_the_loss_is_torchs_in_the_logits_dtype_with_rows_ignored(dtype, ignored):
    g = torch.Generator().manual_seed(3 + ignored)
    logits = (3 * torch.randn(5, 40, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (5,), generator=g)
    target[:ignored] = -100
    ours = pnn.CrossEntropyLoss()(logits, target)
    want = torch.nn.CrossEntropyLoss()(logits.float(), target)
    assert ours.dtype == dtype
    if ignored == 5:  # no row counted: nan, as torch
        assert torch.isnan(ours) and torch.isnan(want)
        return
    torch.testing.assert_close(ours.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    (g_ours,) = torch.autograd.grad(ours, [logits])
    (g_want,) = torch.autograd.grad(torch.nn.CrossEntropyLoss()(logits.float(), target), [logits])
    assert g_ours.dtype == dtype
    torch.testing.assert_close(
        g_ours.float(), g_want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=2e-2
    )


def _cases():
    from perfloop.ops.attention import triton_impl as at
    from perfloop.ops.swiglu import triton_impl as sw

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g)
    b = torch.randn(6, 64, generator=g)
    target = torch.randint(0, 64, (6,), generator=g)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    rms, norm, loss, swiglu = pnn.RMSNorm(64), pnn.LayerNorm(64), pnn.CrossEntropyLoss(), pnn.SwiGLU()
    return [
        ("RMSNorm", ln.NormFunction, lambda: rms(x), [x]),
        ("LayerNorm", ln.NormFunction, lambda: norm(x), [x]),
        ("CrossEntropyLoss", ce.CrossEntropyFunction, lambda: loss(x, target), [x]),
        ("SwiGLU", sw.GatedFunction, lambda: swiglu(x, b), [x, b]),
        ("flash_attention", at.FlashAttention, lambda: at.flash_attention(q, k, v, True)[0], [q, k, v]),
    ]


@pytest.mark.parametrize("i", range(5), ids=[c[0] for c in _cases()])
def test_without_a_gradient_to_take_a_fused_op_runs_its_forward_alone(monkeypatch, i):
    """Under no_grad (an eval loop, generation) no autograd Function runs: its host cost bought
    nothing there. The values are the same kernels' either way."""
    name, function, call, inputs = _cases()[i]
    for t in inputs:
        t.requires_grad_()
    with_grad = call()
    assert with_grad.grad_fn is not None  # the Function where a gradient is wanted
    monkeypatch.setattr(function, "apply", lambda *a: pytest.fail(f"{name}: the Function ran under no_grad"))
    with torch.no_grad():
        alone = call()
    assert alone.grad_fn is None and torch.equal(alone, with_grad.detach())
    monkeypatch.undo()
    for t in inputs:
        t.requires_grad_(False)
    # grad mode on, no input wanting one (a norm's weight still does): the same values
    assert torch.equal(call().detach(), alone)
