"""torch.compile can keep the fused kernels of a patched model (issue 23): with the cross entropy
in compiled.in_graph it is one node of the compiled graph (a torch.library custom op, no graph
break), forward and backward equal to the unpatched model's; what in_graph leaves out (as
shipped: all but the fused head) runs torch's code."""

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl

pytest.importorskip("triton")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from perfloop.nn import compiled as pc

    torch._dynamo.reset()
    with pc.in_graph({"cross_entropy", "linear_cross_entropy"}):  # as a user may choose
        yield
    torch._dynamo.reset()


@pytest.fixture
def graph_ops():
    """graph_ops(names): the fused functions a compiled graph takes, for the rest of the test."""
    from perfloop.nn import compiled as pc

    with contextlib.ExitStack() as stack:
        yield lambda names: stack.enter_context(pc.in_graph(names))


def _gpt(nanogpt):
    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=32, bias=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    y[0, :3] = -1
    return nanogpt.GPT(cfg), (x, y)


def _step(model, batch):
    loss = model(*batch)[1]
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


def _graph_targets(model, batch, backend="eager"):
    """(the call_function targets of every graph torch.compile made of the step, the step)."""
    graphs = []

    def capture(gm, inputs):
        if backend == "eager":  # dynamo's graph
            graphs.append(gm)
            return gm.forward
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def keep(g, _inputs):  # AOT autograd's forward and backward graphs
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, inputs)

    compiled = torch.compile(model, backend=capture, fullgraph=True)  # fullgraph: a break fails here
    out = _step(compiled, batch)
    return [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"], out


@pytest.mark.parametrize("backend", ["eager", "aot"])
def test_the_fused_loss_is_one_node_of_the_compiled_graph_and_equal(nanogpt, backend):
    model, batch = _gpt(nanogpt)
    want_loss, want_grads = _step(copy.deepcopy(model), batch)
    report = pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1])
    assert "GPT: F.cross_entropy" in " ".join(report.replaced)
    targets, (loss, grads) = _graph_targets(model, batch, backend)
    ops = {str(t) for t in targets}
    assert "perfloop.cross_entropy.default" in ops
    if backend == "aot":  # autograd traced through the op's rule: the backward is perfloop's op too
        assert "perfloop.cross_entropy_backward.default" in ops
    assert not any("perfloop.norm" in o for o in ops)  # the norms: torch's, for Inductor to fuse
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_norms_go_into_the_graph_when_in_graph_names_them(nanogpt, graph_ops):
    graph_ops({"cross_entropy", "linear_cross_entropy", "layer_norm"})
    model, batch = _gpt(nanogpt)
    want_loss, want_grads = _step(copy.deepcopy(model), batch)
    pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1])
    targets, (loss, grads) = _graph_targets(model, batch, "aot")
    ops = [str(t) for t in targets]
    assert ops.count("perfloop.norm.default") == 3  # ln_1, ln_2, ln_f
    assert ops.count("perfloop.norm_backward.default") == 3
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], atol=1e-4, rtol=1e-4, msg=n)


def test_a_line_left_unverified_keeps_torchs_function_under_compile():
    """A forward calling F.layer_norm on two lines, one refused: under compile (no per-line
    routing) neither goes to the fused op."""

    class TwoNorms(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16))

        def forward(self, x):
            a = F.layer_norm(x, (16,), self.w)
            b = F.layer_norm(x.double(), (16,), self.w.double())  # float64: no kernel takes it
            return a.sum() + b.sum().float()

    from perfloop.nn import compiled as pc

    m = TwoNorms()
    x = torch.randn(4, 16)
    report = pl.patch(m, (x,))
    assert len(report.replaced) == 1 and len(report.refused) == 1
    with pc.in_graph({"cross_entropy", "linear_cross_entropy", "layer_norm"}):
        graphs = []
        compiled = torch.compile(m, backend=lambda gm, i: graphs.append(gm) or gm.forward, fullgraph=True)
        torch.testing.assert_close(compiled(x), m(x))
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("perfloop" in o for o in ops)


def test_the_loss_module_goes_into_the_graph_too():
    """perfloop.nn.CrossEntropyLoss (what pl.patch swaps in for nn.CrossEntropyLoss) under compile."""
    x = torch.randn(6, 40, requires_grad=True)
    t = torch.randint(0, 40, (6,))
    graphs = []
    loss_fn = pl.nn.CrossEntropyLoss(ignore_index=3)
    compiled = torch.compile(loss_fn, backend=lambda gm, i: graphs.append(gm) or gm.forward, fullgraph=True)
    got = compiled(x, t)
    got.backward()
    gx = x.grad.clone()
    x.grad = None
    want = torch.nn.functional.cross_entropy(x, t, ignore_index=3)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, x.grad)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "perfloop.cross_entropy.default" in ops


def test_as_shipped_a_patched_model_compiles_to_the_graph_of_its_own_code(nanogpt, graph_ops):
    from perfloop.nn import compiled as pc

    graph_ops(pc.DEFAULT_IN_GRAPH)
    model, batch = _gpt(nanogpt)
    plain_targets, _ = _graph_targets(copy.deepcopy(model), batch)
    torch._dynamo.reset()
    pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1])
    targets, _ = _graph_targets(model, batch)
    assert [str(t) for t in targets] == [str(t) for t in plain_targets]


class _Head(nn.Module):
    """A model's last block and its loss the way one writes it with perfloop's head."""

    def __init__(self):
        super().__init__()
        from perfloop.nn import LinearCrossEntropy

        self.ln, self.head = nn.LayerNorm(32), LinearCrossEntropy(32, 301)

    def forward(self, h, targets):
        return None, self.head(self.ln(h), targets)  # no logits: the head never makes them


def test_as_shipped_the_fused_head_is_one_node_of_a_compiled_graph_and_equal(graph_ops):
    """LinearCrossEntropy exists to keep the logits out of memory (a GPT-2 loss in 0.29 GiB where
    compile's takes 1.63): under torch.compile it was F.linear and F.cross_entropy again."""
    from perfloop.nn import compiled as pc

    graph_ops(pc.DEFAULT_IN_GRAPH)  # as shipped
    torch.manual_seed(0)
    model, h = _Head(), torch.randn(2, 16, 32)
    t = torch.randint(0, 301, (2, 16))
    t[0, :3] = -100
    want_loss, want_grads = _step(copy.deepcopy(model), (h, t))
    targets, (loss, grads) = _graph_targets(model, (h, t), "aot")
    ops = {str(x) for x in targets}
    assert "perfloop.linear_cross_entropy.default" in ops and "aten.mm.default" not in ops, ops
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4)
