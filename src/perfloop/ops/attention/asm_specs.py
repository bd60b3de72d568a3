"""The launches `perfloop asm` compiles for the Triton FlashAttention: the three kernels of a
call at head dim 128, causal, as the GPU compiles them."""

from __future__ import annotations

import torch

from perfloop.ops.attention.triton_impl import kernels


def asm_specs(ty: str) -> list[dict]:
    """The unit strides (head dim; V's sequence in fp32, see `run_forward`) become constants in
    Triton's runtime (so loads vectorize); the tiles are the table's for the type."""
    k = kernels()
    ptr = f"*{ty}"
    unit = {"stride_qd", "stride_kd", "stride_vn" if ty == "fp32" else "stride_vd", "stride_od"}
    strides = {}
    for t, seq in (("q", "m"), ("k", "n"), ("v", "n"), ("o", "m")):
        for axis in ("b", "h", seq, "d"):
            name = f"stride_{t}{axis}"
            strides[name] = "constexpr" if name in unit else "i32"
    sizes = {"H": "i32", "SQ": "i32", "SK": "i32"}
    fwd_sig = {
        "Q": ptr,
        "K": ptr,
        "V": ptr,
        "O": ptr,
        "L": "*fp32",
        "qk_scale": "fp32",
        **strides,
        **sizes,
        "SK_V": "i32",
    }
    common = {
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "CAUSAL": True,
        "EVEN_M": True,
        "EVEN_N": True,
        "UPCAST": False,
        "PRECISION": "tf32",
    }
    bwd_sig = {"Q": ptr, "K": ptr, "V": ptr, "DO": ptr, "L": "*fp32", "Dl": "*fp32"}
    specs = []
    for kernel, kind, sig, aligned in (
        # pointers, and every stride and size that is a multiple of 16 (as at S=4096, D=128)
        (
            k["fwd"],
            "fwd",
            fwd_sig,
            [
                i
                for i, (n, t) in enumerate(fwd_sig.items())
                if t != "constexpr" and n not in ("qk_scale", "H")
            ],
        ),
        (
            k["bwd_dkdv"],
            "dkdv",
            {**bwd_sig, "DK": ptr, "DV": ptr, "sm_scale": "fp32", **sizes},
            list(range(8)),
        ),
        (k["bwd_dq"], "dq", {**bwd_sig, "DQ": ptr, "sm_scale": "fp32", **sizes}, list(range(7))),
    ):
        cfg = k["config"](128, kind, torch.float32 if ty == "fp32" else torch.bfloat16)
        consts = {**common, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
        if kind == "fwd":
            consts |= dict.fromkeys(unit, 1)
        specs.append(
            {
                "kernel": kernel,
                "signature": sig,
                "aligned": aligned,
                "constexprs": consts,
                "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"],
            }
        )
    return specs
