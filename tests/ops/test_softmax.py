"""Triton softmax's split paths: chunks share their row's stats, in one pass or two."""

import pytest
import torch

import perfloop as pl


@pytest.mark.parametrize("block", [16, 128], ids=lambda b: f"block{b}")
def test_split_softmax_shares_row_stats_between_chunks(block):
    """Rows cut into many chunks: in the interpreter each row's last chunk combines the
    published stats, the others take the fallback path; both must be right."""
    pytest.importorskip("triton")
    from perfloop.ops.softmax.triton_impl import softmax_split

    op = pl.ops.get("softmax")
    for shape in [(5, 1000), (3, 4, 129), (1, 17)]:
        (x,) = op.make_inputs(shape, seed=4)
        y = softmax_split(x, block=block)
        torch.testing.assert_close(y.double(), op.reference(x), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="out: need a contiguous"):
        softmax_split(x, out=torch.empty(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_pass_softmax_for_rows_with_more_chunks_than_fit(dtype, monkeypatch):
    """Rows whose chunks cannot all be resident: chunk stats, then each row's combined, then
    every chunk normalized -- three launches, every chunk its own program; and past
    MAX_TWO_PASS_CHUNKS chunks a row, the online kernel."""
    pytest.importorskip("triton")
    from perfloop.ops.softmax import triton_impl

    op = pl.ops.get("softmax")
    launched = []
    for name in ("softmax_split_kernel", "softmax_combine_kernel", "softmax_online_kernel"):
        kernel = getattr(triton_impl, name)
        spy = type(
            "Spy",
            (),
            {"__getitem__": lambda self, grid, k=kernel, n=name: launched.append((n, grid)) or k[grid]},
        )()
        monkeypatch.setattr(triton_impl, name, spy)
    monkeypatch.setattr(triton_impl, "_resident_programs", lambda *a: 4)
    for shape in [(3, 1000), (2, 3, 129), (1, 17)]:
        (x,) = op.make_inputs(shape, dtype=dtype, seed=5)
        launched.clear()
        y = triton_impl.softmax_split(x, block=16, two_pass=True)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), op.reference(x), atol=tol, rtol=tol)
        rows, chunks = x.numel() // shape[-1], -(-shape[-1] // 16)
        assert launched == [
            ("softmax_split_kernel", (rows * chunks,)),
            ("softmax_combine_kernel", (rows,)),
            ("softmax_split_kernel", (rows * chunks,)),
        ]
    monkeypatch.setattr(triton_impl, "MAX_TWO_PASS_CHUNKS", 8)
    (x,) = op.make_inputs((3, 1000), dtype=dtype, seed=6)  # 63 chunks a row
    launched.clear()
    y = triton_impl.softmax_split(x, block=16, two_pass=True)
    assert [n for n, _ in launched] == ["softmax_online_kernel"]
    torch.testing.assert_close(y.double(), op.reference(x), atol=tol, rtol=tol)
