"""Device time by kernel, by launching op, by module (backward charged to the forward module,
optimizer apart), by category."""

from types import SimpleNamespace

import pytest
import torch

import perfloop as pl
from perfloop.analysis.attribution import _outer_op, category
from perfloop.ops.gelu.torch_impl import naive


@pytest.mark.parametrize(
    "name, cat",
    [
        ("aten::addmm", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::native_layer_norm", "normalization"),
        ("aten::_to_copy", "dtype cast/copy"),
        ("aten::_fused_adamw_", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32", "communication"),
        ("Memcpy HtoD (Pageable -> Device)", "memcpy/memset"),
        ("aten::sum", "reduction"),
        ("aten::gelu", "elementwise"),
        ("triton_poi_fused_0", "other"),
        # the fused ops' own profiler ops (their C++ Functions', nn/compiled.py's custom ops)
        ("perfloop::norm", "normalization"),
        ("perfloop::norm_backward", "normalization"),
        ("perfloop::gated_backward", "elementwise"),
        ("perfloop::flash_attention_backward", "attention"),
        ("perfloop::cross_entropy", "reduction"),
    ],
)
def test_categories_follow_the_rule_table(name, cat):
    assert category(name) == cat


def test_the_naive_gelu_splits_into_its_ops_and_all_of_it_is_elementwise():
    x = torch.randn(256, 256)
    p = pl.profile(naive, x, calls=2)
    ops = {r.name: r for r in p.breakdown("op")}
    assert {"aten::mul", "aten::add", "aten::pow", "aten::tanh"} <= set(ops)
    assert ops["aten::mul"].calls == 2 * 4 and ops["aten::tanh"].calls == 2
    assert sum(r.share for r in ops.values()) == pytest.approx(1.0)
    [cat] = p.breakdown("category")
    assert cat.name == "elementwise" and cat.share == pytest.approx(1.0)
    with pytest.raises(ValueError, match="by: 'modules'"):
        p.breakdown("modules")
    with pytest.raises(ValueError, match="depth: must be an integer >= 1"):
        p.breakdown("module", depth=0)


@pytest.mark.gpu
def test_every_gpu_kernel_is_charged_to_the_op_that_launched_it():
    lin = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)

    def step():
        torch.nn.functional.gelu(lin(x)).sum().backward()

    p = pl.profile(step, calls=2)
    ops = p.breakdown("op")
    attributed = sum(r.device_ms for r in ops if not r.name.startswith("(no op)"))
    assert attributed / sum(r.device_ms for r in ops) > 0.98
    cats = {r.name for r in p.breakdown("category")}
    assert {"matmul", "elementwise"} <= cats


class Net(torch.nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.body(x))


def _step(dev="cpu"):
    torch.manual_seed(0)
    net = Net().to(dev)
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(256, 128, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()

    return step


def test_each_op_is_charged_to_its_module_and_backward_to_the_forward_module():
    p = pl.profile(_step(), calls=2, count_work=False)
    by = {(i.module, i.phase, i.op) for i in p.items()}
    assert ("body.0", "forward", "aten::linear") in by
    assert ("body.0", "backward", "aten::mm") in by  # AddmmBackward's mm, charged to body.0
    assert ("body.1", "backward", "aten::gelu_backward") in by
    assert ("norm", "backward", "aten::native_layer_norm_backward") in by
    assert any(m == "optimizer" and ph == "optimizer" for m, ph, _ in by)
    # the loss ops ran outside any module: their own row, never dropped
    assert ("(no module)", "forward", "aten::square") in by
    rows = {r.name: r for r in p.breakdown("module")}
    assert {"body.0", "body.1", "body.2", "norm", "optimizer", "(no module)"} <= set(rows)
    assert sum(r.device_ms for r in rows.values()) == pytest.approx(sum(i.ms for i in p.items()))
    assert 0 < rows["body.0"].backward_ms < rows["body.0"].device_ms
    # rolled up to the first name part: body.0-2 become one row of the same time
    rolled = {r.name: r for r in p.breakdown("module", depth=1)}
    assert rolled["body"].device_ms == pytest.approx(sum(rows[f"body.{i}"].device_ms for i in range(3)))


def test_rows_carry_the_counted_work_and_the_roofline():
    p = pl.profile(_step(), calls=2)
    rows = {r.name: r for r in p.breakdown("module")}
    body0 = rows["body.0"]
    # Linear 128 -> 512 on 256 rows: forward 2*256*128*512 and the same for dW in backward (the
    # input needs no gradient, so no dx), over two profiled calls
    assert body0.flops == pytest.approx(2 * 2 * 256 * 128 * 512 * 2, rel=1e-6)
    assert rows["body.2"].flops == pytest.approx(3 * 2 * 256 * 512 * 128 * 2, rel=1e-6)  # dx too
    assert body0.bytes > 0 and body0.gbps > 0 and body0.tflops > 0
    assert body0.bound in ("compute", "memory", "latency") and body0.headroom_ms >= 0
    assert "formula" in body0.work_from
    assert rows["body.1"].flops == 0 and rows["body.1"].bytes > 0  # GELU: bytes only
    assert rows["body.1"].bound in ("memory", "latency")


@pytest.mark.gpu
def test_a_gpt_step_on_the_gpu_is_attributed_to_modules_and_its_backward_to_the_forward_modules(train_gpt):
    ex = train_gpt
    _, step, _ = ex.make_step(ex.GPTConfig(256, 2, 4, vocab=4096, context=256), 4, "cuda")
    p = pl.profile(step, calls=2)
    its = p.items()
    total = sum(i.ms for i in its)
    assert sum(i.ms for i in its if i.module != "(no module)" and i.op) / total > 0.98
    bwd = [i for i in its if i.phase == "backward"]
    assert sum(i.ms for i in bwd if i.module != "(no module)") / sum(i.ms for i in bwd) > 0.95
    assert any(i.module == "optimizer" and "fused_adamw" in i.op for i in its)
    assert any(r.name == "transformer.h.0.attn.c_attn" and r.backward_ms > 0 for r in p.breakdown("module"))


def _event(name, parent=None):
    return SimpleNamespace(name=name, cpu_parent=parent)


@pytest.mark.parametrize(
    "boundary",
    [
        "Optimizer.step#AdamW.step",
        "Optimizer.zero_grad#AdamW.zero_grad",
        "autograd::engine::evaluate_function: MulBackward0",
        "module: blocks.0.mlp",
    ],
)
def test_a_launch_is_charged_to_the_outermost_op_below_its_module_backward_or_optimizer(boundary):
    # the profiler's chain from a kernel launch up to the step: ops nest inside a module, a backward
    # node or an optimizer step, and whatever is above that boundary belongs to another charge
    top = _event("aten::outside_the_boundary", _event("ProfilerStep#3"))
    wrapper = _event(boundary, top)
    outer = _event("aten::linear", wrapper)
    launch = _event("cudaLaunchKernel", _event("aten::addmm", outer))
    assert _outer_op(launch) == "aten::linear"
    assert _outer_op(_event("cudaLaunchKernel", wrapper)) == ""


def test_a_launch_in_a_dynamo_region_that_ran_no_compiled_graph_is_not_a_compiled_kernel():
    """pl.patch's rewritten forward runs under a Torch-Compiled Region, eager: a kernel launched
    there by no aten op (perfloop's Triton RoPE) is not Inductor's (run31 labelled it
    "(compiled) rope_kernel"); one launched inside a compiled graph's call is."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from perfloop.analysis.attribution import call_context

    def chain(*names):
        up = None
        for i, name in enumerate(names):
            e = FunctionEvent(
                id=100 + i, name=name, thread=1, start_us=i, end_us=50 - i, device_type=DeviceType.CPU
            )
            e.cpu_parent = up
            up = e
        return up

    eager = chain("Torch-Compiled Region: 3/0", "cuLaunchKernelEx")
    assert call_context(eager, {})[0] == ""
    graph = chain("Torch-Compiled Region: 3/0", "## Call CompiledFxGraph fabc ##", "cuLaunchKernelEx")
    assert call_context(graph, {})[0] == "(compiled)"
