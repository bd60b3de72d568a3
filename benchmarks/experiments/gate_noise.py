"""The regression gate against run-to-run noise, on this machine: N back-to-back runs (each its
own process) of the same code, with another process loading one core, and N runs of a copy
1.3x slower; every run is judged against the one before it (unchanged) and against the first
(slowed), with the history of the same code's earlier runs. Prints the false alarms and the
misses, and the naive within-run test's for comparison.

    python benchmarks/experiments/gate_noise.py --runs 20 --load 1 --out benchmarks/results/gate.json
    python benchmarks/experiments/gate_noise.py \
        --rejudge benchmarks/results/2026-12-01-cpu-gate-noise-raw-runs.json.gz
                                     # the stored runs, judged again by the gate as it is now
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

RUN = r"""
import json, sys, torch
from perfloop.harness import gate
from perfloop.harness.timing import compare
slow = sys.argv[1] == "slow"
x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
part = x[: int(0.3 * 512)]
def fn():
    y = torch.nn.functional.gelu(x)
    if slow:  # 30% more of the same work
        torch.nn.functional.gelu(part)
    return y
c = compare({"fn": fn}, reference=gate.reference("cpu"), budget_s=1.5, target_ci=0.005)
m, r = c.measurements["fn"], c.reference
print(json.dumps({"samples": list(m.samples_ms), "ref": list(r.samples_ms), "warnings": list(m.warnings),
                  "contended": gate.contended(m.meta)}))
"""


def judge(a: dict, b: dict, history: list[float], fail_above: float):
    from perfloop.harness import gate

    return gate.judge(
        a["samples"],
        b["samples"],
        fail_above_pct=fail_above,
        a_ref=a["ref"],
        b_ref=b["ref"],
        history=history,
        contended=a["contended"] or b["contended"],
    )


def one_run(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, kind], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def judge_all(same: list[dict], slow: list[dict], fail_above: float):
    """(false alarms, misses, the naive test's false alarms, a row per pair): each unchanged run
    against the one before it, each slow run against the last unchanged one."""
    from perfloop.harness import gate, stats

    alarms, misses, naive_alarms, rows = 0, 0, 0, []
    for i in range(1, len(same)):
        a, b = same[i - 1], same[i]
        history = [gate.normalized_tail(r["samples"], r["ref"]) for r in same[:i]]
        v = judge(a, b, history, fail_above)
        s = stats.independent_ratio(a["samples"], b["samples"])
        naive = s["p_value"] < 0.01 and s["ratio"] > 1 + fail_above / 100
        alarms += v.regression
        naive_alarms += naive
        rows.append(
            {
                "pair": f"same {i - 1}->{i}",
                "median_ratio": s["ratio"],
                "adjusted": v.adjusted,
                "floor": v.floor,
                "regression": v.regression,
                "naive_regression": naive,
            }
        )
    history = [gate.normalized_tail(r["samples"], r["ref"]) for r in same]
    for i, b in enumerate(slow):
        v = judge(same[-1], b, history, fail_above)
        misses += not v.regression
        rows.append(
            {
                "pair": f"same -> slow {i}",
                "adjusted": v.adjusted,
                "floor": v.floor,
                "regression": v.regression,
                "verdict": v.verdict,
            }
        )
    return alarms, misses, naive_alarms, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=1, help="busy processes beside the runs")
    ap.add_argument("--fail-above", type=float, default=5.0)
    ap.add_argument("--out")
    ap.add_argument("--rejudge", help="a --out file (.json or .json.gz): judge its runs again, time nothing")
    args = ap.parse_args()
    t0 = time.time()
    if args.rejudge:
        import gzip

        opener = gzip.open if args.rejudge.endswith(".gz") else open
        with opener(args.rejudge, "rt") as f:
            stored = json.load(f)
        same, slow = stored["same_runs"], stored["slow_runs"]
    else:
        loaders = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        try:
            same = [one_run("same") for _ in range(args.runs)]
            slow = [one_run("slow") for _ in range(args.runs)]
        finally:
            for p in loaders:
                p.kill()
    alarms, misses, naive_alarms, rows = judge_all(same, slow, args.fail_above)
    result = {
        "runs": len(same),
        "load": args.load,
        "fail_above_pct": args.fail_above,
        "false_alarms": alarms,
        "naive_false_alarms": naive_alarms,
        "misses_of_1.3x": misses,
        "wall_s": time.time() - t0,
        "pairs": rows,
        "same_runs": same,
        "slow_runs": slow,
    }
    print(json.dumps({k: v for k, v in result.items() if not k.endswith(("pairs", "runs"))}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
