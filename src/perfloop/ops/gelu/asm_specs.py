"""The launches `perfloop asm` compiles for gelu's Triton kernels, as the GPU would."""

from __future__ import annotations

from perfloop.ops.gelu.triton_impl import gelu_kernel


def asm_specs(ty: str) -> list[dict]:
    """The launch `perfloop asm` compiles: the benchmark's, with aligned pointers and n."""
    block = 1024 if ty == "fp32" else 2048
    return [
        {
            "kernel": gelu_kernel,
            "signature": {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "n": "i32"},
            "constexprs": {"EXACT": False, "BLOCK": block},
            "aligned": [0, 1, 2],
            "num_warps": 4,
            "elements_per_thread": block // 128,
        }
    ]
