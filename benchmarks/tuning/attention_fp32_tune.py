"""fp32 attention's tiles (tf32x3 dots, TF32 off): each kernel's configs timed against SDPA in
fp32, head dims 64 and 128, causal, 1000 and 4096 tokens. Writes attention-fp32-tune.json.

    PYTHONPATH=src python3 benchmarks/tuning/attention_fp32_tune.py OUT_DIR [--fwd] [--dims D ...] \
        [--tokens T ...]

`--fwd`: the forward's configs only; `--dims` / `--tokens` pick the cases (default 64 128 / 1000 4096).
"""

import argparse
import json
from pathlib import Path

import torch

from perfloop.ops.attention import tuning

SPACE = {
    "fwd": [
        (64, 64, 4, 2),
        (64, 32, 4, 2),
        (32, 64, 4, 2),
        (64, 64, 8, 2),
        (128, 64, 8, 2),
        (64, 32, 4, 3),
        (128, 32, 8, 2),
        (32, 32, 4, 3),
        (32, 32, 4, 2),
        (64, 32, 8, 2),
    ],
    "dkdv": [(32, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2), (16, 64, 4, 2), (64, 32, 4, 2)],
    "dq": [(64, 32, 4, 2), (64, 64, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2)],
}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="out")
    ap.add_argument("--fwd", action="store_true", help="the forward's configs only")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4096])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tuning.SPACE = SPACE
    cases = [(4, 16, t, t, d, True) for d in args.dims for t in args.tokens]
    kinds = ("fwd",) if args.fwd else ("fwd", "dkdv", "dq")
    got = tuning.tune(kinds=kinds, cases=cases, budget_s=0.2, write=False, dtype=torch.float32)
    (out / "attention-fp32-tune.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": got["rows"]}, indent=1)
    )
    for r in got["rows"]:
        print(r)
