"""Inductor's kernels as rows (issue 39, item 4): each compiled kernel and extern call placed in
the module and line it came from, its fused ops named, its work counted with the code compiled."""

import inspect

import pytest
import torch
import torch.nn as nn

import perfloop as pl
from fixtures.record import compiled_afresh
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


def step_of(model, x):  # a function compiled around the model, as gpt-fast's decode_one_token
    return model(x) * 2


def test_a_trace_from_a_function_that_calls_the_model_is_read_from_the_models_forward_down():
    """Issue 54, seen on the H100: a graph compiled from `decode_one_token(model, x, pos)` has
    traces whose outermost frame is that function; they are read from the model's forward down
    (none was placed before)."""
    tree = inductor.ModuleTree(Net(), "Net")
    lines, first = inspect.getsourcelines(step_of)
    n = next(i for i, x in enumerate(lines) if "model(x)" in x)
    code = lines[n].rstrip("\n")
    marks = " " * code.index("model(x)") + "^" * len("model(x)")
    outer = f'  File "{__file__}", line {first + n}, in step_of\n{code}\n{marks}\n'
    loop = _frame(Net, "x = block(x)", "block(x)")
    fc = inductor.Launch("extern:addmm", (outer + loop + _frame(MLP, "self.proj(", "self.fc(h)"),))
    assert inductor.site(fc, [tree]).module == "blocks.*.fc"
    assert inductor.site(inductor.Launch("extern:mm", (outer,)), [tree]) is None  # the model never entered


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
    with compiled_afresh():
        assert not inductor_config.trace.provenance_tracking_level
        model, x = torch.compile(Net()), torch.randn(32, 64)
        p = pl.profile(lambda: model(x).backward(), calls=1)  # its warm-up compiles the model
        assert not inductor_config.trace.provenance_tracking_level  # put back as it was
    torch._dynamo.reset()
    modules = {r.name for r in p.breakdown(by="module")}
    assert {"blocks.*.fc", "blocks.*.proj"} <= modules and "_orig_mod" not in modules, modules


def test_a_compiled_function_given_the_model_has_its_kernels_placed_in_the_models_modules():
    """Issue 54: `torch.compile(decode_one_token)(model, ...)` runs no module's forward eagerly, so
    no hook names the model; the model the profiled call reaches (its arguments, its closure) is
    read instead."""
    torch.manual_seed(0)
    with compiled_afresh():
        net, x, fn = Net(), torch.randn(32, 64), torch.compile(step_of)
        with torch.no_grad():
            closed = pl.profile(lambda: fn(net, x), calls=1)
            given = pl.profile(fn, net, x, calls=1)
    torch._dynamo.reset()
    for p in (closed, given):
        modules = {r.name for r in p.breakdown(by="module")}
        assert {"blocks.*.fc", "blocks.*.proj"} <= modules, modules
    # the same graph's traces as torch 2.11 writes them on Python 3.12, with no caret: each
    # matmul still reads its own Linear's weights, fc's then proj's on their shared line
    bare = lambda t: "\n".join(x for x in t.splitlines() if not set(x.strip()) <= set("^~") or not x.strip())
    graphs = [
        tuple(inductor.Launch(x.key, tuple(map(bare, x.traces))) for x in g)
        for g in inductor.graph_launches(closed.compile_metrics)
    ]
    tree = inductor.ModuleTree(net, "Net")
    [graph] = [g for g in graphs if any(x.key in ("extern:mm", "extern:addmm") for x in g)]
    assert not any("^" in t for x in graph for t in x.traces)
    reads = inductor.gemm_reads(graph, [tree])
    own = lambda m: sum(t.numel() * 4.0 for t in m.parameters())
    assert [s.module for s, _ in reads.values()] == ["blocks.*.fc", "blocks.*.proj"] * 2
    assert sum(w[1] for _, w in reads.values()) == sum(own(b.fc) + own(b.proj) for b in net.blocks)


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


# ------------------------------------------------------------------ CUDA-graph replays (issue 54)


