"""An image classifier from timm, built from its config (pretrained=False), trained the way
timm's train.py does: `timm.create_model`, `create_optimizer_v2(opt="sgd")`, the forward and the
loss under bf16 autocast, `loss.backward(); optimizer.step(); optimizer.zero_grad()`. Random
images and labels stand in for the data set. GPU-sized (timm needs torchvision); on a CPU the
tiny size runs a ResNet-18 / ViT-Tiny in fp32. Imports nothing of perfloop.

    python examples/battery/timm_train.py --size real              # ResNet-50, 224x224, bf16
    python examples/battery/timm_train.py --size real --model vit  # ViT-B/16, 224x224, bf16
"""

import argparse
import os

import timm
import torch
import torch.nn as nn
from timm.optim import create_optimizer_v2
from torch.utils.data import DataLoader, TensorDataset

SIZES = {
    "tiny": dict(resnet="resnet18", vit="vit_tiny_patch16_224", image=64, batch=4, steps=12),
    "real": dict(resnet="resnet50", vit="vit_base_patch16_224", image=224, batch=128, steps=60),
}
parser = argparse.ArgumentParser()
parser.add_argument("--size", choices=SIZES, default=os.environ.get("BATTERY_SIZE", "tiny"))
parser.add_argument("--model", choices=["resnet", "vit"], default="resnet")
parser.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
args = parser.parse_args()
size = SIZES[args.size]
steps = args.steps or size["steps"]

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
kwargs = dict(img_size=size["image"]) if args.model == "vit" else {}
model = timm.create_model(size[args.model], pretrained=False, num_classes=1000, **kwargs).to(device)
optimizer = create_optimizer_v2(model, opt="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
loss_fn = nn.CrossEntropyLoss()

images = torch.randn(steps * size["batch"], 3, size["image"], size["image"])
targets = torch.randint(0, 1000, (steps * size["batch"],))
loader = DataLoader(TensorDataset(images, targets), batch_size=size["batch"], shuffle=True)

model.train()
for batch_idx, (input, target) in enumerate(loader):
    input, target = input.to(device), target.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        output = model(input)
        loss = loss_fn(output, target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if batch_idx % 4 == 0:
        print(f"step {batch_idx}: loss {loss.item():.4f}")
print(f"done: {steps} steps, last loss {loss.item():.4f}")
