"""What every experiment shares: where it runs, how it plots, how it keeps its result."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from perfloop.device import default_device as device
from perfloop.harness.measurement import fmt_ms
from perfloop.results.plots import plot_bars, plot_lines

__all__ = ["device", "finish", "ms", "plot_bars", "plot_lines", "sync"]


@contextmanager
def one_cpu_thread(dev: str):
    """On a CPU, torch on one thread for the block (restored after): with its ops split over
    every core, one core busy elsewhere makes each op wait for its slowest thread, and a call's
    time stops following its work (8 MLP steps read 23x one step beside a busy core; 8.1x on
    one thread)."""
    before = torch.get_num_threads()
    if dev == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def finish(name, headers, rows, conclusion, plots, store=None, run_id=None, extra=None) -> dict:
    """The experiment's result: table, conclusion (from the numbers), plots; stored if asked."""
    result = {
        "name": name,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "table": {"headers": headers, "rows": [[_cell(c) for c in r] for r in rows]},
        "conclusion": conclusion,
        "plots": [Path(p).name for p in plots],
        "plot_paths": plots,
        **(extra or {}),
    }
    if store is not None and run_id is not None:
        store.add_artifact(run_id, "experiment", result, op=f"experiment:{name}")
    return result


def _cell(c):
    if isinstance(c, float):
        return f"{c:.4g}"
    return c


def ms(x: float) -> str:
    return fmt_ms(x)
