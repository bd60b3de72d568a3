"""Rendering stored results: terminal tables and a static HTML report with plots.

The HTML report is one folder (index.html + PNGs made with matplotlib) that
opens from disk with no server. Every name that comes from outside (op,
variant, kernel names, environment strings) is HTML-escaped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from perfloop.harness.measurement import fmt_ms
from perfloop.results import trend_page
from perfloop.results.history import trends
from perfloop.results.plots import plot_distribution, plot_lines, plot_ref_bars


def latest_rows(rows: list[dict]) -> list[dict]:
    """The newest row per (op, variant, shape, dtype, graph)."""
    best: dict = {}
    for r in rows:
        if r["op"].startswith("_"):  # the reference workload every run measures: not a result
            continue
        best[(r["op"], r["variant"], r["shape"], r["dtype"], r["graph"])] = r
    return list(best.values())


def numel(shape: str) -> int:
    return math.prod(int(s) for s in shape.split("x")) if shape else 0


def rate(v: float | None) -> str:
    """A rate as people read it: whole numbers from 10 up, two significant digits below (a CPU's
    0.43 GB/s is not "0")."""
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.2g}"


def fmt_rate(r: dict) -> str:
    parts = []
    if r.get("gbps"):
        parts.append(f"{rate(r['gbps'])} GB/s")
    if r.get("tflops") and r["tflops"] >= 0.1:
        parts.append(f"{r['tflops']:.1f} TFLOP/s")
    return ", ".join(parts)


def fmt_speedup(r: dict) -> str:
    if r.get("speedup") is None:
        return ""
    return f"{r['speedup']:.2f}x [{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"


# ------------------------------------------------------------------ plots


def _plots(op: str, rows: list[dict], out: Path) -> list[tuple[str, str]]:
    """Time against size (where a variant has several sizes), % of ceiling and speed-up at the
    largest shape: (file name, alt text) each."""
    made = []
    safe = "".join(c if c.isalnum() else "_" for c in op)
    by_var = defaultdict(list)
    for r in rows:
        by_var[(r["variant"], r["dtype"], r["graph"])].append(r)
    if any(len({x["shape"] for x in v}) > 1 for v in by_var.values()):
        series = {}
        for (var, dtype, graph), rs in sorted(by_var.items()):
            rs = sorted(rs, key=lambda x: numel(x["shape"]))
            series[f"{var} {dtype}" + (" graph" if graph else "")] = (
                [numel(x["shape"]) for x in rs],
                [x["median_ms"] for x in rs],
            )
        name = f"{safe}_scaling.png"
        plot_lines(
            out / name,
            f"{op}: time against size",
            "elements (product of the shape)",
            "median time (ms)",
            series,
        )
        made.append((name, f"{op}: time against size (log-log)"))

    big = max(rows, key=lambda r: numel(r["shape"]))["shape"]
    at = sorted((r for r in rows if r["shape"] == big and not r["graph"]), key=lambda r: r["variant"])
    label = lambda r: f"{r['variant']}\n{r['dtype']}"
    sol = [r for r in at if r.get("sol") is not None]
    if sol:
        name = f"{safe}_sol.png"
        plot_ref_bars(
            out / name,
            f"{op} {big}: speed of light",
            "% of measured ceiling",
            {label(r): 100 * r["sol"] for r in sol},
            ref=100,
        )
        made.append((name, f"{op} {big}: % of the measured ceiling"))
    sp = [r for r in at if r.get("speedup") is not None]
    if sp:
        err = [[r["speedup"] - r["speedup_lo"] for r in sp], [r["speedup_hi"] - r["speedup"] for r in sp]]
        name = f"{safe}_speedup.png"
        plot_ref_bars(
            out / name,
            f"{op} {big}: speed-up",
            f"speed-up vs {sp[0].get('baseline') or 'baseline'} (95% CI)",
            {label(r): r["speedup"] for r in sp},
            ref=1,
            err=err,
        )
        made.append((name, f"{op} {big}: speed-up with 95% CI"))
    dist = {label(r).replace("\n", " "): r["samples"] for r in at if r.get("samples")}
    if dist:
        name = f"{safe}_samples.png"
        plot_distribution(out / name, f"{op} {big}: the stored samples", "time per call (ms)", dist)
        made.append((name, f"{op} {big}: each variant's samples (violin, median marked)"))
    return made


def _comm_plot(rows: list[dict], out: Path) -> str:
    series = {}
    for name in dict.fromkeys(r["collective"] for r in rows):
        rs = [r for r in rows if r["collective"] == name]
        series[name] = ([r["bytes"] for r in rs], [max(r["busbw_gbps"], 1e-6) for r in rs])
    plot_lines(
        out / "comm_busbw.png",
        f"collectives on {rows[0]['ranks']} ranks ({rows[0]['backend']})",
        "bytes (nccl-tests size: each rank's largest buffer)",
        "bus bandwidth (GB/s)",
        series,
    )
    return "comm_busbw.png"


# ------------------------------------------------------------------ html

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;
font-size:13px;text-align:right}th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
pre{background:#f7f7f7;padding:.6em;font-size:12px;overflow-x:auto}
img{max-width:100%;height:auto;margin:.3em}
.warn{color:#a40}table.ops td:nth-child(-n+3){text-align:left}
nav.toc{background:#f7f7f7;padding:.2em 1em;margin:1em 0}nav.toc h2{font-size:1em}
table{display:block;overflow-x:auto}
@media (max-width:700px){body{margin:.6em}td,th{font-size:11px;padding:2px 4px;white-space:nowrap}}
"""

