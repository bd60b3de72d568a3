"""FLOPs and bytes per op, counted from the real tensors each op was given."""

import pytest
import torch
import torch.nn.functional as F

from perfloop.analysis.work import count, footprint, total_flops


def _one(fn, *args):
    recs = count(fn, *args)
    assert len(recs) == 1, [r.op for r in recs]
    return recs[0]


def test_a_broadcast_operand_counts_its_distinct_elements_once():
    x, row = torch.randn(512, 256), torch.randn(256)
    r = _one(torch.add, x, row)
    assert r.op == "aten::add" and r.bytes == 4 * (512 * 256 + 256 + 512 * 256)
    assert footprint(row.expand(512, 256)) == 256 * 4
    assert footprint(torch.randn(4, 8)[:, ::2]) == 4 * 4 * 4


def test_views_move_nothing_and_in_place_ops_write_their_argument():
    x = torch.randn(64, 64)
    assert count(lambda: x.t().unsqueeze(0).expand(3, 64, 64)[:, ::2]) == []
    r = _one(lambda: x.mul_(2.0))
    assert r.bytes == 2 * x.nbytes  # read and written once
    y = torch.empty_like(x)
    r = _one(lambda: y.copy_(x))
    assert r.bytes == 2 * x.nbytes  # copy_ only overwrites its destination: not read


def test_gathers_read_the_rows_they_take_not_the_table():
    table = torch.randn(50_000, 64)
    idx = torch.randint(0, 50_000, (32,))
    r = _one(F.embedding, idx, table)
    assert r.bytes == idx.nbytes + 2 * 32 * 64 * 4  # rows read + output written
    assert r.bytes < table.nbytes / 100


def test_matmul_flops_come_from_torchs_formulas_and_set_the_dtype():
    a, b = torch.randn(128, 256), torch.randn(256, 64)
    r = _one(torch.mm, a, b)
    assert r.flops == 2 * 128 * 256 * 64 and r.flops_from == "formula"
    assert r.bytes == a.nbytes + b.nbytes + 128 * 64 * 4 and r.dtype == "fp32"
    r = _one(torch.mm, a.bfloat16(), b.bfloat16())
    assert r.dtype == "bf16"


def test_causal_attention_counts_the_half_it_computes():
    q = torch.randn(1, 2, 128, 32)
    full = total_flops(count(F.scaled_dot_product_attention, q, q, q))
    causal = total_flops(count(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)))
    assert full == 4 * 2 * 128 * 128 * 32
    assert causal / full == pytest.approx((128 + 1) / (2 * 128))


def test_an_item_call_records_the_source_line_that_made_it():
    x = torch.randn(16)
    recs = count(lambda: x.sum().item())
    [sync] = [r for r in recs if r.site]
    assert sync.op == "aten::_local_scalar_dense"
    assert sync.site.endswith(
        f"test_work.py:{test_an_item_call_records_the_source_line_that_made_it.__code__.co_firstlineno + 2}"
    )


@pytest.mark.parametrize("size", ["tiny", "lm-small-narrow"])
def test_a_gpt_training_step_counts_to_the_analytic_flops_within_3_percent(size, train_gpt):
    ex = train_gpt
    # experiments/lm.py's small width and heads, two layers and a short context to fit a CPU test
    c = ex.SIZES["tiny"] if size == "tiny" else ex.GPTConfig(768, 2, 12, vocab=4096, context=128)
    model, step, _ = ex.make_step(c, 2, "cpu")
    est = total_flops(count(step))
    assert est == pytest.approx(ex.analytic_flops(c, model, 2, c.context), rel=0.03)
