"""Device time by kernel, by launching op, by category (issue 16, a first slice)."""

import pytest
import torch

import perfloop as pl
from perfloop.analysis.attribution import category
from perfloop.ops.gelu.torch_impl import naive


@pytest.mark.parametrize("name, cat", [
    ("aten::addmm", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
    ("aten::scaled_dot_product_attention", "attention"), ("aten::native_layer_norm", "normalization"),
    ("aten::_to_copy", "dtype cast/copy"), ("aten::_fused_adamw_", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32", "communication"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy/memset"),
    ("aten::sum", "reduction"), ("aten::gelu", "elementwise"), ("triton_poi_fused_0", "other"),
])  # fmt: skip
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
    with pytest.raises(ValueError, match="by: 'module'"):
        p.breakdown("module")


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
