"""Issue 16 on a GPU: a GPT-2-small training step (examples/train_gpt.py, batch 12 x 1024, bf16
autocast, fused AdamW) attributed, counted, ranked -- and what it cost.

    PYTHONPATH=src python3 benchmarks/step_analysis.py OUT_DIR [--size small] [--batch 12]
    PYTHONPATH=src python3 benchmarks/step_analysis.py OUT_DIR --ncu-child   # run by ncu

Writes OUT_DIR/step-analysis.json and .txt; with ncu on PATH, checks the estimated bytes of the
step's top kernels against ncu's DRAM counters (one step replayed kernel by kernel).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from example_models import example

import perfloop as pl
from perfloop.analysis.attribution import NO_MODULE, row_dict, table
from perfloop.analysis.work import total_flops

train_gpt = example("train_gpt")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a dry run of this script
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def _step(a):
    c = train_gpt.SIZES[a.size]
    model, step, _ = train_gpt.make_step(c, a.batch, DEV, a.compile)
    return c, model, step


def _shares(p) -> dict:
    its = p.items()
    total = sum(i.ms for i in its)
    placed = sum(i.ms for i in its if i.module != NO_MODULE and i.op)
    bwd = [i for i in its if i.phase == "backward"]
    bwd_total = sum(i.ms for i in bwd)
    bwd_placed = sum(i.ms for i in bwd if i.module not in (NO_MODULE, "optimizer"))
    return {
        "device_ms": total / p.calls,
        "attributed_share": placed / total if total else 0.0,
        "backward_ms": bwd_total / p.calls,
        "backward_charged_share": bwd_placed / bwd_total if bwd_total else 0.0,
        "unplaced": sorted(
            {
                f"{i.module}|{i.phase}|{i.op or i.kernel[:50]}"
                for i in its
                if i.module == NO_MODULE or not i.op
            }
        )[:20],
    }


def analyse(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    c, model, step = _step(a)
    for _ in range(3):
        step()
    SYNC()
    ceilings = pl.ceilings()
    m = pl.bench(step, budget_s=3.0, flush_l2=False)
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    SYNC()
    plain_ms = (time.perf_counter() - t0) * 1e3 / 5

    calls = 3
    t0 = time.perf_counter()
    p = pl.profile(step, calls=calls, warmup=1)
    t_profile = time.perf_counter() - t0
    modules = p.breakdown("module", depth=4)
    ops = p.breakdown("op")
    cats = p.breakdown("category")
    d = p.diagnose()
    idle = p.idle()
    t_all = time.perf_counter() - t0
    records = [r for r in p._counted[0] if r is not None] if p._counted else []
    est = total_flops(records)
    analytic = train_gpt.analytic_flops(c, model, a.batch, c.context)
    budget = 3 * calls * m.median_ms / 1e3 + 10
    res = {
        "device": pl.device_info(),
        "torch": torch.__version__,
        "size": a.size,
        "batch": a.batch,
        "compiled": a.compile,
        "step_ms_bench": m.median_ms,
        "step_ms_plain": plain_ms,
        "profile_wall_ms_per_call": p.wall_ms_per_call,
        "ceilings": ceilings,
        "analysis_s": t_all,
        "profile_s": t_profile,
        "analysis_budget_s": budget,
        "within_budget": t_all <= budget,
        **_shares(p),
        "flops_estimated": est,
        "flops_analytic": analytic,
        "flops_ratio": est / analytic if analytic else None,
        "modules": [row_dict(r) for r in modules],
        "ops": [row_dict(r) for r in ops],
        "categories": [row_dict(r) for r in cats],
        "idle": idle.__dict__ if idle else None,
        "diagnosis": d.to_dict(),
        "warnings": p.warnings,
    }
    (out / f"step-analysis{a.tag}.json").write_text(json.dumps(res, indent=1, default=str))
    text = "\n\n".join(
        [
            f"{a.size} batch {a.batch}{' compiled' if a.compile else ''}: step {m.median_ms:.2f} ms (bench), "
            f"{plain_ms:.2f} ms (plain); analysis {t_all:.1f} s (budget {budget:.1f} s); "
            f"attributed {res['attributed_share']:.1%}, "
            f"backward charged {res['backward_charged_share']:.1%}; "
            f"FLOPs {est:.4g} vs analytic {analytic:.4g} ({res['flops_ratio']:.4f})",
            table(modules, calls, "module", top=40),
            table(ops, calls, "op", top=30),
            table(cats, calls, "category", top=12),
            str(d),
            "idle: " + (json.dumps(idle.__dict__, default=str) if idle else "none"),
        ]
    )
    (out / f"step-analysis{a.tag}.txt").write_text(text)
    print(text[:3000])
    if a.ncu and shutil.which("ncu"):
        (out / "ncu-estimates.json").write_text(json.dumps(_single_kernel_estimates(p)))
        ncu_check(a, out, p)


def _single_kernel_estimates(p) -> list[tuple[str, float | None, str]]:
    """(kernel, estimated bytes or None, op) for each kernel of the counted call, in order; an
    estimate only where the op launched that one kernel."""
    records, its, _ = p._counted
    per_record = defaultdict(int)
    for i in its:
        for mk in i.markers:
            per_record[mk] += 1
    out = []
    for i in sorted(its, key=lambda i: i.start_us):
        mk = i.markers[0] if i.markers else None
        ok = mk is not None and per_record[mk] == 1 and records[mk] is not None
        out.append((i.kernel, records[mk].bytes if ok else None, i.op))
    return out


def ncu_child(a) -> None:
    """Under ncu (which holds CUPTI, so no torch.profiler here): warm-up steps, then one step
    inside the capture range; the estimates come from the parent's counted step, kernel by
    kernel in launch order."""
    c, model, step = _step(a)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _base(name: str) -> str:
    """A kernel's function name without namespaces, templates or arguments."""
    return name.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "").strip()[:40]


