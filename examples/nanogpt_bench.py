"""A GPT-2 benchmark script written the way popular open-source training code writes one: the
model (a LayerNorm class over F.layer_norm with an optional bias, weight tying, nn.GELU(), the
loss by F.cross_entropy inside forward) and a loop that reads its `--key=value` options from
sys.argv itself and steps torch.profiler with a schedule when asked. It imports nothing of
perfloop: `perfloop profile --script examples/nanogpt_bench.py --profile=True` finds its steps
by their optimizer.step() calls.

    python examples/nanogpt_bench.py                                  # GPT-2 small on a GPU
    python examples/nanogpt_bench.py --n_layer=2 --n_embd=64 --block_size=64 --batch_size=4
"""

import contextlib
import math
import sys
import time
from ast import literal_eval
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = False


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


# -----------------------------------------------------------------------------
batch_size = 12
block_size = 1024
n_layer, n_head, n_embd, vocab_size = 12, 12, 768, 50304
bias = False
real_steps = 30
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile = False
profile = False  # use pytorch profiler, or just simple benchmarking?
trace_dir = "./bench_log"
for arg in sys.argv[1:]:  # --key=value, as a configurator does
    key, val = arg[2:].split("=", 1)
    if key not in globals():
        raise ValueError(f"Unknown config key: {key}")
    with contextlib.suppress(SyntaxError, ValueError):  # a bare word stays a string
        val = literal_eval(val)
    globals()[key] = val
# -----------------------------------------------------------------------------

torch.manual_seed(seed)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = (
    torch.autocast(device_type=device_type, dtype=ptdtype)
    if device_type == "cuda"
    else torch.autocast("cpu", enabled=False)
)


def get_batch():  # random tokens: no data set to read
    x = torch.randint(vocab_size, (batch_size, block_size), device=device)
    y = torch.randint(vocab_size, (batch_size, block_size), device=device)
    return x, y


gptconf = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=bias,
                    vocab_size=vocab_size)  # fmt: skip
model = GPT(gptconf).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                              fused=device_type == "cuda")  # fmt: skip
if compile:
    print("Compiling model...")
    model = torch.compile(model)

if profile:
    wait, warmup, active = 5, 1, 2
    num_steps = wait + warmup + active
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if device_type == "cuda" else []),
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=False,
        profile_memory=False,
        with_stack=False,
    ) as prof:
        X, Y = get_batch()
        for k in range(num_steps + real_steps):
            with ctx:
                logits, loss = model(X, Y)
            X, Y = get_batch()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lossf = loss.item()
            print(f"{k}/{num_steps + real_steps} loss: {lossf:.4f}")
            prof.step()
else:
    if device_type == "cuda":
        torch.cuda.synchronize()
    for stage, num_steps in enumerate([10, real_steps]):  # burnin, then benchmark
        t0 = time.time()
        X, Y = get_batch()
        for k in range(num_steps):
            with ctx:
                logits, loss = model(X, Y)
            X, Y = get_batch()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lossf = loss.item()
            print(f"{k}/{num_steps} loss: {lossf:.4f}")
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        if stage == 1:
            print(f"time per iteration: {dt / num_steps * 1000:.4f}ms")