class _Ev:
    """A profiler event as attribution.items reads it: a CPU event (its children, the kernels
    its launch holds) or a device kernel."""

    def __init__(self, name, start, end, children=(), kernels=(), device=False):
        from torch.autograd import DeviceType

        self.name, self.cpu_children, self.cpu_parent = name, list(children), None
        self.kernels = [type("K", (), {"name": k})() for k in kernels]
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU
        self.sequence_nr, self.is_user_annotation = -1, False
        self.time_range = type(
            "T", (), {"start": start, "end": end, "elapsed_us": lambda s: s.end - s.start}
        )()
        for c in self.cpu_children:
            c.cpu_parent = self


GEMM, SPLIT_K = (
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x64x32",
    "void cublasLt::splitKreduce_kernel<32, 16>",
)


def _mlp_graph():
    """Net's compiled forward as Inductor's provenance records it, one block (its norm, fc,
    GELU, proj, the residual add), with the FX nodes' stack traces."""
    loop = _frame(Net, "x = block(x)", "block(x)")
    at = {
        "ln": _frame(MLP, "h = self.ln(x)", "self.ln(x)"),
        "fc": _frame(MLP, "self.proj(", "self.fc(h)"),
        "proj": _frame(MLP, "self.proj(", "self.proj("),
    }
    return (
        inductor.Launch("triton_per_fused_native_layer_norm_0", (loop + at["ln"],)),
        inductor.Launch("extern:addmm", (loop + at["fc"],)),
        inductor.Launch("triton_poi_fused_gelu_1", (loop + at["fc"],)),
        inductor.Launch("extern:addmm", (loop + at["proj"],)),
        inductor.Launch("triton_poi_fused_add_2", (loop + _frame(MLP, "return x +", "x + self.proj("),)),
    )


def _replay(names):
    """One replay as the profiler records it: the graph's call, the cudaGraphLaunch under it whose
    launch holds every kernel, and the kernels on the device in order; an input copy before it."""
    copy = _Ev("aten::_foreach_copy_", 0, 5, kernels=["multi_tensor_apply_kernel"])
    launch = _Ev("cudaGraphLaunch", 10, 12, kernels=names)
    call = _Ev(inductor.GRAPH_CALL + " fabc ##", 8, 14, [launch])
    dev = [_Ev("multi_tensor_apply_kernel", 6, 7, device=True)]
    dev += [_Ev(n, 20 + 5 * i, 24 + 5 * i, device=True) for i, n in enumerate(names)]
    return [copy, call, launch, *dev]


def test_a_cuda_graphs_replayed_kernels_are_charged_to_the_modules_and_lines_of_their_compiled_graph():
    """Replayed kernels have no launch of their own: the graph's Triton kernels are found by name
    and the cuBLAS kernels between them are its extern calls, a GEMM's split-K reduction with it;
    each row gets its module, line, and the work known of it (the matmul reads its Linear's
    weights, counted once for the two kernels)."""
    from perfloop.analysis.attribution import REPLAY_OP, items

    net = Net()
    tree = inductor.ModuleTree(net, "Net")
    names = [
        "triton_per_fused_native_layer_norm_0",
        GEMM,
        SPLIT_K,
        "triton_poi_fused_gelu_1",
        GEMM,
        "triton_poi_fused_add_2",
    ]
    costs = {"triton_poi_fused_gelu_1": (0.0, 65536.0, "")}
    read = lambda ns: inductor.replayed(ns, [_mlp_graph()], [tree], costs)
    its = items(_replay(names), "cuda", {}, read)
    copy, rest = its[0], its[1:]
    assert copy.op == "aten::_foreach_copy_" and not copy.replayed  # launched by the host: as before
    assert all(i.replayed for i in rest)
    assert [i.module for i in rest] == [
        "blocks.*.ln",
        "blocks.*.fc",
        "blocks.*.fc",
        "blocks.*.fc",
        "blocks.*.proj",
        "blocks.*",
    ]
    assert [i.op for i in rest] == [
        f"{COMPILED_OP} triton_per_fused_native_layer_norm_0",
        "aten::addmm",
        "aten::addmm",
        f"{COMPILED_OP} triton_poi_fused_gelu_1",
        "aten::addmm",
        f"{COMPILED_OP} triton_poi_fused_add_2",
    ]
    assert rest[0].line == f"test_inductor.py:{_line(MLP, 'h = self.ln(x)')[0]}"
    fc = net.blocks[0].fc
    assert rest[1].work == (0.0, (fc.weight.numel() + fc.bias.numel()) * 4.0, "float32")
    assert rest[2].work is None  # the split-K reduction: the same call, its bytes counted once
    assert rest[3].work == costs["triton_poi_fused_gelu_1"]
    # without the compiled graph's sources the kernels are still the replay's, never an op's
    bare = items(_replay(names), "cuda", {}, None)
    assert [i.op for i in bare[1:]] == [REPLAY_OP] * len(names) and all(i.replayed for i in bare[1:])


