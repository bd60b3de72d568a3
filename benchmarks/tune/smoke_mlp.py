"""A small MLP trained with AdamW: tune's smoke test on a machine (`scripts/gpu-tune smoke`)."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1337)
model = nn.Sequential(
    nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 10)
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(4096, 512, device=device)
y = (x[:, :10] * 3).argmax(1)
for _ in range(300):
    idx = torch.randint(0, 4096, (256,), device=device)
    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
