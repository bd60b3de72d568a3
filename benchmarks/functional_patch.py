"""pl.patch on GPT-2 small written as popular training code writes it (examples/nanogpt_model.py:
F.layer_norm in a LayerNorm class, F.cross_entropy(ignore_index=-1) in forward, nn.GELU() exact):
which call sites it reaches, the step before and after (measure=True: each kind alone, interleaved),
and what the rerouting itself costs the host per call.

    PYTHONPATH=src python3 benchmarks/functional_patch.py --out DIR [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import llama_model  # noqa: E402
import nanogpt_model  # noqa: E402

import perfloop as pl  # noqa: E402
from perfloop.device import env_fingerprint  # noqa: E402
from perfloop.nn import functional as pf  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def mechanism_cost() -> dict:
    """Host time of one call of a LayerNorm class over F.layer_norm, plain and rerouted with its
    site sent to torch's own function (the mechanism alone), on a tiny CPU tensor."""
    plain_ln, routed_ln = nanogpt_model.LayerNorm(8, bias=True), nanogpt_model.LayerNorm(8, bias=True)
    pf.reroute(routed_ln, {})  # no site fused: every call resolved through the proxy to torch's
    x = torch.randn(2, 8)
    plain, routed = [], []
    for _ in range(9):  # alternated: drift hits both
        plain.append(host_us(lambda: plain_ln(x)))
        routed.append(host_us(lambda: routed_ln(x)))
    p, r = sorted(plain)[4], sorted(routed)[4]
    return {"plain_us": p, "rerouted_us": r, "overhead_us": r - p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--small", action="store_true", help="a tiny model (to test the script on a CPU)")
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if a.model == "gpt2":  # GPT-2 small, batch 12 x 1024
        cfg = (nanogpt_model.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)
               if a.small else nanogpt_model.GPTConfig())  # fmt: skip
        batch, seq, vocab = (2, 64, cfg.vocab_size) if a.small else (12, 1024, cfg.vocab_size)
        model = nanogpt_model.GPT(cfg).to(dev)
    else:  # 8 layers, d 1024, 16 heads, vocab 32000, batch 8 x 1024
        tiny = dict(dim=64, n_layers=2, n_heads=2, vocab_size=512, multiple_of=32, max_seq_len=64)
        cfg = llama_model.ModelArgs(**tiny) if a.small else llama_model.ModelArgs()
        batch, seq, vocab = (2, 64, cfg.vocab_size) if a.small else (8, 1024, cfg.vocab_size)
        model = llama_model.Transformer(cfg).to(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), device=dev, generator=g)
    y = torch.randint(0, vocab, (batch, seq), device=dev, generator=g)
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast(dev, enabled=False)

    def loss_fn(m, b):
        with amp:
            out = m(*b)
        return out[1] if isinstance(out, tuple) else m.last_loss

    out: dict = {"device": env_fingerprint(), "model": a.model, "config": cfg.__dict__, "batch": [batch, seq]}
    t0 = time.perf_counter()
    report = pl.patch(model, (x, y), loss_fn=loss_fn, measure=True, budget_s=4.0 if dev == "cuda" else 1.0)
    out["patch_s"] = time.perf_counter() - t0
    out["report"] = str(report)
    out["replaced"] = report.replaced
    out["timing"] = report.timing
    out["mechanism"] = mechanism_cost()
    sites = sum(1 for s in report.swaps if s.site and s.replaced)
    step_ms = (report.timing or {}).get("after_ms")
    if step_ms:  # rerouted calls a step: each site's module runs once a step forward
        out["mechanism"]["share_of_step"] = sites * out["mechanism"]["overhead_us"] / (step_ms * 1e3)
    print(report, flush=True)
    print(json.dumps(out["mechanism"]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"functional_patch_{a.model}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
