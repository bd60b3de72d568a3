"""A Llama built from its config (no weights downloaded) generating text the way transformers'
docs call it: `model.generate(input_ids, max_new_tokens=N)` under torch.inference_mode, greedy
(or, with --sample, do_sample=True with top_k), with the default dynamic KV cache (or, with
--static, cache_implementation="static"), over a few random prompts. bf16 weights on CUDA, fp32
on the CPU. Imports nothing of perfloop.

    python examples/battery/hf_generate.py                           # tiny: 2 layers of dim 64
    python examples/battery/hf_generate.py --size real --static      # 8 layers of dim 1024, bf16
"""

import argparse
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {
    "tiny": dict(layers=2, dim=64, ffn=128, heads=4, vocab=256, prompt=8, new_tokens=16, prompts=3),
    "real": dict(layers=8, dim=1024, ffn=2816, heads=16, vocab=32000, prompt=128, new_tokens=128, prompts=4),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
parser.add_argument("--sample", action="store_true", help="sample (do_sample=True, top_k=50)")
parser.add_argument("--static", action="store_true", help='cache_implementation="static"')
args = parser.parse_args()
size = SIZES[args.size]

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=size["vocab"],
    hidden_size=size["dim"],
    intermediate_size=size["ffn"],
    num_hidden_layers=size["layers"],
    num_attention_heads=size["heads"],
    num_key_value_heads=size["heads"],
    max_position_embeddings=size["prompt"] + size["new_tokens"],
    # no end-of-sequence token: random weights would stop at it after any number of tokens
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=0,
)
model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()

generate_kwargs = dict(max_new_tokens=size["new_tokens"], do_sample=args.sample)
if args.sample:
    generate_kwargs.update(top_k=50)
if args.static:
    generate_kwargs.update(cache_implementation="static")

prompts = torch.randint(1, size["vocab"], (size["prompts"], 1, size["prompt"]), device=device)
with torch.inference_mode():
    for i, input_ids in enumerate(prompts):
        t0 = time.perf_counter()
        output_ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
        new_tokens = output_ids[0, input_ids.shape[1] :]
        print(f"prompt {i}: {new_tokens.numel()} tokens in {time.perf_counter() - t0:.2f} s")
print("done: last tokens", new_tokens[-8:].tolist())
