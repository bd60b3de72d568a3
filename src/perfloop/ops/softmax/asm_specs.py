"""The launches `perfloop asm` compiles for softmax's Triton kernels, as the GPU would."""

from __future__ import annotations

from perfloop.ops.softmax.triton_impl import softmax_online_kernel, softmax_row_kernel, softmax_split_kernel


def asm_specs(ty: str) -> list[dict]:
    """The launches `perfloop asm` compiles: 4096-column rows, the online and the split kernels."""
    sig = {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "n_cols": "i32", "stride_x": "i32", "stride_y": "i32"}
    return [
        {
            "kernel": softmax_row_kernel,
            "signature": sig,
            "constexprs": {"BLOCK": 4096},
            "aligned": [0, 1, 2, 3, 4],
            "num_warps": 8,
            "elements_per_thread": 4096 // 256,
        },
        {
            "kernel": softmax_online_kernel,
            "signature": {
                "x_ptr": f"*{ty}",
                "y_ptr": f"*{ty}",
                "n_rows": "i32",
                **{k: v for k, v in sig.items() if k not in ("x_ptr", "y_ptr")},
            },
            "constexprs": {"BLOCK": 4096},
            "aligned": [0, 1, 3, 4, 5],
            "num_warps": 8,
            "elements_per_thread": 4096 // 256,
        },
        {
            "kernel": softmax_split_kernel,
            "signature": {
                "x_ptr": f"*{ty}",
                "y_ptr": f"*{ty}",
                "stats_ptr": "*fp32",
                "count_ptr": "*i32",
                "n_rows": "i32",
                "n_cols": "i32",
                "stride_x": "i32",
                "stride_y": "i32",
                "n_chunks": "i32",
                "spin_limit": "i32",
            },
            "constexprs": {"BLOCK": 8192, "MAX_CHUNKS": 32},
            "aligned": [0, 1, 2, 3, 5, 6, 7, 8],
            "num_warps": 8,
            "elements_per_thread": 8192 // 256,
        },
    ]
