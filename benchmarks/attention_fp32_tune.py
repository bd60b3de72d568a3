"""fp32 attention's tiles (tf32x3 dots, TF32 off): each kernel's configs timed against SDPA in
fp32, head dims 64 and 128, causal, 1000 and 4096 tokens. Writes attention-fp32-tune.json.

    PYTHONPATH=src python3 benchmarks/attention_fp32_tune.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch

from perfloop.ops.attention import tuning

SPACE = {
    "fwd": [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3),
            (128, 32, 8, 2), (32, 32, 4, 3)],
    "dkdv": [(32, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2), (16, 64, 4, 2), (64, 32, 4, 2)],
    "dq": [(64, 32, 4, 2), (64, 64, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2)],
}  # fmt: skip
CASES = [(4, 16, t, t, d, True) for d in (64, 128) for t in (1000, 4096)]

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out")
    out.mkdir(parents=True, exist_ok=True)
    tuning.SPACE = SPACE
    got = tuning.tune(cases=CASES, budget_s=0.2, write=False, dtype=torch.float32)
    (out / "attention-fp32-tune.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                              "rows": got["rows"]}, indent=1))  # fmt: skip
    for r in got["rows"]:
        print(r)
