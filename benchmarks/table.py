"""Markdown tables for the README from a recorded GPU run (benchmarks/results/*.json).

python3 benchmarks/table.py benchmarks/results/2026-11-30-h200-run3.json
"""

from __future__ import annotations

import json
import sys


def ops_table(d: dict) -> str:
    copy = d["ceilings"]["copy_gbps"]
    lines = [
        "| op | shape | dtype | variant | ms | GB/s | TFLOP/s | % of ceiling | speed-up [95% CI] |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in d["ops"]:
        if "error" in r:
            continue
        shape = "x".join(map(str, r["shape"]))
        tflops = f"{r['tflops']:.1f}" if r["tflops"] and r["tflops"] >= 1 else ""
        sol = f"{100 * r['sol']:.0f}%" if r["sol"] is not None else ""
        note = ""
        lines.append(
            f"| {r['op']} | {shape} | {r['dtype']}{note} | {r['variant']} | {r['median_ms']:.3f} | "
            f"{r['gbps']:.0f} | {tflops} | {sol} | {r['speedup']:.2f}x "
            f"[{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] vs {r['speedup_vs']} |"
        )
    lines.append(
        f"\nCeilings measured in the same run: copy {copy:.0f} GB/s, bf16 matmul "
        f"{d['ceilings']['matmul_bf16_tflops']:.0f} TFLOP/s, fp32 matmul "
        f"{d['ceilings']['matmul_fp32_tflops']:.1f} TFLOP/s."
    )
    return "\n".join(lines)


def harness_table(d: dict) -> str:
    lines = [
        "| case | CUPTI ms | perfloop ms (ratio) | do_bench ms (ratio) | perfloop wall s | do_bench wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in d["harness"].items():
        if "perfloop_ms" not in c:
            continue
        lines.append(
            f"| {name} | {c['cupti_ms']:.4f} | {c['perfloop_ms']:.4f} ({c['perfloop_over_cupti']:.3f}) | "
            f"{c['do_bench_ms']:.4f} ({c['do_bench_over_cupti']:.3f}) | {c['perfloop_wall_s']:.3f} | "
            f"{c['do_bench_wall_s']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    dev = data["env"]["device"]
    print(
        f"{dev['name']}, driver {dev['driver']}, torch {data['env']['torch']}, "
        f"triton {data['env']['triton']}, {data['date']}\n"
    )
    print(harness_table(data) + "\n")
    print(ops_table(data))
