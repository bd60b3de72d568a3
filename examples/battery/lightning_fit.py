"""A small GPT-style language model in a LightningModule, fitted the way Lightning's docs write
it: `training_step` returns the loss, `configure_optimizers` returns the optimizer, and
`L.Trainer(max_steps=...).fit(model, dataloader)`. Random tokens stand in for the data set;
bf16-mixed precision on CUDA, fp32 on the CPU. Imports nothing of perfloop.

    python examples/battery/lightning_fit.py                 # tiny: 2 layers of dim 64
    python examples/battery/lightning_fit.py --size real     # 8 layers of dim 1024, bf16-mixed
"""

import argparse
import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SIZES = {
    "tiny": dict(layers=2, dim=64, heads=4, vocab=256, seq=32, batch=4, steps=12),
    "real": dict(layers=8, dim=1024, heads=16, vocab=32000, seq=1024, batch=8, steps=60),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
parser.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
args = parser.parse_args()
size = SIZES[args.size]
steps = args.steps or size["steps"]


class LanguageModel(L.LightningModule):
    def __init__(self, vocab, dim, heads, layers, seq):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal_mask, is_causal=True)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        if batch_idx % 4 == 0:
            print(f"step {batch_idx}: loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


L.seed_everything(0, verbose=False)
model = LanguageModel(size["vocab"], size["dim"], size["heads"], size["layers"], size["seq"])
tokens = torch.randint(0, size["vocab"], (steps * size["batch"], size["seq"] + 1))
dataloader = DataLoader(TensorDataset(tokens), batch_size=size["batch"], shuffle=True)

trainer = L.Trainer(
    max_steps=steps,
    accelerator="auto",
    devices=1,
    precision="bf16-mixed" if torch.cuda.is_available() else "32-true",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, dataloader)
print(f"done: {trainer.global_step} steps, last loss {trainer.callback_metrics['train_loss'].item():.4f}")