def test_a_replay_run_out_of_launch_order_is_matched_by_what_each_kernel_is():
    """Recorded on the H100 (replay_facts.py): a graph's kernels run in the order of their
    dependencies, not of their launches (the decode's mask kernels ran first). Each kernel is
    matched by what it is; an aten fallback's kernel (a complex multiply) takes its neighbours'
    module; the graph read is the one its Triton kernels are in."""
    tree = inductor.ModuleTree(Net(), "Net")
    graph = _mlp_graph()
    other = (inductor.Launch("triton_poi_fused_mul_0", graph[0].traces),)
    names = [
        "triton_poi_fused_add_2",  # ran first: nothing it needs came before it in the graph
        "triton_per_fused_native_layer_norm_0",
        GEMM,
        "void at::native::elementwise_kernel<128, 2>",
        "triton_poi_fused_gelu_1",
        GEMM,
        SPLIT_K,
    ]
    got = inductor.replayed(names, [other, graph], [tree])
    assert [r.key for r in got] == [
        "triton_poi_fused_add_2",
        "triton_per_fused_native_layer_norm_0",
        "extern:addmm",
        "",
        "triton_poi_fused_gelu_1",
        "extern:addmm",
        "extern:addmm",
    ]
    assert [r.site.module for r in got] == [
        "blocks.*",
        "blocks.*.ln",
        "blocks.*.fc",
        "blocks.*.fc",
        "blocks.*.fc",
        "blocks.*.proj",
        "blocks.*.proj",
    ]
    assert got[5].work is not None and got[6].work is None  # the proj call's split-K: counted once


class Head(nn.Module):
    def __init__(self, d=64, vocab=100):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def test_a_replayed_gemm_on_a_line_of_several_linears_reads_the_weights_of_the_one_it_calls():
    """Seen on the H100 and H200 (torch 2.11, Python 3.12): the stack traces of a graph's nodes
    carry no caret and stop at the user's line, `return self.w2(F.silu(self.w1(x)) * self.w3(x))`,
    so the GEMMs were charged to the feed-forward module, which holds no weights itself, and
    the decode's bytes a token read 0.1% of its weights. A line's calls are read in the order
    Python makes them, and the n-th GEMM of that line in the graph is the n-th Linear called."""
    net = Net()
    tree = inductor.ModuleTree(net, "Net")
    bare = lambda cls, text: _frame(cls, text, text).rsplit("\n", 2)[0] + "\n"  # no caret line
    loop, line = bare(Net, "x = block(x)"), bare(MLP, "self.proj(")
    assert "^" not in loop + line
    graph = (
        inductor.Launch("triton_per_fused_native_layer_norm_0", (loop + bare(MLP, "h = self.ln(x)"),)),
        inductor.Launch("extern:addmm", (loop + line,)),
        inductor.Launch("triton_poi_fused_gelu_1", (loop + line,)),
        inductor.Launch("extern:addmm", (loop + line,)),
    )
    names = ["triton_per_fused_native_layer_norm_0", GEMM, "triton_poi_fused_gelu_1", GEMM]
    got = inductor.replayed(names, [graph], [tree])
    fc, proj = net.blocks[0].fc, net.blocks[0].proj
    # the norm's kernel stays on the block: with no caret, its line's call is not surely its own
    assert [r.site.module for r in got] == ["blocks.*", "blocks.*.fc", "blocks.*", "blocks.*.proj"]
    assert got[1].work == (0.0, (fc.weight.numel() + fc.bias.numel()) * 4.0, "float32")
    assert got[3].work == (0.0, (proj.weight.numel() + proj.bias.numel()) * 4.0, "float32")
    # the calls in the order Python makes them: arguments before the call they are passed to
    assert inductor.self_calls("return self.w2(F.silu(self.w1(x)) * self.w3(x))") == ["w1", "w3", "w2"]
    assert inductor.self_calls("q, k, v = self.wqkv(x).split(self.dim, dim=-1)") == ["wqkv"]
    assert inductor.self_calls("self.a(x,") == ["a"]  # a statement cut at its line: read in text order
    assert inductor.self_calls("h = x + self.attention.forward(self.attention_norm(x))") == [
        "attention_norm",
        "attention",
    ]  # llama2.c's form
    # a norm called on the head's line holds a vector, not a matrix a GEMM reads: the head's GEMM
    head = inductor.ModuleTree(Head(), "Head")
    launch = inductor.Launch("extern:mm", (bare(Head, "return self.out(self.norm(x))"),))
    [(at, work)] = inductor.gemm_reads((launch,), [head]).values()
    assert at.module == "out" and work[1] == 64 * 100 * 4.0


