"""The norms' last step, dw and db summed over the backward's per-program partials: every row
step and column edge of the tile (run under TRITON_INTERPRET=1 on the CPU)."""

import pytest
import torch

from perfloop.ops.base import cdiv, interpreting


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("parts,cols,slabs", [(70, 100, 2), (1, 5, 1), (32, 64, 1), (33, 130, 2)])
def test_colsum_adds_every_partial_row_into_the_weights_dtype(parts, cols, slabs):
    from perfloop.ops.launch import launch
    from perfloop.ops.layernorm import triton_impl as T

    dev = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    g = torch.Generator(device=dev).manual_seed(parts * cols)
    partial = torch.randn(slabs, parts, cols, device=dev, generator=g)
    out = torch.empty(slabs, cols, device=dev, dtype=torch.bfloat16)
    launch(
        T.colsum_kernel,
        (cdiv(cols, T.COLSUM_BLOCK), slabs),
        partial,
        out,
        parts,
        cols,
        ROWS=T.COLSUM_ROWS,
        BLOCK=T.COLSUM_BLOCK,
    )
    torch.testing.assert_close(out, partial.sum(1).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
