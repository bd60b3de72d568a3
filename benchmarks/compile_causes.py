"""Planted compile problems (issue 39): a stack of transformer-style MLP blocks trained under
torch.compile, written as people write it, with one problem planted at a time. Each planted
script is profiled unchanged (`profile_script`, default steps); its first finding gives the
predicted saving; the problem and the fixed script (the advice applied by hand) are then run
plainly, timing each step: the realized saving is the difference of their step times, over the
steps the profile would analyse (3-7: where recompiles happen) or steady ones (10-30).

    PYTHONPATH=src python3 benchmarks/compile_causes.py --out DIR [--small] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = """
import json, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

plant, fixed, out, small = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4] == "1"
dev = "cuda" if torch.cuda.is_available() else "cpu"
d = 64 if small or plant == "small" else 1024
batch, length = (4, 16) if small or plant == "small" else (16, 512)
if not small and plant in ("none", "none-wide"):  # controls the GPU, not the host, paces
    d, batch, length = (2048, 16, 1024) if plant == "none" else (4096, 8, 512)
if plant == "fp32" and fixed:
    torch.set_float32_matmul_precision("high")  # the advice: TF32 for fp32 matmuls


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.step = 0  # a schedule's counter, set from the loop
        self.register_buffer("step_t", torch.zeros(()))

    def forward(self, x):
        h = self.fc(self.ln(x))
        if plant == "scalar":  # a warm-up factor from a Python int on the module
            h = h * (1 + 1 / (1 + (self.step_t if fixed else self.step)))
        if plant == "branch":
            if fixed:
                h = torch.where(h.mean() > 0, h - h.mean(), h)
            elif h.mean() > 0:  # a data-dependent branch
                h = h - h.mean()
        if plant == "item":
            scale = h.abs().max() if fixed else h.abs().max().item()  # read to the host
            h = h / scale
        return x + self.proj(F.gelu(h))


torch.manual_seed(0)
model = nn.Sequential(*[Block(d) for _ in range(4)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
kwargs = {}
if plant == "shape" and not fixed:
    kwargs["dynamic"] = False  # every new length a new graph
if plant == "small" and fixed:
    kwargs["mode"] = "reduce-overhead"  # the advice: CUDA graphs
compiled = torch.compile(model, **kwargs)
amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=plant != "fp32")
marks = []  # each step's end, on the device's clock where there is one (no sync inside the loop)
t0 = time.perf_counter()
for step in range(30):
    n = length + (step if plant == "shape" else 0)  # a new sequence length every step
    x = torch.randn(batch, n, d, device=dev)
    if plant == "shape" and fixed:
        torch._dynamo.mark_dynamic(x, 1)  # the advice: the length is dynamic
    for b in model:
        b.step = step
        b.step_t.fill_(step)
    with amp:
        loss = compiled(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev == "cuda":
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    else:
        marks.append(time.perf_counter())
if dev == "cuda":
    torch.cuda.synchronize()
    times = [marks[0].elapsed_time(marks[0])] + [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
else:
    times = [(b - a) * 1e3 for a, b in zip([t0] + marks, marks)]
json.dump(times, open(out, "w"))
"""

# case -> (plant, the finding kind expected first, a fragment of its title, steps to compare)
CASES = {
    "recompiles: a new length every step (dynamic=False)": ("shape", "recompile", "dim 1", (3, 8)),
    "recompiles: a Python int on the module every step": ("scalar", "recompile", ".step`", (3, 8)),
    # steady steps: a step that compiled (a branch that flips compiles the code after it anew)
    # is one of 20, which the median passes over; steps 2-6 held one in 4 and swung 2x run to run
    "graph break: data-dependent branch": ("branch", "graph break", "data-dependent", (10, 30)),
    "graph break: .item() in forward": ("item", "graph break", "item", (10, 30)),
    "small compiled model, launch-bound (CUDA graphs fix it)": ("small", "launch", "", (10, 30)),
    "compiled model with fp32 matmuls, TF32 off": ("fp32", "precision", "TF32", (10, 30)),
    "control: warm compiled step": ("none", None, "", (10, 30)),
    "control: warm compiled step, wide": ("none-wide", None, "", (10, 30)),
}


CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cold_caches() -> dict:
    """Fresh compile caches (Inductor's, Triton's) for one run: each run compiles as the first
    did, so the profiled run and the plain runs after it pay the same compiles."""
    return {name: tempfile.mkdtemp() for name in CACHES}


def _run(path: str, plant: str, fixed: bool, small: bool) -> list[float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    args = [plant, "1" if fixed else "0", out, "1" if small else "0"]
    env = {**os.environ, **cold_caches()}
    subprocess.run([sys.executable, path, *args], check=True, capture_output=True, env=env)
    with open(out) as f:
        return json.load(f)


def case(name: str, path: str, small: bool, out: str) -> dict:
    import torch

    from perfloop.workflows.script import profile_script

    torch._dynamo.reset()  # the cases run in one process: no case starts on another's graphs or limit
    plant, kind, fragment, (a, b) = CASES[name]
    small_run = small or plant.endswith("-small")
    plant = plant.removesuffix("-small")
    saved = {var: os.environ.get(var) for var in CACHES}
    os.environ.update(cold_caches())
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            p = profile_script(path, [plant, "0", f.name, "1" if small_run else "0"], skip=None, steps=2)
    finally:
        for var, v in saved.items():
            os.environ.pop(var) if v is None else os.environ.update({var: v})
    d = p.diagnose()
    top = d.findings[0] if d.findings else None
    hit = next((f for f in d.findings if kind and f.kind == kind and fragment in f.title), None)
    problem = _run(path, plant, False, small_run)
    fixed = _run(path, plant, True, small_run) if kind else problem
    realized = statistics.median(problem[a:b]) - statistics.median(fixed[a:b])
    with open(os.path.join(out, f"diagnosis_{plant}.txt"), "w") as f:  # what the user was told
        f.write(str(d))
    return {
        "case": name,
        "top": f"{top.kind}: {top.title}" if top else "",
        "top_share": top.share if top else 0.0,
        "first": bool(hit is not None and hit is top),
        "predicted_ms": hit.saves_ms if hit else None,
        "realized_ms": realized,
        "predicted_over_realized": hit.saves_ms / realized if hit and realized > 0 else None,
        "step_ms": statistics.median(problem[a:b]),
        "profiled_steps_ms": p.step_ms,
        "problem_steps_ms": problem,
        "fixed_steps_ms": fixed,
        "where": hit.where if hit else "",
        "causes_above_5pct": [f"{f.kind}: {f.title}" for f in d.findings if f.share > 0.05],
        "advises_compile": [f.title for f in d.findings if "(torch.compile)" in f.advice],
        "compiles_in_steps": len(p.compiles()),
        "syncs": [(op, n, ms) for op, n, ms, _ in (p.idle().syncs if p.idle() else [])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--small", action="store_true")
    ap.add_argument(
        "--only",
        help="the cases whose name holds, or whose plant is, one of these texts, | between (default: all)",
    )
    a = ap.parse_args()
    from perfloop.device import env_fingerprint

    path = os.path.join(tempfile.mkdtemp(), "train.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(SCRIPT))
    rows = []
    os.makedirs(a.out, exist_ok=True)
    for name in CASES:
        if a.only and not any(part in name or part == CASES[name][0] for part in a.only.split("|")):
            continue
        rows.append(case(name, path, a.small, a.out))
        print(json.dumps(rows[-1], default=str), flush=True)
        with open(os.path.join(a.out, "compile_causes.json"), "w") as f:  # each case kept as it ends
            json.dump({"device": env_fingerprint(), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
