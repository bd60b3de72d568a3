"""A Llama built from its config (no weights downloaded), trained by `transformers.Trainer` as
its docs set one up: TrainingArguments with max_steps, no evaluation, no saving, no reporting,
the output folder a temporary one. Random tokens stand in for the data set; bf16 on CUDA, fp32
on the CPU. Imports nothing of perfloop.

    python examples/battery/hf_trainer.py                 # tiny: 2 layers of dim 64, CPU-sized
    python examples/battery/hf_trainer.py --size real     # 8 layers of dim 1024, bf16
"""

import argparse
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

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

with tempfile.TemporaryDirectory() as output_dir:
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=size["batch"],
        learning_rate=5e-5,
        logging_steps=4,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    result = trainer.train()
print(f"done: {result.global_step} steps, training loss {result.training_loss:.4f}")
