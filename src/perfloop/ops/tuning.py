"""What every op's tuner shares: time candidate launch configs with the harness, keep the
fastest, and read or write the op's table of chosen configs (`ops/<op>/tuned.json`), which
its launcher reads.

Each op folder holds its own `tuning.py`: the search space beside the kernel and a `tune()`
that measures it on the GPU at hand and writes the table (`benchmarks/run_gpu.py --only tune`
calls them). The table records where it was measured.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

TABLE_NAME = "tuned.json"


class TableWarning(RuntimeWarning):
    """A tuned table measured on another GPU than the one it is used on."""


def load_table(op_dir: Path) -> dict:
    """The op's chosen configs, as its tuner last wrote them; a warning, naming the table and
    both devices, when they were measured on another GPU than this one."""
    path = Path(op_dir) / TABLE_NAME
    doc = json.loads(path.read_text())
    here = _gpu_name()
    if here and doc.get("measured_on") and doc["measured_on"] != here:
        import warnings

        warnings.warn(
            f"{path.parent.name}/{TABLE_NAME} was tuned on {doc['measured_on']}, not on this "
            f"{here}: its configs are used untuned here; `python benchmarks/run_gpu.py --only "
            "tune` measures this GPU's",
            TableWarning,
            stacklevel=2,
        )
    return doc["table"]


def first_at_most(pairs: list, x: int):
    """A table's [bound, value] pairs read as steps: the value of the first pair whose bound x
    does not pass."""
    return next(v for bound, v in pairs if x <= bound)


def _gpu_name() -> str | None:
    """The GPU the kernels launch on, or None where they run interpreted or on no GPU."""
    import torch

    from perfloop.ops.base import interpreting

    if interpreting() or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def save_table(op_dir: Path, table: dict, measured_on: str, note: str = "") -> Path:
    """Write the chosen configs with where and when they were measured; returns the path."""
    path = Path(op_dir) / TABLE_NAME
    doc = {"measured_on": measured_on, "date": dt.date.today().isoformat(), "note": note, "table": table}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def time_candidates(
    candidates: dict[str, Callable[[], object]],
    budget_s: float = 0.3,
    log: Callable[[str], None] | None = None,
) -> dict[str, float | str]:
    """Median ms of each candidate (bench, L2 flushed), or its error as text: a config that
    does not compile or fit costs only itself."""
    from perfloop.harness.timing import bench

    out: dict[str, float | str] = {}
    for label, fn in candidates.items():
        try:
            out[label] = bench(fn, budget_s=budget_s).median_ms
        except Exception as exc:  # a config that does not fit or compile
            out[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if log:
            v = out[label]
            log(f"  {label:28} " + (f"{v:.4f} ms" if isinstance(v, float) else v))
    return out


def fastest(times: dict[str, float | str]) -> str | None:
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return min(ok, key=ok.get) if ok else None