_CHECK_JS = """
window.addEventListener('load', function () {
  var imgs = Array.from(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images', imgs.length);
  document.body.setAttribute('data-images-ok', ok);
  document.body.setAttribute('data-tables', document.querySelectorAll('table').length);
  var links = Array.from(document.querySelectorAll('nav.toc a'));
  document.body.setAttribute('data-toc', links.length);
  document.body.setAttribute('data-toc-ok', links.filter(function (a) {
    return document.getElementById(a.getAttribute('href').slice(1)) !== null; }).length);
  var wide = document.documentElement.scrollWidth > window.innerWidth;
  document.body.setAttribute('data-overflow', wide ? 1 : 0);
  document.body.setAttribute('data-sparklines', document.querySelectorAll('svg.spark').length);
  document.body.setAttribute('data-changes', document.querySelectorAll('tr.change').length);
  document.body.setAttribute('data-load-ms', Math.round(performance.now()));
});
"""


def _table(headers: list[str], rows: list[list], cls: str = "") -> dict:
    return {"table": {"headers": headers, "rows": rows, "cls": cls}}


def _op_section(op: str, rs: list[dict], arts: list[dict], out: Path) -> list[dict]:
    """One row per variant, dtype and shape, a column per number (rounded as the CLI rounds
    them), the warnings stored with each measurement beside its time."""
    blocks: list[dict] = [{"h2": op}]
    rows = []
    for r in sorted(rs, key=lambda r: (r["variant"], r["dtype"], r["graph"], numel(r["shape"]))):
        sol = "-" if r.get("sol") is None else f"{100 * r['sol']:.0f}%"
        speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        sp_ci = "" if r.get("speedup") is None else f"[{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"
        ci = f"{fmt_ms(r['ci_lo_ms'])}..{fmt_ms(r['ci_hi_ms'])}" if r.get("ci_lo_ms") else "-"
        rows.append(
            [
                r["variant"] + (" (graph)" if r["graph"] else ""),
                r["dtype"],
                r["shape"],
                {"text": fmt_ms(r["median_ms"]), "warn": list(r.get("warnings") or [])},
                ci,
                rate(r.get("gbps")),
                rate(r.get("tflops")),
                sol,
                speedup,
                sp_ci,
            ]
        )
    base = next((r.get("baseline") for r in rs if r.get("baseline")), None)
    blocks.append(
        _table(
            [
                "variant",
                "dtype",
                "shape",
                "median",
                "95% CI",
                "GB/s",
                "TFLOP/s",
                "% SOL",
                f"speed-up vs {base or 'baseline'}",
                "its 95% CI",
            ],
            rows,
            "ops",
        )
    )
    for name, alt in _plots(op, rs, out):
        blocks.append({"img": name, "alt": alt})
    for a in arts:
        if a["op"] == op and a["kind"] == "profile":
            blocks += _profile_section(op, a)
    return blocks


def _profile_section(op: str, a: dict) -> list[dict]:
    p = a["payload"]
    rows = [
        [k["short"], k["calls"], fmt_ms(k["total_ms"]), fmt_ms(k["mean_us"] / 1e3), f"{k['share']:.1%}"]
        for k in p.get("kernels", [])[:10]
    ]
    blocks: list[dict] = [{"h3": f"profile: {op}/{a['variant'] or ''}"}]
    if rows:
        blocks.append(_table(["kernel", "calls", "total", "mean", "share"], rows))
    else:
        blocks.append({"p": "no kernel recorded"})
    d = p.get("diagnosis")
    if d:  # one op's Diagnosis (bound, evidence, advice) or a step's (bound, advice, opportunities)
        blocks.append({"p": f"diagnosis ({d.get('bound', '?')}): {d.get('advice', '')}"})
        if d.get("evidence"):
            blocks.append(_table(["evidence", "value"], _evidence_rows(d["evidence"])))
    return blocks


