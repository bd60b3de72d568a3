"""perfloop.nn's drop-ins: torch's constructors and state-dict keys, torch's numbers forward
and backward, torch's own forward (said once) where no kernel fits."""

import pytest
import torch
import torch.nn as nn

import perfloop.nn as pnn

pytest.importorskip("triton")


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.LayerNorm(96, eps=1e-6),
        lambda m: m.LayerNorm(96, bias=False),
        lambda m: m.RMSNorm(96, eps=1e-6),
    ],
    ids=["layernorm", "layernorm-no-bias", "rmsnorm"],
)
def test_norms_match_torch_forward_and_backward_and_share_checkpoints(make):
    torch.manual_seed(0)
    ours, theirs = make(pnn), make(nn)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.3 * torch.randn(96))
        if getattr(theirs, "bias", None) is not None:
            theirs.bias.copy_(0.2 * torch.randn(96))
    ours.load_state_dict(theirs.state_dict())  # the same keys both ways
    assert set(ours.state_dict()) == set(theirs.state_dict())
    x = (3 * torch.randn(4, 33, 96) + 2).requires_grad_()
    dy = torch.randn(4, 33, 96)
    ya, yb = ours(x), theirs(x)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    ga = torch.autograd.grad(ya, [x, ours.weight], dy)
    gb = torch.autograd.grad(yb, [x, theirs.weight], dy)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_loss_matches_torch_with_ignored_targets():
    torch.manual_seed(0)
    logits = (4 * torch.randn(37, 301)).requires_grad_()
    target = torch.randint(0, 301, (37,))
    target[::5] = -100
    la, lb = pnn.CrossEntropyLoss()(logits, target), nn.CrossEntropyLoss()(logits, target)
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=1e-6)
    ga, gb = (torch.autograd.grad(loss * 3.0, logits)[0] for loss in (la, lb))  # upstream gradient 3
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    assert ga[::5].abs().max() == 0  # ignored rows get no gradient


def test_where_no_kernel_fits_torchs_forward_runs_and_says_why_once(monkeypatch):
    from perfloop.nn import modules

    monkeypatch.setattr(modules, "interpreting", lambda: False)  # a CPU without the interpreter
    modules._WARNED.clear()
    ln = pnn.LayerNorm(8)
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="cpu tensor.*running torch's own forward"):
        y = ln(x)
    torch.testing.assert_close(y, nn.functional.layer_norm(x, (8,), ln.weight, ln.bias))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ln(x)  # said once
    loss = pnn.CrossEntropyLoss(label_smoothing=0.1)
    monkeypatch.setattr(modules, "interpreting", lambda: True)
    with pytest.warns(RuntimeWarning, match="label smoothing"):
        got = loss(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    assert got.ndim == 0


@pytest.mark.parametrize(
    "ours, act",
    [(pnn.SwiGLU, nn.functional.silu), (pnn.GeGLU, lambda a: nn.functional.gelu(a, approximate="tanh"))],
    ids=["swiglu", "geglu"],
)
def test_gated_activations_match_torch_forward_and_backward(ours, act):
    torch.manual_seed(0)
    a, b = (3 * torch.randn(5, 129)).requires_grad_(), torch.randn(5, 129).requires_grad_()
    dy = torch.randn(5, 129)
    ya, yb = ours()(a, b), act(a) * b
    torch.testing.assert_close(ya, yb)
    for g1, g2 in zip(torch.autograd.grad(ya, [a, b], dy), torch.autograd.grad(yb, [a, b], dy), strict=True):
        torch.testing.assert_close(g1, g2)


def test_linear_cross_entropy_matches_a_linear_head_and_its_loss_and_loads_its_weights():
    torch.manual_seed(0)
    head = nn.Linear(24, 301, bias=False)
    ours = pnn.LinearCrossEntropy(24, 301)
    ours.load_state_dict(head.state_dict())  # the head's checkpoint, key "weight"
    h = torch.randn(3, 13, 24, requires_grad=True)
    t = torch.randint(0, 301, (3, 13))
    t[0, :4] = -100
    la = ours(h, t)
    lb = nn.functional.cross_entropy(head(h).flatten(0, 1), t.flatten())
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=1e-5)
    ga = torch.autograd.grad(la, [h, ours.weight])
    gb = torch.autograd.grad(lb, [h, head.weight])
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_linear_cross_entropy_in_chunks_is_the_same_as_in_one():
    from perfloop.ops.linear_cross_entropy.triton_impl import linear_cross_entropy

    torch.manual_seed(1)
    h, w = torch.randn(37, 16, requires_grad=True), torch.randn(500, 16, requires_grad=True)
    t = torch.randint(0, 500, (37,))
    whole = linear_cross_entropy(h, w, t, chunk=37)
    grads_whole = torch.autograd.grad(whole, [h, w])
    parts = linear_cross_entropy(h, w, t, chunk=5)  # 8 chunks, the last of 2 rows
    grads_parts = torch.autograd.grad(parts, [h, w])
    torch.testing.assert_close(whole, parts)
    for a, b in zip(grads_whole, grads_parts, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="weight: need shape"):
        linear_cross_entropy(h, torch.randn(500, 15), t)
    # the gradients, made in the forward, are scaled by the upstream gradient and handed out once
    twice = linear_cross_entropy(h, w, t, chunk=5) * 3.0
    for a, b in zip(torch.autograd.grad(twice, [h, w], retain_graph=True), grads_whole, strict=True):
        torch.testing.assert_close(a, 3.0 * b)
    with pytest.raises(RuntimeError, match="second backward through one forward"):
        torch.autograd.grad(twice, [h, w])


