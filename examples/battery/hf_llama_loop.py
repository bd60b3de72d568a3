"""A Llama built from its config (no weights downloaded), trained with the plain PyTorch loop of
transformers' docs ("Fine-tune a pretrained model in native PyTorch"): a DataLoader of dicts,
`outputs = model(**batch)`, `outputs.loss.backward()`, AdamW and get_scheduler. Random tokens
stand in for the data set; bf16 autocast on CUDA, fp32 on the CPU. Imports nothing of perfloop.

    python examples/battery/hf_llama_loop.py                 # tiny: 2 layers of dim 64, CPU-sized
    python examples/battery/hf_llama_loop.py --size real     # 8 layers of dim 1024, bf16 autocast
"""

import argparse
import os

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

SIZES = {
    "tiny": dict(layers=2, dim=64, ffn=128, heads=4, vocab=256, seq=32, batch=4, steps=12),
    "real": dict(layers=8, dim=1024, ffn=2816, heads=16, vocab=32000, seq=1024, batch=8, steps=60),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
parser.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
args = parser.parse_args()
size = SIZES[args.size]
steps = args.steps or size["steps"]

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=size["vocab"],
    hidden_size=size["dim"],
    intermediate_size=size["ffn"],
    num_hidden_layers=size["layers"],
    num_attention_heads=size["heads"],
    num_key_value_heads=size["heads"],
    max_position_embeddings=size["seq"],
)
model = LlamaForCausalLM(config)

# random tokens as a dataset of dicts: the labels are the inputs (the model shifts them itself)
tokens = torch.randint(0, size["vocab"], (steps * size["batch"], size["seq"]))
train_dataset = [{"input_ids": t, "labels": t} for t in tokens]
train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=size["batch"])

optimizer = AdamW(model.parameters(), lr=5e-5)
num_epochs = 1
num_training_steps = num_epochs * len(train_dataloader)
lr_scheduler = get_scheduler(
    name="linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=num_training_steps
)

device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
model.to(device)

model.train()
for epoch in range(num_epochs):
    for step, batch in enumerate(train_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            outputs = model(**batch)
        loss = outputs.loss
        loss.backward()

        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        if step % 4 == 0:
            print(f"epoch {epoch} step {step}: loss {loss.item():.4f}")
print(f"done: {num_training_steps} steps, last loss {loss.item():.4f}")