class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class PreNormBlock(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm1, self.norm2, self.mix, self.ff = Norm(), Norm(), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.ff(self.norm2(x))


def test_without_carets_a_frame_is_narrowed_to_the_modules_its_callers_line_calls():
    """A norm's kernel: its frame is Norm.forward, which both of the block's norms run; the
    caller's line, `x + self.mix(self.norm1(x))`, says which, though no caret marks the call."""
    tree = inductor.ModuleTree(PreNormBlock(), "Block")
    bare = lambda cls, text: _frame(cls, text, text).rsplit("\n", 2)[0] + "\n"
    trace = bare(PreNormBlock, "self.mix(self.norm1(x))") + bare(Norm, "return x * torch.rsqrt")
    assert tree.place(trace)[0] == "norm1"
    trace = bare(PreNormBlock, "self.ff(self.norm2(x))") + bare(Norm, "return x * torch.rsqrt")
    assert tree.place(trace)[0] == "norm2"


def test_an_aten_op_inductor_calls_is_keyed_by_its_op_not_its_overload():
    assert inductor._key("aten.mul.Tensor") == "extern:mul"
    assert inductor._key("torch.ops.aten.view_as_real.default") == "extern:view_as_real"
    assert inductor._key("extern_kernels.mm") == "extern:mm"
    assert inductor._key("aten::mm") == "extern:mm"


def test_inductors_own_estimate_of_a_triton_kernels_bytes_is_read_from_its_metadata(monkeypatch):
    """Under tracking_sources Inductor keeps each Triton kernel's bytes and FLOPs in its metadata
    (benchmark_kernel); a name two kernels of different cost share is not trusted."""
    import types

    from torch._inductor.codecache import PyCodeCache

    def kernel(name, gb, flop):
        return type(
            "K", (), {"inductor_meta": {"kernel_name": name, "kernel_num_gb": gb, "kernel_flop": flop}}
        )()

    a, b = types.ModuleType("a"), types.ModuleType("b")
    a.k0, a.k1 = kernel("triton_poi_fused_add_0", 0.002, 0), kernel("triton_red_fused_sum_1", 0.5, 1e6)
    b.k0 = kernel("triton_poi_fused_add_0", 0.004, 0)  # another graph's kernel of that name
    monkeypatch.setattr(PyCodeCache, "modules", [a, b], raising=False)
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {}, raising=False)
    assert inductor.kernel_costs() == {"triton_red_fused_sum_1": (1e6, 0.5e9, "")}


def test_tracking_sources_has_inductor_estimate_kernel_bytes_and_leaves_its_settings_as_they_were():
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph

    before = inductor_config.benchmark_kernel
    with inductor.tracking_sources():
        assert inductor_config.benchmark_kernel
        assert inductor_graph.print is not print  # its "Compiled module path" line is not the user's
    assert inductor_config.benchmark_kernel == before and "print" not in vars(inductor_graph)
