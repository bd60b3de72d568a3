"""The launch `perfloop asm` compiles for matmul+ReLU's Triton kernel, as the GPU would."""

from __future__ import annotations

from perfloop.ops.matmul_relu.triton_impl import (
    CONFIGS,
    TF32_CONFIGS,
    matmul_relu_kernel,
    matmul_relu_tf32_kernel,
)


def asm_specs(ty: str) -> list[dict]:
    """An autotuning candidate at 8192^3, as `perfloop asm` compiles it: the first for 16-bit
    types; for fp32 (TF32) the TF32 kernel's first, the product taken as C^T = B^T A^T."""
    names = [
        "a_ptr",
        "b_ptr",
        "c_ptr",
        "M",
        "N",
        "K",
        "stride_am",
        "stride_ak",
        "stride_bk",
        "stride_bn",
        "stride_cm",
        "stride_cn",
    ]
    sig = {n: (f"*{ty}" if n.endswith("_ptr") else "i32") for n in names}
    # unit strides are constants, as Triton's runtime specializes them (A, B and C row-major)
    units = ("stride_ak", "stride_bn", "stride_cn")
    for unit in units:
        sig[unit] = "constexpr"
    if ty == "fp32":
        kernel, cfg, consts = matmul_relu_tf32_kernel, TF32_CONFIGS[0], {"ROUND": True}
    else:
        kernel, cfg, consts = matmul_relu_kernel, CONFIGS[0], {"UPCAST": False, "PRECISION": "tf32"}
    return [
        {
            "kernel": kernel,
            "signature": sig,
            "constexprs": {**cfg.kwargs, **consts, **dict.fromkeys(units, 1)},
            "aligned": [i for i, n in enumerate(names) if n not in units],
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
        }
    ]
