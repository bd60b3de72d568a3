"""What every experiment shares: where it runs, how it plots, how it keeps its result."""

from __future__ import annotations

from pathlib import Path

import torch

from perfloop.measurement import fmt_ms


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict, log: bool = True) -> str:
    """series: {label: (xs, ys)}; returns the file name written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, (xs, ys) in series.items():
        (ax.loglog if log else ax.plot)(xs, ys, "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


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