def ncu_check(a, out: Path, p) -> None:
    cmd = [
        "ncu",
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "--csv",
        "--metrics",
        "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,"
        "lts__t_bytes_srcunit_tex_op_write.sum",
        sys.executable,
        __file__,
        str(out),
        "--ncu-child",
        "--size",
        a.size,
        "--batch",
        str(a.batch),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.ncu_timeout, env=dict(os.environ))
    (out / "ncu-stdout.csv").write_text(r.stdout[-2_000_000:])
    (out / "ncu-stderr.txt").write_text(r.stderr[-20_000:])
    kernels: dict = {}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        k = kernels.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
        try:
            v = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # "n/a": a metric this kernel did not report
            continue
        unit = row["Metric Unit"]
        scale = {
            "byte": 1,
            "Kbyte": 1e3,
            "Mbyte": 1e6,
            "Gbyte": 1e9,
            "nsecond": 1,
            "usecond": 1e3,
            "msecond": 1e6,
        }.get(unit, 1)
        k[row["Metric Name"]] = v * scale
    est = (
        json.loads((out / "ncu-estimates.json").read_text()) if (out / "ncu-estimates.json").exists() else []
    )
    seq = [kernels[i] for i in sorted(kernels)]
    # the i-th launch of a kernel in ncu's step is the i-th launch of that kernel in the counted step
    ours, theirs = defaultdict(list), defaultdict(list)
    for n, b, op in est:
        ours[_base(n)].append((n, b, op))
    for k in seq:
        theirs[_base(k["name"])].append(k)
    by = defaultdict(lambda: {"est": 0.0, "dram": 0.0, "moved": 0.0, "ns": 0.0, "n": 0, "op": ""})
    matched = 0
    for base, launches in ours.items():
        for (name, b, op), k in zip(launches, theirs.get(base, []), strict=False):
            matched += 1
            if b is None:
                continue
            g = by[name]
            g["est"] += b
            g["dram"] += k.get("dram__bytes_read.sum", 0) + k.get("dram__bytes_write.sum", 0)
            # written bytes as the SMs sent them to L2: a write that stays in L2 at the kernel's
            # end never reaches DRAM's counter
            g["moved"] += k.get("dram__bytes_read.sum", 0) + k.get("lts__t_bytes_srcunit_tex_op_write.sum", 0)
            g["ns"] += k.get("gpu__time_duration.sum", 0)
            g["n"] += 1
            g["op"] = op
    rows = []
    for name, g in sorted(by.items(), key=lambda kv: -kv[1]["ns"])[:12]:
        rows.append(
            {
                "kernel": name[:90],
                "op": g["op"],
                "launches": g["n"],
                "est_MB": g["est"] / 1e6,
                "dram_MB": g["dram"] / 1e6,
                "ratio": g["est"] / g["dram"] if g["dram"] else None,
                "read_plus_l2_writes_MB": g["moved"] / 1e6,
                "ratio_l2_writes": g["est"] / g["moved"] if g["moved"] else None,
                "ncu_us": g["ns"] / 1e3,
            }
        )
    res = {
        "rc": r.returncode,
        "seconds": time.perf_counter() - t0,
        "ncu_kernels": len(seq),
        "estimated_kernels": len(est),
        "matched": matched,
        "rows": rows,
        "names": sorted(theirs)[:40],
    }
    (out / "ncu-check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1)[:4000])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ncu-timeout", type=int, default=240)
    ap.add_argument("--ncu-child", action="store_true")
    args = ap.parse_args()
    ncu_child(args) if args.ncu_child else analyse(args)
