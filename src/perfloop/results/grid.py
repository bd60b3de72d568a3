"""A kernel's speed over a grid of shapes, recorded run after run, and the guard on it: a point
whose speed-up over its reference (e.g. ours against SDPA, timed interleaved in one run, so the
machine's pace cancels) fell by more than a limit since the last recorded run, beyond both
runs' CIs, is a drop; so is a point the last run had and this one could not measure. A short
point (any of its `*_ms` times under `short_ms` in either run: launches and host time, not the
kernels, set its pace) moves more than that between runs of unchanged code, and is held to
`short_limit`.

A recording is JSON: {"device": ..., "date": ..., "commit": ..., "points": {key: {"speedup": s,
"ci": [lo, hi], ...}}}, keys of name=value words, e.g. "b=2 h=8 t=3000 d=64 mask=causal
mode=fwd".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SHORT_MS, SHORT_LIMIT = 0.5, 0.35


@dataclass(frozen=True)
class Drop:
    key: str
    before: float  # speed-up over the reference in the last recorded run
    now: float | None  # None: not measured this time
    why: str = ""
    limit: float = 0.10  # the fall this point was held to

    @property
    def ratio(self) -> float | None:
        return self.now / self.before if self.now is not None else None

    def __str__(self) -> str:
        if self.now is None:
            return f"{self.key}: {self.before:.3f}x before, not measured now ({self.why})"
        return (
            f"{self.key}: {self.before:.3f}x -> {self.now:.3f}x of the reference "
            f"({self.ratio:.2f} of before, held to a {self.limit:.0%} fall)"
        )


def read(path: str | Path) -> dict:
    """A recording, checked: the points must carry a speed-up and a CI."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"recording {path}: cannot read it ({exc})") from None
    points = doc.get("points") if isinstance(doc, dict) else None
    if not isinstance(points, dict) or not points:
        raise ValueError(f"recording {path}: no points (a grid recording holds {{'points': {{key: ...}}}})")
    for key, p in points.items():
        if "error" in p:
            continue
        ok = isinstance(p.get("speedup"), (int, float)) and len(p.get("ci") or ()) == 2
        if not ok or not (math.isfinite(p["speedup"]) and p["speedup"] > 0):
            raise ValueError(f"recording {path}, point {key!r}: needs a speedup > 0 and a ci [lo, hi]")
    return doc


def drops(
    last: dict, now: dict, limit: float = 0.10, short_ms: float = SHORT_MS, short_limit: float = SHORT_LIMIT
) -> list[Drop]:
    """The points of `last` that fell by more than `limit` (`short_limit` for a point with a time
    under `short_ms`) in `now` with CIs that do not overlap, or that `now` lacks or could not
    measure; worst first."""
    for name, value in (("limit", limit), ("short_limit", short_limit)):
        if not 0 < value < 1:
            raise ValueError(f"{name}: a fraction in (0, 1), e.g. 0.10 for 10%; got {value}")
    out = []
    for key, a in last["points"].items():
        if "error" in a:
            continue
        b = now["points"].get(key)
        if b is None or "error" in b:
            out.append(Drop(key, a["speedup"], None, (b or {}).get("error", "absent from this run")))
            continue
        times = [v for p in (a, b) for k, v in p.items() if k.endswith("_ms")]
        held = short_limit if any(t < short_ms for t in times) else limit
        fell = b["speedup"] < a["speedup"] * (1 - held) and b["ci"][1] < a["ci"][0]
        if fell:
            out.append(Drop(key, a["speedup"], b["speedup"], limit=held))
    return sorted(out, key=lambda d: d.ratio if d.ratio is not None else -1.0)


def worst(recording: dict, n: int = 10) -> list[tuple[str, float]]:
    """The n points with the lowest speed-up over the reference."""
    pts = [(k, p["speedup"]) for k, p in recording["points"].items() if "error" not in p]
    return sorted(pts, key=lambda kp: kp[1])[:n]


def heatmap(recording: dict, path: str | Path, rows: str, cols: str, panels: str, title: str) -> str:
    """One panel per value of the key fields `panels`, rows by the fields `rows`, columns by the
    field `cols` (fields: the name=value words of a key; several joined by spaces); each cell the
    speed-up, coloured around 1. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    def fields(key: str) -> dict:
        return dict(w.split("=", 1) for w in key.split() if "=" in w)

    table: dict = {}
    for key, p in recording["points"].items():
        f = fields(key)
        r = " ".join(f"{x}={f.get(x, '')}" for x in rows.split())
        c = f.get(cols, "")
        panel = " ".join(f"{x}={f.get(x, '-')}" for x in panels.split())
        table.setdefault(panel, {})[(r, c)] = p.get("speedup", math.nan) if "error" not in p else math.nan
    names = sorted(table)
    ncols = min(4, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 4.8 * nrows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    norm = TwoSlopeNorm(vmin=0.3, vcenter=1.0, vmax=1.7)

    def num(s: str) -> float:
        digits = "".join(ch for ch in s if ch.isdigit())
        return float(digits) if digits else 0.0

    for i, (ax, name) in enumerate(zip(axes.flat, names, strict=False)):
        cells = table[name]
        rs = sorted({r for r, _ in cells}, key=lambda r: [num(w) for w in r.split()])
        cs = sorted({c for _, c in cells}, key=num)
        grid = [[cells.get((r, c), math.nan) for c in cs] for r in rs]
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        ax.set_xticks(range(len(cs)), cs, rotation=60, fontsize=7)
        ax.set_yticks(range(len(rs)), rs if i % ncols == 0 else [], fontsize=7)
        ax.set_title(name, fontsize=9)
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="speed-up over the reference")
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return str(path)
