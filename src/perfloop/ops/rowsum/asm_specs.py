"""The launches `perfloop asm` compiles for rowsum's Triton kernels, as the GPU would."""

from __future__ import annotations

from perfloop.ops.rowsum.triton_impl import rowsum_kernel


def asm_specs(ty: str) -> list[dict]:
    """The launch `perfloop asm` compiles: rows of 16384, tiles of 4096, 8 warps."""
    return [
        {
            "kernel": rowsum_kernel,
            "signature": {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "n_cols": "i32", "stride_x": "i32"},
            "constexprs": {"BLOCK": 4096},
            "aligned": [0, 1, 2, 3],
            "num_warps": 8,
            "elements_per_thread": 4096 // 256,
        }
    ]
