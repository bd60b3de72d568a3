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


def _figure(width: float = 6.4):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, 4))


def _save(fig, ax, path: Path, title: str, ylabel: str, legend: bool, grid_axis: str = "both") -> str:
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis=grid_axis, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict, log: bool = True) -> str:
    """series: {label: (xs, ys)}; returns the file name written."""
    fig, ax = _figure()
    for label, (xs, ys) in series.items():
        (ax.loglog if log else ax.plot)(xs, ys, "o-", label=label)
    ax.set_xlabel(xlabel)
    return _save(fig, ax, path, title, ylabel, legend=True)


def plot_bars(path: Path, title: str, ylabel: str, groups: dict, log: bool = True) -> str:
    """groups: {group label: {bar label: value}}, drawn side by side per group; returns the path.
    Values that are None (not measured, did not fit) leave a gap."""
    names = list(dict.fromkeys(b for bars in groups.values() for b in bars))
    width = 0.8 / max(len(names), 1)
    fig, ax = _figure(max(6.4, 0.9 * len(groups) + 2))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [bars.get(name) for bars in groups.values()]
        ax.bar([x for x, y in zip(xs, ys, strict=True) if y is not None], [y for y in ys if y is not None],
               width, label=name)  # fmt: skip
    ax.set_xticks(range(len(groups)))
    crowded = len(groups) > 4
    ax.set_xticklabels(list(groups), rotation=20 if crowded else 0, ha="right" if crowded else "center",
                       fontsize=8)  # fmt: skip
    if log:
        ax.set_yscale("log")
    return _save(fig, ax, path, title, ylabel, legend=len(names) > 1, grid_axis="y")


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
