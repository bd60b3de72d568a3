"""Memory and time of reading a large torch-like Chrome trace (`perfloop profile --trace-file`).

    PYTHONPATH=src python3 benchmarks/experiments/trace_memory.py --gib 1 \
        --out benchmarks/results/trace-memory.json

Writes a synthetic trace of the size asked (ProfilerStep ranges of matmul ops with their shapes,
launches, and the kernels after every CPU event, as torch writes them), then reads it in a fresh
process and records its peak resident memory and wall time beside the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

OP = (
    '{{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": {t}, "dur": 8, "tid": 1, "pid": 1, '
    '"args": {{"Input Dims": [[64, 256], [256, 256]], "Input type": ["float", "float"], '
    '"Sequence number": {k}}}}},\n'
    '{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": {t1}, "dur": 3, "tid": 1, '
    '"pid": 1, "args": {{"correlation": {c}}}}},\n'
)
STEP = (
    '{{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#{s}", "ts": {t}, "dur": {d}, '
    '"tid": 1, "pid": 1}},\n'
)
KERNEL = (
    '{{"ph": "X", "cat": "kernel", "name": "sgemm_kernel", "ts": {t}, "dur": 4, "tid": 7, "pid": 0, '
    '"args": {{"correlation": {c}}}}}'
)


def write(path: str, target_bytes: int, ops_per_step: int = 1000) -> int:
    """The trace's size; kernels (about 120 bytes each) written after the CPU events."""
    launches = []
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "traceEvents": [\n')
        t, c, s, written = 0, 0, 0, 0
        while written + 130 * len(launches) < target_bytes:
            start = t
            chunk = []
            for k in range(ops_per_step):
                chunk.append(OP.format(t=t, k=k, t1=t + 1, c=c))
                launches.append(t + 5)
                c += 1
                t += 10
            chunk.append(STEP.format(s=s, t=start, d=t - start))
            text = "".join(chunk)
            f.write(text)
            written += len(text)
            s += 1
        f.write(",\n".join(KERNEL.format(t=ts, c=i) for i, ts in enumerate(launches)))
        f.write("\n]}\n")
    return os.path.getsize(path)


READ = """
import resource, sys, time
from perfloop.analysis.trace import read
t0 = time.perf_counter()
events, _, warnings = read(sys.argv[1])
print(len(events), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t0, warnings)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--write", metavar="PATH", help="only write the trace there")
    a = ap.parse_args()
    if a.write:
        write(a.write, int(a.gib * 2**30))
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        t0 = time.perf_counter()  # written by another process: the reader's peak is its own
        subprocess.run([sys.executable, __file__, "--gib", str(a.gib), "--write", path], check=True)
        size, wrote = os.path.getsize(path), time.perf_counter() - t0
        out = subprocess.run([sys.executable, "-c", READ, path], capture_output=True, text=True, check=True)
    n, rss_kib, secs, warnings = out.stdout.split(" ", 3)
    result = {
        "file_bytes": size,
        "events_kept": int(n),
        "peak_rss_bytes": int(rss_kib) * 1024,
        "rss_over_file": int(rss_kib) * 1024 / size,
        "read_s": float(secs),
        "write_s": wrote,
        "warnings": warnings.strip(),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
