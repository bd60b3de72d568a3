"""Train the Llama-style decoder of llama_model.py the way llama2.c's train.py runs: settings as
module globals overridden by `--key=value`, bf16 autocast on a GPU, gradient accumulation, a
GradScaler (enabled only for fp16), AdamW fused where CUDA is, gradient clipping, the loss read
from `model.last_loss`. Random tokens stand in for the data set. `compile = False` here (the
training script's switch; perfloop tune tries compile itself). Imports nothing of perfloop.

    python examples/llama_train.py                                        # 8 layers of dim 1024
    python examples/llama_train.py --dim=64 --n_layers=2 --n_heads=4 --max_seq_len=64 --batch_size=4
"""

import ast
import sys
from contextlib import nullcontext

import torch
from llama_model import ModelArgs, Transformer

batch_size = 16
max_seq_len = 1024
vocab_size = 32000
dim = 1024
n_layers = 8
n_heads = 16
multiple_of = 256
gradient_accumulation_steps = 2
learning_rate = 5e-4
weight_decay = 0.1
grad_clip = 1.0
max_iters = 200
log_interval = 10
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if device == "cuda" else "float32"
compile = False
for arg in sys.argv[1:]:
    key, value = arg.removeprefix("--").split("=", 1)
    globals()[key] = ast.literal_eval(value)

torch.manual_seed(1337)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device == "cpu" else torch.autocast(device_type=device, dtype=ptdtype)

margs = ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size,
                  multiple_of=multiple_of, max_seq_len=max_seq_len)  # fmt: skip
model = Transformer(margs).to(device)
scaler = torch.amp.GradScaler(device, enabled=(dtype == "float16"))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=learning_rate, betas=(0.9, 0.95), fused=device == "cuda",
)  # fmt: skip
if compile:
    model = torch.compile(model)


def get_batch():
    x = torch.randint(vocab_size, (batch_size, max_seq_len), device=device)
    return x, torch.roll(x, -1, dims=1)


X, Y = get_batch()
for it in range(max_iters):
    for _micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits = model(X, Y)
            loss = model.last_loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if it % log_interval == 0:
        print(f"{it} | loss {loss.item() * gradient_accumulation_steps:.4f}")