def _evidence_rows(evidence) -> list[list[str]]:
    """A diagnosis' evidence as rows (name, value), numbers to 4 significant digits."""
    if not isinstance(evidence, dict):
        return [["", str(evidence)]]
    return [[str(k), f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in evidence.items()]


def _step_section(a: dict, out: Path, i: int) -> list[dict]:
    """A profiled step (profile --script): the roofline of its ops, its modules, its idle time,
    the ranked opportunities."""
    from perfloop.results.plots import plot_bars, plot_roofline

    p = a["payload"]
    calls = p.get("calls") or 1
    blocks: list[dict] = [{"h2": f"step profile: {p.get('script', a['op'])} ({p.get('window', '')})"}]
    blocks += [{"p": w, "cls": "warn"} for w in p.get("warnings") or []]
    ceil = p.get("ceilings") or {}
    points = [
        {
            "name": r["name"],
            "ms": r["device_ms"] / calls,
            "intensity": r.get("intensity") or 0.0,
            "gbps": r.get("gbps") or 0.0,
            "tflops": r.get("tflops"),
        }
        for r in p["ops"]
        if r.get("gbps") is not None
    ]
    if points and ceil.get("copy_gbps"):
        peaks = {
            k.split("_")[1]: v for k, v in ceil.items() if k.startswith("matmul_") and k.endswith("_tflops")
        }
        name = f"step-{i}-roofline.png"
        plot_roofline(
            out / name, "ops against the measured roofs (size: time)", points, ceil["copy_gbps"], peaks
        )
        blocks.append({"img": name, "alt": "roofline of the step"})
    mods = {r["name"][:30]: r["device_ms"] / calls for r in p["modules"][:12]}
    name = f"step-{i}-modules.png"
    plot_bars(
        out / name, "device time per call by module", "ms", {m: {"ms": v} for m, v in mods.items()}, log=False
    )
    blocks.append({"img": name, "alt": "modules"})
    idle = p.get("idle")
    if idle:
        causes = {c: v / calls for c, v in idle["by_cause"].items()}
        name = f"step-{i}-idle.png"
        what = "GPU idle" if idle.get("device", "GPU") == "GPU" else "no torch op running"
        plot_bars(
            out / name,
            f"{what} per call ({sum(causes.values()):.3f} ms)",
            "ms",
            {c: {"ms": v} for c, v in causes.items()},
            log=False,
        )
        blocks.append({"img": name, "alt": "idle time by cause"})
    opp = (p.get("diagnosis") or {}).get("opportunities", [])
    blocks.append(
        _table(
            ["opportunity", "saves (ms/call)", "share", "bound", "evidence", "next"],
            [
                [
                    o["title"],
                    f"{o['saves_ms']:.3f}",
                    f"{o['share']:.0%}",
                    o["bound"],
                    o["evidence"],
                    o["advice"],
                ]
                for o in opp
            ],
        )
    )
    return blocks


def _experiment_section(p: dict, out: Path) -> list[dict]:
    for src in p.get("plot_paths", []):  # bring the plots next to the page
        if Path(src).exists() and Path(src).resolve() != (out / Path(src).name).resolve():
            (out / Path(src).name).write_bytes(Path(src).read_bytes())
    blocks: list[dict] = [{"h2": f"experiment: {p.get('name', '')}"}]
    if p.get("table"):
        blocks.append(_table(p["table"]["headers"], p["table"]["rows"]))
    blocks += [{"img": img, "alt": p.get("name", "")} for img in p.get("plots", [])]
    if p.get("conclusion"):
        blocks.append({"p": p["conclusion"]})
    return blocks


def _comm_section(rows_c: list[dict], out: Path) -> list[dict]:
    table = _table(
        [
            "collective",
            "bytes (nccl-tests)",
            "ranks",
            "backend",
            "time ms",
            "algbw GB/s",
            "busbw GB/s",
            "correct",
        ],
        [
            [
                r["collective"],
                r["bytes"],
                r["ranks"],
                r["backend"],
                f"{r['time_ms']:.4f}",
                f"{r['algbw_gbps']:.2f}",
                f"{r['busbw_gbps']:.2f}",
                r["correct"],
            ]
            for r in rows_c
        ],
    )
    return [
        {"h2": "communication"},
        table,
        {"img": _comm_plot(rows_c, out), "alt": "bus bandwidth against size"},
    ]


def _runs_section(runs: list[dict], shown: set[str]) -> list[dict]:
    """The runs the page's numbers come from: id, time, commit, device, command, rows."""
    rows = [
        [
            r["run_id"],
            r["created"][:19].replace("T", " "),
            r["env"].get("git") or "-",
            (r["env"].get("device") or {}).get("name") or "-",
            r["command"] or "",
            r["rows"],
        ]
        for r in runs
        if r["run_id"] in shown
    ]
    return [
        {"h2": f"runs ({len(rows)})", "id": "runs"},
        _table(["run", "time (UTC)", "commit", "device", "command", "rows"], rows, "runs"),
    ]


def _env_section(env: dict) -> list[dict]:
    flat = {
        "device": (env.get("device") or {}).get("name"),
        "torch": env.get("torch"),
        "triton": env.get("triton") or "not installed",
        "cuda": env.get("cuda") or "-",
        "python": env.get("python"),
        "git": env.get("git") or "no commit recorded (not run in a git working tree)",
        **{f"precision.{k}": v for k, v in (env.get("precision") or {}).items()},
    }
    return [
        {"h2": "environment (the newest run)"},
        _table(["what", "value"], [[k, v] for k, v in flat.items()]),
    ]


def _contents(blocks: list[dict]) -> list[dict]:
    """The page's table of contents: each section (h2) given an id where it has none, in order."""
    toc, used = [], set()
    for b in blocks:
        if not b.get("h2"):
            continue
        base = b.get("id") or "s-" + "".join(c if c.isalnum() else "-" for c in b["h2"].lower()).strip("-")
        anchor, n = base, 2
        while anchor in used:
            anchor, n = f"{base}-{n}", n + 1
        used.add(anchor)
        b["id"] = anchor
        toc.append({"id": anchor, "text": b["h2"]})
    return toc


def _template():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("perfloop.results", "templates"),
        autoescape=True,
        keep_trailing_newline=True,
    )
    return env.get_template("report.html.j2")


