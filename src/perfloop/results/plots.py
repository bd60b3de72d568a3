"""The project's plots, one helper each: lines on log-log axes (time against size, bandwidth
against bytes), grouped bars, and bars against a reference line. PNGs through matplotlib's
Agg backend, so they render with no display."""

from __future__ import annotations

from pathlib import Path


def _figure(width: float = 6.4, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def _plain_log_ticks(ax) -> None:
    """Log axes labelled in plain numbers ("12", "0.5"), not matplotlib's "1.2x10^1" that it
    falls back to on an axis spanning less than a decade."""
    from matplotlib.ticker import LogFormatter

    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":
            axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _save(fig, ax, path: Path, title: str, ylabel: str, legend: bool, grid_axis: str = "both") -> str:
    import matplotlib.pyplot as plt

    _plain_log_ticks(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid_axis:
        ax.grid(True, axis=grid_axis, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return str(path)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict, log: bool = True) -> str:
    """series: {label: (xs, ys)}, drawn as points joined by lines (log-log by default);
    returns the path written.

    >>> plot_lines(Path("t.png"), "gelu", "n", "ms", {"naive": ([1e3, 1e6], [0.01, 2.0])})  # doctest: +SKIP
    """
    fig, ax = _figure()
    for label, (xs, ys) in series.items():
        (ax.loglog if log else ax.plot)(xs, ys, "o-", label=label)
    ax.set_xlabel(xlabel)
    return _save(fig, ax, path, title, ylabel, legend=bool(series))


def plot_bars(path: Path, title: str, ylabel: str, groups: dict, log: bool = True) -> str:
    """groups: {group label: {bar label: value}}, drawn side by side per group; returns the path.
    Values that are None (not measured, did not fit) leave a gap."""
    names = list(dict.fromkeys(b for bars in groups.values() for b in bars))
    width = 0.8 / max(len(names), 1)
    fig, ax = _figure(max(6.4, 0.9 * len(groups) + 2))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [bars.get(name) for bars in groups.values()]
        ax.bar(
            [x for x, y in zip(xs, ys, strict=True) if y is not None],
            [y for y in ys if y is not None],
            width,
            label=name,
        )
    ax.set_xticks(range(len(groups)))
    crowded = len(groups) > 4
    ax.set_xticklabels(
        list(groups), rotation=20 if crowded else 0, ha="right" if crowded else "center", fontsize=8
    )
    if log:
        ax.set_yscale("log")
    return _save(fig, ax, path, title, ylabel, legend=len(names) > 1, grid_axis="y")


def plot_ref_bars(path: Path, title: str, ylabel: str, bars: dict, ref: float, err=None) -> str:
    """One bar per label ({label: value}), optional error bars, a dashed line at `ref`."""
    fig, ax = _figure(height=3.2)
    ax.bar(list(bars), list(bars.values()), yerr=err, capsize=4)
    ax.axhline(ref, color="k", lw=0.8, ls="--")
    return _save(fig, ax, path, title, ylabel, legend=False, grid_axis="")


def plot_distribution(path: Path, title: str, xlabel: str, samples: dict) -> str:
    """Each label's samples as a horizontal violin with its median marked ({label: [ms, ...]}):
    the spread a median hides (a second mode, a slow tail). A label with one sample is a dot."""
    fig, ax = _figure(height=max(2.4, 0.55 * len(samples) + 1.2))
    labels = list(samples)
    spread = [i for i, k in enumerate(labels) if len(samples[k]) > 1]
    if spread:
        data = [samples[labels[i]] for i in spread]
        try:  # matplotlib >= 3.10 names the orientation; older ones take vert=False
            ax.violinplot(data, positions=spread, orientation="horizontal", showmedians=True)
        except TypeError:
            ax.violinplot(data, positions=spread, vert=False, showmedians=True)
    for i, k in enumerate(labels):
        if len(samples[k]) == 1:
            ax.plot(samples[k], [i], "o")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel(xlabel)
    return _save(fig, ax, path, title, "", legend=False, grid_axis="x")


def plot_roofline(path: Path, title: str, points: list[dict], copy_gbps: float, peaks: dict) -> str:
    """Each op a point (x: FLOPs per byte, y: achieved TFLOP/s), sized by its time, under the
    measured roofs: the copy ceiling's slope and a flat line per matmul ceiling ({label:
    TFLOP/s}). Ops with no FLOPs counted sit at x = 1/64, at their share of the copy roof."""
    no_flops = 2**-6
    fig, ax = _figure(7.2, 4.8)
    xs = [p["intensity"] if p.get("tflops") and p["intensity"] > 0 else no_flops for p in points]
    ys = [p["tflops"] if p.get("tflops") else p["gbps"] * x / 1e3 for p, x in zip(points, xs, strict=True)]
    lo, hi = min(xs + [no_flops]) / 2, max(xs + [1e3]) * 2
    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    top = max(peaks.values(), default=copy_gbps * hi / 1e3)
    ax.loglog(
        grid, [min(copy_gbps * x / 1e3, top) for x in grid], "k-", lw=1, label=f"copy {copy_gbps:,.0f} GB/s"
    )
    for label, peak in peaks.items():
        ax.axhline(peak, ls="--", lw=0.8, color="gray")
        ax.annotate(f"{label} {peak:.3g} TFLOP/s", (hi, peak), ha="right", va="bottom", fontsize=7)
    ax.axvline(no_flops, ls=":", lw=0.8, color="gray")
    ax.annotate("no FLOPs counted", (no_flops, top), fontsize=6, rotation=90, va="top", ha="right")
    total = sum(p["ms"] for p in points) or 1.0
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.scatter([x], [max(y, 1e-9)], s=20 + 600 * p["ms"] / total, alpha=0.5)
        if p["ms"] / total > 0.04:
            ax.annotate(p["name"][:28], (x, max(y, 1e-9)), fontsize=6)
    ax.set_xlabel("arithmetic intensity (FLOP per byte)")
    ax.set_ylim(bottom=min([y for y in ys if y > 0] + [top]) / 5, top=top * 3)
    return _save(fig, ax, path, title, "TFLOP/s", legend=True)
