"""A decode loop the way gpt-fast's generate.py writes it, on the gpt-fast-style Llama of
examples/llama_decode.py with random weights: a static KV cache set up for the whole sequence,
the prompt prefilled, then `decode_one_token(model, x, input_pos)` once per new token under
torch.no_grad, greedy. No range marks a token's call and there is no optimizer: perfloop must
find the steps itself. bf16 weights on CUDA, fp32 on the CPU.

    python examples/battery/gptfast_decode.py                 # tiny: 2 layers of dim 64
    python examples/battery/gptfast_decode.py --size real     # 8 layers of the 7B shape, bf16
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, where llama_decode.py is
from llama_decode import ModelArgs, Transformer, decode_one_token, prefill

SIZES = {
    "tiny": dict(layers=2, dim=64, heads=4, vocab=512, prompt=8, new_tokens=32, samples=2),
    "real": dict(layers=8, dim=4096, heads=32, vocab=32000, prompt=16, new_tokens=128, samples=3),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
args = parser.parse_args()
size = SIZES[args.size]


def decode_n_tokens(model, cur_token, input_pos, num_new_tokens):
    new_tokens = []
    for _ in range(num_new_tokens):
        next_token = decode_one_token(model, cur_token, input_pos)
        input_pos += 1
        new_tokens.append(next_token.clone())
        cur_token = next_token.clone()
    return new_tokens


@torch.no_grad()
def generate(model, prompt, max_new_tokens):
    batch_size, T = prompt.shape
    T_new = T + max_new_tokens
    seq = torch.empty(batch_size, T_new, dtype=prompt.dtype, device=prompt.device)
    seq[:, :T] = prompt
    input_pos = torch.arange(0, T, device=prompt.device)
    next_token = prefill(model, prompt, input_pos).clone()
    seq[:, T] = next_token.squeeze(-1)
    input_pos = torch.tensor([T], device=prompt.device, dtype=torch.int)
    generated_tokens = decode_n_tokens(model, next_token, input_pos, max_new_tokens - 1)
    seq[:, T + 1 :] = torch.cat(generated_tokens, dim=-1)
    return seq


device = "cuda" if torch.cuda.is_available() else "cpu"
precision = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(1234)
config = ModelArgs(vocab_size=size["vocab"], n_layer=size["layers"], n_head=size["heads"], dim=size["dim"])
with torch.device(device):
    model = Transformer(config)
model = model.to(dtype=precision).eval()
model.setup_caches(1, size["prompt"] + size["new_tokens"])
model_size = sum(p.numel() * p.element_size() for p in model.parameters())

prompt = torch.randint(0, config.vocab_size, (1, size["prompt"]), device=device)
for i in range(size["samples"]):
    t0 = time.perf_counter()
    y = generate(model, prompt, size["new_tokens"])
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter() - t0
    tokens_sec = size["new_tokens"] / t
    print(f"Time for inference {i + 1}: {t:.02f} sec total, {tokens_sec:.02f} tokens/sec")
    print(f"Bandwidth achieved: {model_size * tokens_sec / 1e9:.02f} GB/s")
print("done: last tokens", y[0, -8:].tolist())
