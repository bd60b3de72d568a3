"""lm-step: a pre-norm Transformer language model's forward, forward + backward and full
AdamW step, fp32 against bf16 autocast, at the sizes of Stanford CS336's systems assignment."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from perfloop.analysis.annotate import annotate
from perfloop.analysis.profiling import profile
from perfloop.experiments._common import device, finish, ms, plot_bars
from perfloop.harness.measurement import parse_ms
from perfloop.harness.timing import bench


@dataclass(frozen=True)
class LMConfig:
    d_model: int
    d_ff: int
    layers: int
    heads: int
    vocab: int = 10_000


SIZES = {
    "small": LMConfig(768, 3072, 12, 12),
    "medium": LMConfig(1024, 4096, 24, 16),
    "large": LMConfig(1280, 5120, 36, 20),
    "xl": LMConfig(1600, 6400, 48, 25),
    "2.7B": LMConfig(2560, 10240, 32, 32),
    "tiny": LMConfig(64, 256, 2, 4, vocab=1000),  # for a CPU
}


class Block(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = nn.RMSNorm(c.d_model), nn.RMSNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.w1 = nn.Linear(c.d_model, c.d_ff, bias=False)  # SwiGLU
        self.w3 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=False)

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with annotate("attention/scores"):
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)  # (B, nh, T, T)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        with annotate("attention/softmax"):
            p = torch.softmax(s, dim=-1)
        with annotate("attention/output"):
            y = (p @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LM(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _measure(fn, dev):
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    m = bench(fn, flush_l2=False, budget_s=2.0, min_samples=5, warmup_s=0.0)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    return m, peak


def _run_size(c: LMConfig, precision: str, dev: str, batch: int, context: int, snapshot) -> dict:
    model = LM(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, c.vocab, (batch, context), device=dev)
    tgt = torch.randint(0, c.vocab, (batch, context), device=dev)
    bf16 = precision != "fp32"

    def loss():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            return F.cross_entropy(model(idx).flatten(0, 1).float(), tgt.flatten())

    def fwd():
        with torch.no_grad():
            loss()

    def fwd_bwd():
        loss().backward()

    def step():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    out = {}
    for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd), ("AdamW step", step)):
        m, peak = _measure(fn, dev)
        out[what] = (m.median_ms, peak)
    if snapshot and dev == "cuda":
        profile(step, memory_snapshot=snapshot)
    return out


def lm_step(quick=False, store=None, run_id=None, out_dir=None, context: int = 256, memory_snapshot=None):
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"--context: must be a positive integer, got {context!r}")
    dev = device()
    names = (
        (["small", "medium"] if quick else ["small", "medium", "large", "xl", "2.7B"])
        if dev == "cuda"
        else ["tiny"]
    )
    batch = 4
    rows, results = [], {}
    for name in names:
        for precision in ("fp32", "bf16 autocast"):
            try:
                out = _run_size(
                    SIZES[name],
                    precision,
                    dev,
                    batch,
                    context,
                    memory_snapshot if name == names[0] and precision == "fp32" else None,
                )
                results[(name, precision)] = out
                for what, (t, peak) in out.items():
                    rows.append([name, precision, what, ms(t), f"{peak / 2**30:.2f} GiB" if peak else "-"])
            except torch.cuda.OutOfMemoryError:
                rows.append([name, precision, "does not fit in memory", "-", "-"])
            finally:
                if dev == "cuda":
                    torch.cuda.empty_cache()
    parts = []
    for name in names:
        a, b = results.get((name, "fp32")), results.get((name, "bf16 autocast"))
        if a and b:
            speed = a["AdamW step"][0] / b["AdamW step"][0]
            bwd = a["forward+backward"][0] / a["forward"][0]
            parts.append(
                f"{name}: a bf16-autocast AdamW step runs {speed:.2f}x as fast as fp32; "
                f"forward + backward costs {bwd:.1f}x a forward"
            )
    conclusion = "; ".join(parts) or "no size fit in memory"
    plots = plot_lm_step(rows, Path(out_dir or "."))
    return finish(
        "lm-step",
        ["size", "precision", "what", "median", "peak memory"],
        rows,
        f"batch {batch}, context {context}: {conclusion}",
        plots,
        store,
        run_id,
    )


def plot_lm_step(rows, out: Path) -> list[str]:
    """Time per pass and size, fp32 against bf16 autocast; the AdamW step's peak memory."""
    times: dict = {}
    memory: dict = {}
    for size, precision, what, median, peak in rows:
        t = parse_ms(median)
        if t is None:  # "does not fit in memory"
            continue
        times.setdefault(f"{size} {what}", {})[precision] = t
        if what == "AdamW step" and str(peak).endswith("GiB"):
            memory.setdefault(size, {})[precision] = float(str(peak).split()[0])
    plots = [
        plot_bars(out / "lm_step_time.png", "LM: forward, forward + backward, AdamW step", "ms (log)", times)
    ]
    if memory:
        plots.append(
            plot_bars(
                out / "lm_step_memory.png", "LM: peak memory of an AdamW step", "GiB", memory, log=False
            )
        )
    return plots
