"""Where pl.patch's own time goes on examples/llama_train.py's model (8 layers of dim 1024,
batch 16 x 1024, bf16 autocast on a GPU): the call tune's patch candidate makes at the model's
first forward, under cProfile, its top entries by cumulative and by own time.

    PYTHONPATH=src:examples python3 benchmarks/tune/patch_setup.py [--dim=64 --n_layers=2 ...]
"""

import ast
import cProfile
import pstats
import sys
import time
from contextlib import nullcontext

import torch
from llama_model import ModelArgs, Transformer

from perfloop.nn.patch import patch

cfg = {"dim": 1024, "n_layers": 8, "n_heads": 16, "batch_size": 16, "max_seq_len": 1024}
for arg in sys.argv[1:]:
    key, value = arg.removeprefix("--").split("=", 1)
    cfg[key] = ast.literal_eval(value)
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1337)
model = Transformer(
    ModelArgs(
        dim=cfg["dim"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        vocab_size=32000,
        multiple_of=256,
        max_seq_len=cfg["max_seq_len"],
    )
).to(device)
x = torch.randint(32000, (cfg["batch_size"], cfg["max_seq_len"]), device=device)
ctx = torch.autocast(device_type=device, dtype=torch.bfloat16) if device == "cuda" else nullcontext()
for attempt in ("first", "second"):  # the second: kernels and builds cached on disk and in the process
    fresh = Transformer(model.params).to(device)
    fresh.load_state_dict(model.state_dict())
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with ctx:
        prof.enable()
        report = patch(fresh, (x, torch.roll(x, -1, dims=1)))
        prof.disable()
    print(f"== {attempt} pl.patch: {time.perf_counter() - t0:.1f} s, replaced {len(report.replaced)}")
    stats = pstats.Stats(prof)
    for key in ("cumulative", "tottime"):
        stats.sort_stats(key).print_stats(22)
