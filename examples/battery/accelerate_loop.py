"""A BERT classifier built from its config (no weights downloaded), trained the way accelerate's
nlp_example.py does: `Accelerator()`, `accelerator.prepare(model, optimizer, dataloader,
scheduler)`, `accelerator.backward(loss)`. Random tokens and labels stand in for the data set;
mixed_precision="bf16" on CUDA, none on the CPU. Imports nothing of perfloop.

    python examples/battery/accelerate_loop.py                 # tiny: 2 layers of dim 64
    python examples/battery/accelerate_loop.py --size real     # BERT base, seq 512, bf16
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

SIZES = {
    "tiny": dict(layers=2, dim=64, heads=4, vocab=256, seq=32, batch=4, steps=12),
    "real": dict(layers=12, dim=768, heads=12, vocab=30522, seq=512, batch=32, steps=60),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
parser.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
args = parser.parse_args()
size = SIZES[args.size]
steps = args.steps or size["steps"]

accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
set_seed(0)
config = BertConfig(
    vocab_size=size["vocab"],
    hidden_size=size["dim"],
    num_hidden_layers=size["layers"],
    num_attention_heads=size["heads"],
    intermediate_size=4 * size["dim"],
    max_position_embeddings=size["seq"],
    num_labels=2,
)
model = BertForSequenceClassification(config)

tokens = torch.randint(0, size["vocab"], (steps * size["batch"], size["seq"]))
labels = torch.randint(0, 2, (steps * size["batch"],))
train_dataset = [
    {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": y}
    for t, y in zip(tokens, labels, strict=True)
]
train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=size["batch"])

optimizer = AdamW(params=model.parameters(), lr=2e-5)
lr_scheduler = get_linear_schedule_with_warmup(
    optimizer=optimizer, num_warmup_steps=2, num_training_steps=len(train_dataloader)
)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, lr_scheduler
)

model.train()
for step, batch in enumerate(train_dataloader):
    outputs = model(**batch)
    loss = outputs.loss
    accelerator.backward(loss)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    if step % 4 == 0:
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
accelerator.print(f"done: {len(train_dataloader)} steps, last loss {loss.item():.4f}")
