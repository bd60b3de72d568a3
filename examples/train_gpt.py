"""Train a GPT-2-style language model on random tokens: a training step to profile and tune.

    python examples/train_gpt.py --size tiny --steps 5           # a laptop
    python examples/train_gpt.py --size small --batch 12         # GPT-2 small on a GPU
    perfloop profile --script examples/train_gpt.py --range step --skip 3 --steps 2 -- --size tiny

Each step is an `annotate("step")` range, so `perfloop profile --script` finds it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    layers: int
    heads: int
    vocab: int = 50304
    context: int = 1024


SIZES = {
    "tiny": GPTConfig(64, 2, 4, vocab=512, context=64),
    "small": GPTConfig(768, 12, 12),  # GPT-2 small
    "medium": GPTConfig(1024, 24, 16),
}


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.c_attn = nn.Linear(c.d_model, 3 * c.d_model)
        self.c_proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.d_model), Attention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.d_model), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(c.vocab, c.d_model),
            "wpe": nn.Embedding(c.context, c.d_model),
            "h": nn.ModuleList(Block(c) for _ in range(c.layers)),
            "ln_f": nn.LayerNorm(c.d_model),
        })  # fmt: skip
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.loss = nn.CrossEntropyLoss()  # a module, so perfloop.patch can swap in its fused one
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return self.loss(logits.flatten(0, 1), targets.flatten())  # fp32 under autocast


def analytic_flops(c: GPTConfig, model: nn.Module, batch: int, context: int) -> float:
    """FLOPs of one training step by the usual count: 6 x parameters x tokens (the position
    embeddings do no arithmetic) plus causal attention: forward QK^T and PV (4 x S^2 x d per
    layer, half the score matrix computed), backward 2.5x the forward (five matmuls)."""
    params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    tokens = batch * context
    causal = (context + 1) / (2 * context)
    attention = 3.5 * 4 * batch * context * context * c.d_model * c.layers * causal
    return 6 * params * tokens + attention


def make_step(c: GPTConfig, batch: int, device: str, compile_model: bool = False, seed: int = 0):
    """(model, step, batch of tokens): one training step under bf16 autocast on a GPU (fp32 on
    a CPU) with AdamW (fused on a GPU)."""
    torch.manual_seed(seed)
    model = GPT(c).to(device)
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    fwd = torch.compile(model) if compile_model else model
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.randint(0, c.vocab, (batch, c.context + 1), device=device, generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        return loss

    return model, step, (x, y)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = SIZES[a.size]
    model, step, _ = make_step(c, a.batch, device, a.compile)
    print(f"{a.size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}")
    for i in range(a.steps):
        t0 = time.perf_counter()
        with pl.annotate("step"):
            loss = step()
        if i % 5 == 0 or i == a.steps - 1:
            print(f"step {i}: loss {loss.item():.3f}, {(time.perf_counter() - t0) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
