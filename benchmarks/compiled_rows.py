"""Issue 39, item 4: a compiled GPT-2 step's kernels as rows. Profiles examples/nanogpt_bench.py
with --compile=True as `perfloop profile --script` does (default steps) and reports the share of
device time placed in the model's modules, in the optimizer, and left unplaced; each kernel (op
row) above 1% of the step with its bound, fused ops and place; and what this torch records.

    PYTHONPATH=src python3 benchmarks/compiled_rows.py OUT.json [-- ARGS for nanogpt_bench.py]
"""

import inspect
import json
import sys
from pathlib import Path

import torch

from perfloop.analysis.attribution import NO_MODULE
from perfloop.analysis.inductor import COMPILED_OP
from perfloop.workflows.script import profile_script

ROOT = Path(__file__).resolve().parent.parent
UNPLACED = {NO_MODULE, "_orig_mod"}


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[3:] if len(sys.argv) > 2 and sys.argv[2] == "--" else []
    p = profile_script(ROOT / "examples" / "nanogpt_bench.py", ["--compile=True", *args], exit_after=True)
    modules = p.breakdown(by="module")
    total = sum(r.device_ms for r in modules) or 1e-12
    share = {
        "modules": sum(r.device_ms for r in modules if r.name not in UNPLACED | {"optimizer"}) / total,
        "optimizer": sum(r.device_ms for r in modules if r.name == "optimizer") / total,
        "unplaced": sum(r.device_ms for r in modules if r.name in UNPLACED) / total,
    }
    ops = p.breakdown(by="op")
    big = [r for r in ops if r.share > 0.01]
    rows = [
        {
            "name": r.name,
            "share": round(r.share, 4),
            "ms_per_step": r.device_ms / p.calls,
            "bound": str(r.bound) if r.bound else None,
            "gbps": r.gbps,
            "tflops": r.tflops,
            "note": r.note,
        }
        for r in ops[:25]
    ]
    from torch.autograd.profiler_util import FunctionEvent

    probe = {
        "torch": torch.__version__,
        "profiler_records_dtypes": "input_dtypes" in inspect.signature(FunctionEvent.__init__).parameters,
        "graphs_with_provenance": sum(
            1 for m in p.compile_metrics or () if getattr(m, "inductor_provenance", None)
        ),
        "compiled_kernel_items": sum(1 for i in p.items() if i.op.startswith(COMPILED_OP + " ")),
    }
    unplaced_items = sorted({(i.kernel, i.op, i.phase) for i in p.items() if i.module in UNPLACED})[:15]
    result = {
        "unplaced_items": unplaced_items,
        "step_ms": p.wall_ms_per_call,
        "device_ms": p.device_ms_per_call,
        "share": share,
        "kernels_above_1pct": len(big),
        "kernels_above_1pct_with_bound": sum(1 for r in big if r.bound is not None),
        "without_bound": [r.name for r in big if r.bound is None],
        "modules": [
            {"name": r.name, "share": round(r.share, 4), "bound": str(r.bound) if r.bound else None}
            for r in modules[:20]
        ],
        "ops": rows,
        "probe": probe,
        "findings": [f"{f.title} ({f.kind})" for f in p.diagnose().findings],
    }
    out.write_text(json.dumps(result, indent=1, default=str))
    said = ("step_ms", "share", "kernels_above_1pct", "without_bound", "probe")
    print(json.dumps({k: result[k] for k in said}, indent=1, default=str))


if __name__ == "__main__":
    main()
