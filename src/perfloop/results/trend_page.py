"""The report's first section: the steps the history found (regressions, then improvements),
then every benchmark's line as a small inline SVG, with the gate's noise band around each
stretch between steps. Inline SVG rather than a PNG per key: a thousand runs over many keys
stays one file that opens at once from disk."""

from __future__ import annotations

import hashlib
import html
import math

from perfloop.harness.gate import learned_floor
from perfloop.results.history import Trend, bisect_command, fmt_p, key_text

W, H, PAD = 260, 40, 3


def _anchor(t: Trend) -> str:
    """A fragment id for the key: readable, and unique (keys that differ only in punctuation
    read the same, so the key's own hash ends it)."""
    text = "/".join(t.key)
    return (
        "k-"
        + "".join(c if c.isalnum() else "-" for c in text)
        + "-"
        + hashlib.sha1(text.encode()).hexdigest()[:8]
    )


def _name(t: Trend) -> str:
    return key_text(t.key)


def _segments(t: Trend) -> list[tuple[int, int]]:
    cuts = [0, *(c.at for c in t.changes), len(t.points)]
    return list(zip(cuts, cuts[1:], strict=False))


def sparkline(t: Trend) -> str:
    """The medians in run order (log scale), each stretch between steps with its noise band
    (gate.learned_floor of that stretch's runs), the steps as vertical lines."""
    meds = [p.median_ms for p in t.points]
    bands = []
    for lo, hi in _segments(t):
        seg = sorted(meds[lo:hi])
        floor = learned_floor(seg)
        if floor is not None:
            level = seg[len(seg) // 2]
            bands.append((lo, hi, level / (1 + floor), level * (1 + floor)))
    ys = [math.log(v) for v in meds] + [math.log(b) for _, _, a, z in bands for b in (a, z)]
    y0, y1 = min(ys), max(ys)
    span = (y1 - y0) or 1.0
    n = len(meds)

    def x(i: float) -> float:
        return PAD + (W - 2 * PAD) * (i / (n - 1) if n > 1 else 0.5)

    def y(v: float) -> float:
        return PAD + (H - 2 * PAD) * (1 - (math.log(v) - y0) / span)

    e = html.escape
    parts = [
        f"<svg class='spark' width='{W}' height='{H}' viewBox='0 0 {W} {H}' role='img'>",
        f"<title>{e(_name(t))}: {n} runs, {meds[0]:.4g} to {meds[-1]:.4g} ms</title>",
    ]
    for lo, hi, a, z in bands:
        xa, xz = x(lo - 0.5 if lo else 0), x(hi - 0.5 if hi < n else n - 1)
        parts.append(
            f"<rect class='band' x='{xa:.1f}' y='{y(z):.1f}' width='{max(xz - xa, 1):.1f}' "
            f"height='{max(y(a) - y(z), 1):.1f}'/>"
        )
    for c in t.changes:
        cls = "up" if c.ratio > 1 else "down"
        parts.append(
            f"<line class='{cls}' x1='{x(c.at - 0.5):.1f}' x2='{x(c.at - 0.5):.1f}' y1='0' y2='{H}'/>"
        )
    path = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(meds))
    parts.append(f"<polyline points='{path}'/>")
    for i, p in enumerate(t.points):
        label = f"{e(p.commit or 'no commit')} {p.created[:16]}: {p.median_ms:.4g} ms"
        parts.append(
            f"<circle cx='{x(i):.1f}' cy='{y(p.median_ms):.1f}' r='1.3'><title>{label}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


CSS = """
svg.spark{background:#fcfcfc;vertical-align:middle}svg.spark polyline{fill:none;stroke:#246;stroke-width:1}
svg.spark circle{fill:#246}svg.spark .band{fill:#9bd;opacity:.35}
svg.spark line.up{stroke:#c22;stroke-width:1.5}svg.spark line.down{stroke:#292;stroke-width:1.5}
.slower{color:#c22;font-weight:600}.faster{color:#292}
"""


def section(trends: list[Trend]) -> list[str]:
    """The changes table (regressions first, largest first; then improvements) and a table of
    every key's sparkline."""
    e = html.escape
    trends = [t for t in trends if not t.key[0].startswith("_")]  # the reference workload is not a result
    if not trends:
        return []
    changes = [(t, c) for t in trends for c in t.changes]
    changes.sort(key=lambda tc: (tc[1].ratio < 1, -abs(math.log(tc[1].ratio))))
    parts = [
        f"<h2 id='changes'>changes: {sum(c.ratio > 1 for _, c in changes)} slower, "
        f"{sum(c.ratio < 1 for _, c in changes)} faster</h2>"
    ]
    if changes:
        rows = []
        for t, c in changes:
            word = "slower" if c.ratio > 1 else "faster"
            line = bisect_command(t, t.changes.index(c))
            how = f"<code>{e(line)}</code>" if line else "(bisect cannot check these commits out)"
            rows.append(
                f"<tr class='change'><td><a href='#{_anchor(t)}'>{e(_name(t))}</a></td>"
                f"<td class='{word}'>{c.ratio:.3f}x {word}</td><td>{e(c.before or '?')}</td>"
                f"<td>{e(c.after or '?')}</td><td>{c.z:.1f}</td><td>{fmt_p(c.p_value)}</td><td>"
                f"{how}</td></tr>"
            )
        parts.append(
            "<table><tr><th>benchmark</th><th>step</th><th>last commit before</th>"
            "<th>first commit after</th><th>z</th><th>p</th><th>name the commit</th></tr>"
            + "".join(rows)
            + "</table>"
        )
    else:
        parts.append("<p>No step in any benchmark's line: every run within its noise.</p>")
    rows = []
    for t in sorted(trends, key=lambda t: (not t.changes, _name(t))):
        last = t.points[-1]
        step = "; ".join(f"{c.ratio:.3f}x at {c.after or '?'}" for c in t.changes) or " ".join(t.notes[:1])
        runs = f"{len(t.points)}" + (f" ({len(t.left_out)} contended, left out)" if t.left_out else "")
        rows.append(
            f"<tr id='{_anchor(t)}' class='trend'><td>{e(_name(t))}</td><td>{runs}</td>"
            f"<td>{last.median_ms:.4g} ms</td><td>{sparkline(t)}</td><td>{e(step)}</td>"
            "</tr>"
        )
    parts += [
        "<h2>every benchmark, run by run</h2>",
        "<p>Each line: the median of each run in the order taken (log scale); the band: the noise "
        "the regression gate allows between runs of the same code; red and green lines: steps.</p>",
        "<table><tr><th>benchmark</th><th>runs</th><th>latest</th><th>trend</th><th>steps</th></tr>"
        + "".join(rows)
        + "</table>",
    ]
    return parts
