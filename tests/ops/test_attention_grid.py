"""The guard on attention's grid, on the GPU: every point against the last recorded run
(benchmarks/results/*/attention-grid.json); a point that fell more than 10% (35% a
short one, results.grid) fails it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_no_grid_point_fell_more_than_10_percent_since_the_last_recorded_run(tmp_path):
    recorded = sorted((ROOT / "benchmarks" / "results").glob("*/attention-grid.json"))
    if not recorded:
        pytest.skip(
            "no attention grid recorded yet: record one with benchmarks/attention_grid.py --out DIR "
            "and keep it under benchmarks/results/"
        )
    script = ROOT / "benchmarks" / "attention_grid.py"
    r = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--check", str(recorded[-1])],
        capture_output=True,
        text=True,
        timeout=1800,
        env=os.environ | {"PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
