"""The fused RoPE kernel across the layouts pl.patch gives it (issue 40): Meta/llama2.c's (B, T, H, D)
with neighbouring pairs and fp32 out (the written form promotes to the fp32 tables), against the
7B benchmark's (B, H, T, D) halves; forward and backward (the same kernel, the angle negated) timed
apart, each against torch.compile of the written form at the same layout.

    PYTHONPATH=src python3 benchmarks/experiments/rope_layouts.py OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from perfloop.ops.rope import angles
from perfloop.ops.rope import triton_impl as ti

CASES = [  # name, shape, position_dim, interleaved, out dtype
    ("llama2.c q (B,T,H,D) pairs, fp32 out", (8, 1024, 16, 64), -3, True, torch.float32),
    ("(B,T,H,D) pairs, bf16 out", (8, 1024, 16, 64), -3, True, torch.bfloat16),
    ("(B,T,H,D) halves, fp32 out", (8, 1024, 16, 64), -3, False, torch.float32),
    ("(B,H,T,D) pairs D64, bf16 out", (8, 16, 1024, 64), -2, True, torch.bfloat16),
    ("7B (B,H,T,D) halves D128, bf16", (4, 32, 4096, 128), -2, False, torch.bfloat16),
]


def written(x, cos, sin, interleaved, position_dim):
    shape = [1] * x.dim()
    shape[position_dim], shape[-1] = cos.shape
    c, s = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    a = ap.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(written)
    res = []
    for name, shape, pdim, inter, odt in CASES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        cos, sin = angles(shape[pdim], shape[-1], device="cuda")
        heads = 1
        for s in shape[pdim + 1 : -1]:
            heads *= s
        moved = x.numel() * (x.element_size() + torch.empty((), dtype=odt).element_size())
        row = {"case": name, "shape": shape, "bytes": moved}
        want = written(x, cos, sin, inter, pdim).to(odt)
        got = ti.rotate(x, cos, sin, inter, heads=heads, out_dtype=odt)
        err = (got.float() - want.float()).abs().max().item()
        ms = do_bench(
            lambda x=x, cos=cos, sin=sin, inter=inter, heads=heads, odt=odt: ti.rotate(
                x, cos, sin, inter, heads=heads, out_dtype=odt
            ),
            rep=200,
        )
        row["perfloop"] = {"ms": ms, "tbps": moved / ms / 1e9, "err": err}
        ms = do_bench(
            lambda x=x, cos=cos, sin=sin, inter=inter, pdim=pdim, odt=odt: compiled(
                x, cos, sin, inter, pdim
            ).to(odt),
            rep=200,
        )
        row["torch.compile"] = {"ms": ms, "tbps": moved / ms / 1e9}
        res.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cases": res}, f, indent=1)


if __name__ == "__main__":
    main()
