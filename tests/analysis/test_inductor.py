"""Inductor's kernels as rows (issue 39, item 4): each compiled kernel and extern call placed in
the module and line it came from, its fused ops named, its work counted with the code compiled."""

import inspect

import pytest
import torch
import torch.nn as nn

import perfloop as pl
from perfloop.analysis import inductor
from perfloop.analysis.attribution import COMPILED_OP
from perfloop.analysis.work import WorkCounter


class MLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.proj(torch.nn.functional.gelu(self.fc(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLP() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _line(cls, text: str) -> tuple[int, str]:
    lines, first = inspect.getsourcelines(cls.forward)
    n = next(i for i, x in enumerate(lines) if text in x)
    return first + n, lines[n].rstrip("\n")


def _frame(cls, text: str, call: str) -> str:
    """A traceback frame as Dynamo writes a node's stack trace, its caret under `call`."""
    line, code = _line(cls, text)
    col = code.index(call)
    return f'  File "{__file__}", line {line}, in forward\n{code}\n{" " * col}{"^" * len(call)}\n'


def test_a_kernels_name_says_the_aten_ops_it_fused():
    assert inductor.fused_ops("triton_poi_fused_add_native_layer_norm_2") == ("add", "native_layer_norm")
    assert inductor.fused_ops(
        "triton_red_fused__log_softmax__log_softmax_backward_data_nll_loss_forward_0"
    ) == (
        "_log_softmax",
        "_log_softmax_backward_data",
        "nll_loss_forward",
    )
    assert inductor.fused_ops("cpp_fused_gelu_gelu_backward_sum_1") == ("gelu", "gelu_backward", "sum")
    assert inductor.kernel_name("graph_0_cpp_fused_gelu_1") == "cpp_fused_gelu_1"
    assert inductor.kernel_name("aten::mm") is None and inductor.fused_ops("aten::mm") == ()


def test_a_stack_trace_is_read_down_the_module_tree_to_the_submodule_its_line_calls():
    tree = inductor.ModuleTree(Net(), "Net")
    loop = _frame(Net, "x = block(x)", "block(x)")
    fc = inductor.Launch("extern:addmm", (loop + _frame(MLP, "self.proj(", "self.fc(h)"),))
    gelu = inductor.Launch(
        "cpp_fused_gelu_1", (loop + _frame(MLP, "self.proj(", "torch.nn.functional.gelu(self.fc(h))"),)
    )
    ln_and_add = inductor.Launch(
        "cpp_fused_add_native_layer_norm_2",
        (
            loop + _frame(MLP, "h = self.ln(x)", "self.ln(x)"),
            loop + _frame(MLP, "return x +", "x + self.proj"),
        ),
    )
    # both blocks run the one kernel (Inductor emits one for the two): the path says so
    assert inductor.site(fc, [tree]).module == "blocks.*.fc"
    assert inductor.site(fc, [tree]).line == f"test_inductor.py:{_line(MLP, 'self.proj(')[0]}"
    assert inductor.site(gelu, [tree]).module == "blocks.*"  # a function, not a module: the block's
    assert inductor.site(ln_and_add, [tree]).module == "blocks.*"  # fused across two places: where both are


def test_a_trace_whose_line_no_longer_reads_so_is_not_placed():
    """A graph from Inductor's cache compiled before the file was edited keeps the old lines."""
    tree = inductor.ModuleTree(Net(), "Net")
    line, _ = _line(Net, "x = block(x)")
    stale = f'  File "{__file__}", line {line}, in forward\n    x = self.blocks[0](x)\n        ^^^^\n'
    assert inductor.site(inductor.Launch("extern:mm", (stale,)), [tree]) is None


def test_the_work_counter_leaves_compiled_code_compiled_and_sees_its_extern_calls():
    torch.manual_seed(0)
    model = torch.compile(MLP())
    x = torch.randn(16, 64)
    model(x).sum().backward()
    with torch.profiler.profile() as prof, WorkCounter() as wc:
        model(x).sum()
    ops = [r.op for r in wc.records if r is not None]
    assert any(e.name.startswith(inductor.GRAPH_CALL) for e in prof.events()), (
        "the compiled graph did not run"
    )
    assert "aten::addmm" in ops  # the extern matmul, counted
    assert "aten::native_layer_norm" not in ops and "aten::gelu" not in ops  # fused: not run eager


@pytest.fixture
def compiled_net():
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    net = Net()
    with (
        inductor.tracking_sources(),
        inductor_config.patch({"fx_graph_cache": False, "cpp.enable_kernel_profile": True}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch._dynamo.reset()
        model = torch.compile(net)
        x = torch.randn(32, 64)
        model(x).backward()
        yield model, x
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_models_kernels_are_rows_charged_to_its_modules_and_lines(compiled_net):
    model, x = compiled_net
    p = pl.profile(lambda: model(x).backward(), calls=2)
    modules = {r.name: r for r in p.breakdown(by="module")}
    assert {"blocks.*.fc", "blocks.*.proj", "blocks.*.ln"} <= set(modules), sorted(modules)
    # every launch of the compiled graphs placed: none left to the compiled wrapper or to no module
    assert "_orig_mod" not in modules, sorted(modules)
    unplaced = [i.op for i in p.items() if i.module == "(no module)"]
    assert not [op for op in unplaced if op.startswith(COMPILED_OP) or op.endswith("mm")], unplaced
    # the matmuls' work counted with the code compiled: forward and backward of both blocks' fc
    fc = modules["blocks.*.fc"]
    assert fc.flops == pytest.approx(2 * p.calls * 3 * (2 * 32 * 64 * 256), rel=1e-6), fc
    assert fc.bound is not None
    rows = [r for r in p.breakdown(by="op") if r.name.startswith(COMPILED_OP + " ")]
    norm = next(r for r in rows if r.name == f"{COMPILED_OP} cpp_fused_native_layer_norm_0")
    assert "fuses native_layer_norm" in norm.note
    assert f"blocks.*.ln at test_inductor.py:{_line(MLP, 'h = self.ln(x)')[0]}" in norm.note


@pytest.mark.slow
def test_compiled_kernels_without_a_recorded_source_are_said_to_be_charged_to_the_compiled_function():
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    with (
        inductor_config.patch({"fx_graph_cache": False, "cpp.enable_kernel_profile": True}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch._dynamo.reset()
        torch._dynamo.utils.clear_compilation_metrics()  # the other tests' graphs, with their sources
        assert not inductor_config.trace.provenance_tracking_level
        model, x = torch.compile(Net()), torch.randn(32, 64)
        model(x).backward()
        p = pl.profile(lambda: model(x).backward(), calls=1)
    torch._dynamo.reset()
    assert any(r.name.startswith(COMPILED_OP) for r in p.breakdown(by="op"))
    assert any("charged to the compiled function" in w for w in p.warnings), p.warnings


class _Event:
    """The parts of a profiler event `placements` reads."""

    def __init__(self, name, start, children=()):
        self.name, self.cpu_children = name, list(children)
        self.time_range = type("T", (), {"start": start})()


def test_a_launch_inductor_kept_no_source_for_takes_the_module_of_its_placed_neighbours():
    """A mix-order reduction's kernel has no provenance (Inductor records none for it): between
    two launches of one block it is charged to that block, its line marked as inferred."""
    tree = inductor.ModuleTree(Net(), "Net")
    loop = _frame(Net, "x = block(x)", "block(x)")
    fc = inductor.Launch("extern:mm", (loop + _frame(MLP, "self.proj(", "self.fc(h)"),))
    proj = inductor.Launch("extern:mm", (loop + _frame(MLP, "self.proj(", "self.proj("),))
    unsourced = _Event("triton_per_fused_native_layer_norm_backward_1", 2)
    call = _Event(inductor.GRAPH_CALL + " f ##", 0, [_Event("aten::mm", 1), unsourced, _Event("aten::mm", 3)])
    placed = inductor.placements([call], [(proj, fc)], [tree])
    sites = [placed.get(id(u)) for u in call.cpu_children]
    assert [s.module for s in sites] == ["blocks.*.proj", "blocks.*", "blocks.*.fc"]
    assert sites[1].line.endswith("by its neighbours")


def test_a_graphs_unsourced_first_launch_takes_the_module_of_the_first_placed_one_after_it():
    """run29 call5: the one kernel left unplaced (1.7% of a compiled GPT-2 step) was the first of
    the backward graph, before any placed launch: it takes the module of the first placed one
    after it, as the last unsourced ones take the module before them."""
    tree = inductor.ModuleTree(Net(), "Net")
    loop = _frame(Net, "x = block(x)", "block(x)")
    fc = inductor.Launch("extern:mm", (loop + _frame(MLP, "self.proj(", "self.fc(h)"),))
    first = _Event("triton_per_fused_native_layer_norm_backward_0", 1)
    last = _Event("triton_poi_fused_add_3", 3)
    call = _Event(inductor.GRAPH_CALL + " f ##", 0, [first, _Event("aten::mm", 2), last])
    placed = inductor.placements([call], [(fc,)], [tree])
    sites = [placed.get(id(u)) for u in call.cpu_children]
    assert [s.module for s in sites] == ["blocks.*.fc"] * 3
    assert sites[0].line.endswith("by its neighbour") and sites[2].line.endswith("by its neighbour")


def test_a_graphs_record_holding_another_models_launches_first_is_read_for_this_models_own():
    """torch adds a lazily compiled backward's launches to what it kept of the one before: the
    record of this model's graph starts with another model's launches, of the same names."""
    tree = inductor.ModuleTree(Net(), "Net")
    loop = _frame(Net, "x = block(x)", "block(x)")
    elsewhere = '  File "/elsewhere/model.py", line 3, in forward\n    y = self.w(x)\n'
    other = inductor.Launch("extern:mm", (elsewhere,))
    fc = inductor.Launch("extern:mm", (loop + _frame(MLP, "self.proj(", "self.fc(h)"),))
    call = _Event(inductor.GRAPH_CALL + " f ##", 0, [_Event("aten::mm", 1)])
    placed = inductor.placements([call], [(other, fc)], [tree])
    assert placed[id(call.cpu_children[0])].module == "blocks.*.fc"


@pytest.mark.slow
def test_a_model_first_compiled_inside_pl_profile_has_its_kernels_placed_without_a_switch():
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    with (
        inductor_config.patch({"fx_graph_cache": False}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch._dynamo.reset()
        torch._dynamo.utils.clear_compilation_metrics()
        assert not inductor_config.trace.provenance_tracking_level
        model, x = torch.compile(Net()), torch.randn(32, 64)
        p = pl.profile(lambda: model(x).backward(), calls=1)  # its warm-up compiles the model
        assert not inductor_config.trace.provenance_tracking_level  # put back as it was
    torch._dynamo.reset()
    modules = {r.name for r in p.breakdown(by="module")}
    assert {"blocks.*.fc", "blocks.*.proj"} <= modules and "_orig_mod" not in modules, modules


def test_the_module_a_compiled_wrapper_holds_goes_by_the_models_name_not_orig_mod():
    """torch.compile(model) wraps the model as `_orig_mod`: its module ranges named the model
    "_orig_mod" and its children "_orig_mod.<path>" beside the wrapper's "Net" (run32: 1.7% of a
    compiled GPT-2 step's device time in a row "_orig_mod", outside every module of the model)."""
    from perfloop.analysis.modules import module_ranges

    torch.manual_seed(0)
    net = Net()
    wrapper = torch.compile(net, backend="eager")
    with module_ranges() as t:
        wrapper(torch.randn(4, 64))
        net(torch.randn(4, 64))  # the model called itself, eager
    torch._dynamo.reset()
    assert t.names[id(wrapper)] == t.names[id(net)] == "Net"
    assert t.names[id(net.blocks[0].fc)] == "blocks.0.fc"
    assert not [n for n in t.names.values() if "_orig_mod" in n]
