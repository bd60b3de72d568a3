"""What refusing out-of-range targets costs the fused losses (issue 22): the cross entropy's
forward + backward with the target check and without it, timed interleaved, at GPT-2's loss
size (device time) and at a small size (where the host's time per call is what shows).

    PYTHONPATH=src python3 benchmarks/experiments/target_check_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import perfloop.ops.cross_entropy.triton_impl as ce
from perfloop.device import env_fingerprint
from perfloop.harness.timing import compare


def step(logits, target, checked: bool):
    def run():
        saved = ce.assert_targets  # the kernels' flag store stays (it writes only on a bad target)
        if not checked:
            ce.assert_targets = lambda ok: None
        try:
            loss = ce.CrossEntropyFunction.apply(logits, target, -100)
            loss.backward()
        finally:
            ce.assert_targets = saved
        logits.grad = None

    return run


def host_us(fn, calls: int) -> float:
    """Wall time per call of `calls` calls in a row, synchronized once: the host's time per call
    where the kernels are too small to keep the GPU the slower side."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"device": env_fingerprint()}
    for label, (n, v) in {"gpt2_loss": (16384, 50304), "small": (64, 1000)}.items():
        logits = (3 * torch.randn(n, v, generator=g, device="cuda")).bfloat16().requires_grad_()
        target = torch.randint(0, v, (n,), generator=g, device="cuda")
        fns = {"unchecked": step(logits, target, False), "checked": step(logits, target, True)}
        c = compare(fns, baseline="unchecked", budget_s=3.0)
        s = c.speedups["checked"]
        out[label] = {
            "shape": [n, v],
            "unchecked_ms": c.measurements["unchecked"].median_ms,
            "checked_ms": c.measurements["checked"].median_ms,
            "time_ratio_checked_over_unchecked": 1 / s.speedup,
            "ci_of_speedup": s.ci,
            "significant": s.significant,
            "host_us_unchecked": host_us(fns["unchecked"], 300),
            "host_us_checked": host_us(fns["checked"], 300),
        }
        print(label, json.dumps(out[label]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "target_check_cost.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