@pytest.mark.parametrize("form", ["tanh", "none"])
def test_gelu_is_torchs_gelu_in_either_form_forward_and_backward(form):
    torch.manual_seed(0)
    x = (3 * torch.randn(7, 131)).requires_grad_()
    dy = torch.randn(7, 131)
    ours, theirs = pnn.GELU(form), nn.GELU(form)
    ya, yb = ours(x), theirs(x)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    ga, gb = torch.autograd.grad(ya, x, dy)[0], torch.autograd.grad(yb, x, dy)[0]
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    other = "none" if form == "tanh" else "tanh"  # the forms differ by more than the tolerance
    assert (ya - nn.GELU(other)(x)).abs().max() > 1e-4
    assert pnn.fused_like(nn.GELU(form)).approximate == form
    from perfloop.nn.modules import why_not

    assert why_not(nn.GELU(form)) is None


def test_the_fused_cross_entropy_on_float64_logits_falls_back_to_torch_exactly():
    import perfloop.nn as pnn
    from perfloop.nn import functional as plf

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(13, 37, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 37, (13,), generator=g)
    want = torch.nn.functional.cross_entropy(logits, target)
    for got in (pnn.CrossEntropyLoss()(logits, target), plf.cross_entropy(logits, target)):
        assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.autograd.gradcheck(lambda x: plf.cross_entropy(x, target), (logits,))
    assert torch.autograd.gradcheck(lambda x: pnn.CrossEntropyLoss()(x, target), (logits,))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "neighbours"])
def test_rope_matches_the_written_out_form_and_falls_back_to_it_saying_so(interleaved, monkeypatch):
    """pnn.RoPE against the fp32 written-out form model code uses; where no kernel fits, that
    form itself, said once."""
    from perfloop.ops.rope import angles
    from perfloop.ops.rope.torch_impl import fp32

    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.to(torch.bfloat16) for t in angles(11, 16))
    dy = torch.randn_like(x)
    rope = pnn.RoPE(interleaved)
    if pnn.modules.kernel_here(x):
        pytest.skip("no kernel here: run under TRITON_INTERPRET=1")
    got = rope(x, cos, sin)
    want = fp32(x, cos, sin, interleaved)
    torch.testing.assert_close(got, want, atol=8e-3, rtol=1.6e-2)
    (g1,), (g2,) = torch.autograd.grad(got, [x], dy), torch.autograd.grad(want, [x], dy)
    torch.testing.assert_close(g1, g2, atol=1.6e-2, rtol=3e-2)
    monkeypatch.setattr(pnn.modules, "kernel_here", lambda t: "a cpu tensor (test)")
    monkeypatch.setattr(pnn.modules, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="perfloop.nn.RoPE: a cpu tensor"):
        fell = rope(x, cos, sin)
    torch.testing.assert_close(fell, want)
    with pytest.raises(ValueError, match=r"cos: needs \(T, D/2\)"):
        rope(x, *angles(12, 16))
    with pytest.raises(ValueError, match="interleaved: "):
        pnn.RoPE("neighbours")
