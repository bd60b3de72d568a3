"""Train the written-out GPT-2 of mingpt_model.py on random tokens, the way minGPT's trainer loop
runs: AdamW, gradient clipping, a fixed number of iterations, the loss printed every few. It
imports nothing of perfloop: `perfloop profile --script examples/mingpt_train.py --n_layer 2`
finds its steps by their optimizer.step() calls.

    python examples/mingpt_train.py                       # GPT-2 small on a GPU
    python examples/mingpt_train.py --n_layer 2 --n_embd 64 --block_size 64 --batch_size 4
"""

import argparse
import time

import torch
from mingpt_model import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("--n_layer", type=int, default=12)
parser.add_argument("--n_head", type=int, default=12)
parser.add_argument("--n_embd", type=int, default=768)
parser.add_argument("--block_size", type=int, default=1024)
parser.add_argument("--batch_size", type=int, default=12)
parser.add_argument("--max_iters", type=int, default=20)
parser.add_argument("--learning_rate", type=float, default=3e-4)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(3407)
config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
model = GPT(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))
ctx = (
    torch.autocast(device, dtype=torch.bfloat16)
    if device == "cuda"
    else torch.autocast(device, enabled=False)
)

model.train()
t0 = time.time()
for it in range(args.max_iters):
    x = torch.randint(config.vocab_size, (args.batch_size, args.block_size), device=device)
    y = torch.roll(x, -1, dims=1)
    with ctx:
        logits, loss = model(x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if it % 5 == 0:
        t1 = time.time()
        print(f"iter {it}: loss {loss.item():.4f}, {(t1 - t0) * 1000:.1f} ms")
        t0 = t1
