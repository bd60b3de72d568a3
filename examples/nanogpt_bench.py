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
import sys
import time
from ast import literal_eval

import torch
from nanogpt_model import GPT, GPTConfig

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