def render_html(store, out_dir: str | Path, run_id: str | None = None) -> Path:
    """Write out_dir/index.html (+ plots) from the store; returns the page's path.

    >>> render_html(Store("r.db"), "report")  # doctest: +SKIP
    PosixPath('report/index.html')
    """
    from markupsafe import Markup

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("")
        (out / ".write-test").unlink()
    except OSError as exc:
        raise OSError(f"out_dir {out}: cannot write there ({exc}); choose a writable folder") from exc
    all_rows = store.rows(run_id)
    rows = latest_rows(all_rows)
    arts = store.artifacts(run_id)
    shown = {r["run_id"] for r in all_rows} | {a["run_id"] for a in arts}
    summary = (
        f"{len(rows)} result(s), the newest of each op, variant, shape and dtype, from {len(shown)} "
        "run(s)" + (f" (run {run_id} only)" if run_id else "")
    )
    blocks: list[dict] = []
    if not rows and not arts:
        blocks.append({"p": "No results stored yet: run `perfloop demo` or `perfloop bench OP`."})
    if run_id is None:  # the whole history: its steps first, then every key's line (inline SVG)
        blocks += [{"raw": Markup(part)} for part in trend_page.section(trends(store, repo="."))]
    by_op = defaultdict(list)
    for r in rows:
        by_op[r["op"]].append(r)
    for op in sorted(by_op):
        blocks += _op_section(op, by_op[op], arts, out)
    for i, a in enumerate(arts):
        if a["kind"] == "profile" and a["payload"].get("modules"):
            blocks += _step_section(a, out, i)
    for a in arts:
        if a["kind"] == "experiment":
            blocks += _experiment_section(a["payload"], out)
    comm = [a for a in arts if a["kind"] == "comm"]
    if comm:
        blocks += _comm_section(comm[-1]["payload"]["rows"], out)
    if shown:
        blocks += _runs_section(store.runs(), shown)
    envs = [r["env"] for r in all_rows if r.get("env")]
    if envs:
        blocks += _env_section(envs[-1])
    toc = _contents(blocks)
    text = _template().render(
        css=Markup(_CSS + trend_page.CSS), js=Markup(_CHECK_JS), summary=summary, blocks=blocks, toc=toc
    )
    page = out / "index.html"
    try:
        page.write_text(text)
    except OSError as exc:
        raise OSError(
            f"out_dir {out}: cannot write {page.name} ({exc.strerror or exc}); choose a writable "
            "folder, or make the file writable"
        ) from exc
    return page
