"""`perfloop compare`: what got faster or slower between two stored runs, judged against the
noise between runs of the same code (harness.gate), not only against the samples of each."""

from __future__ import annotations

import sys

from perfloop.cli.args import CANNOT_JUDGE, FAILED, UsageError, open_store, parse_percent
from perfloop.cli.output import console, emit_json, table


def register(verb) -> None:
    p = verb("compare", "what got faster or slower between two runs, and whether it is noise", run, db=True)
    p.add_argument(
        "run_a",
        help="run id (or 'previous'), or a JSON file: a perfloop export (report --export-json) "
        "or pytest-benchmark's (--benchmark-json; its samples with --benchmark-save-data)",
    )
    p.add_argument("run_b", help="run id (or 'latest'), or a JSON file as for run_a")
    p.add_argument("--fail-above", metavar="PCT", help="exit 1 on a slowdown beyond PCT and beyond the noise")
    p.add_argument("--strict", action="store_true", help="exit 3 when a row cannot be judged (say why)")
    p.add_argument("--only-changed", action="store_true", help="show only the rows judged faster or slower")
    p.add_argument(
        "--sort",
        choices=("order", "name", "ratio"),
        default="order",
        help="row order: as run a holds them (default), by name, or by b/a, largest slowdown first",
    )


def _key(r: dict) -> tuple:
    return (r["op"], r["variant"], r["shape"], r["dtype"], r["graph"])


def _devices(rows: list[dict]) -> set[str]:
    return {r["device"] or "?" for r in rows}


def _commit(rows: list[dict]) -> str | None:
    return next(((r.get("env") or {}).get("git") for r in rows if (r.get("env") or {}).get("git")), None)


def _histories(store, keys: list[tuple], commit: str | None, exclude: str) -> dict[tuple, list[float]]:
    """Each key's fast tail over the stored runs of the same code (but `exclude`), divided by
    its run's reference workload where the run has one; none for uncommitted code, which is
    not known to be the same."""
    from perfloop.harness import gate

    out: dict[tuple, list[float]] = {k: [] for k in keys}
    if store is None or commit is None or commit.endswith("-dirty"):
        return out
    refs = {r["run_id"]: r["samples"] for r in store.rows(op=gate.REFERENCE_OP)}
    for op in {k[0] for k in keys}:
        for r in store.rows(op=op):
            if _key(r) in out and r["run_id"] != exclude and (r.get("env") or {}).get("git") == commit:
                out[_key(r)].append(gate.normalized_tail(r["samples"], refs.get(r["run_id"])))
    return out


def _side(store, spec: str) -> tuple[str, list[dict]]:
    """A run's id and rows: from the store, or read from a JSON file."""
    from perfloop.results.imports import RowsFileError, looks_like_file, read_rows
    from perfloop.results.store import StoreError

    if looks_like_file(spec):
        try:
            return read_rows(spec)
        except RowsFileError as exc:
            raise UsageError(str(exc)) from None
    try:
        run = store.resolve_run(spec)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    return run, store.rows(run)


def run(args) -> int:
    from perfloop.results.imports import looks_like_file

    files = all(looks_like_file(s) for s in (args.run_a, args.run_b))
    store = None if files else open_store(args, writing=False)
    (a, rows_a), (b, rows_b) = _side(store, args.run_a), _side(store, args.run_b)
    limit = parse_percent(args.fail_above) if args.fail_above is not None else None
    if not rows_a or not rows_b:
        if _profiles(store, a, b):
            return _compare_profiles(args, *_profiles(store, a, b), a, b)
        raise UsageError(
            f"{_holds(store, a, rows_a)}; {_holds(store, b, rows_b)}: compare takes two benchmark runs "
            "(bench, sweep, demo) or two profile runs (profile --script / --trace-file)"
        )
    if _devices(rows_a) != _devices(rows_b):
        raise UsageError(
            f"runs {a} ({', '.join(sorted(_devices(rows_a)))}) and {b} "
            f"({', '.join(sorted(_devices(rows_b)))}) ran on different devices: their times "
            "cannot be compared; compare runs taken on one device"
        )
    out = _judged(store, a, b, rows_a, rows_b, limit)
    if out is None:
        return _compare_profiles(args, *_profiles(store, a, b), a, b)
    regressed = any(r["regression"] for r in out)
    unjudged = [r for r in out if r["verdict"].startswith("cannot judge")]
    code = FAILED if regressed else (CANNOT_JUDGE if args.strict and unjudged else 0)
    shown = _ordered(out, args.sort, args.only_changed)
    if args.json:
        emit_json(
            {"run_a": a, "run_b": b, "rows": shown, "regressed": regressed, "cannot_judge": len(unjudged)}
            | {"not_shown": len(out) - len(shown)}
        )
        return code
    _print(a, b, shown, limit, regressed, hidden=len(out) - len(shown))
    for r in unjudged if args.strict else []:
        print(
            f"perfloop compare: --strict: {r['op']}/{r['variant']} {r['shape']}: {r['verdict']}",
            file=sys.stderr,
        )
    return code


def _ordered(out: list[dict], sort: str, only_changed: bool) -> list[dict]:
    """The rows to show, in the order asked: --only-changed keeps those judged faster or slower."""
    rows = [r for r in out if short(r["verdict"], False) in ("faster", "slower")] if only_changed else out
    if sort == "name":
        return sorted(rows, key=lambda r: (r["op"], r["variant"], r["shape"], r["dtype"]))
    if sort == "ratio":
        return sorted(rows, key=lambda r: -(r["b_ms"] / r["a_ms"]) if r["a_ms"] else 0.0)
    return list(rows)


def _holds(store, run: str, rows: list) -> str:
    """What a run holds, in words, where compare cannot take it."""
    if rows or store is None:
        return f"{run} holds measurements"
    profiled = _profiles(store, run, run)
    return f"{run} holds {'a step profile and ' if profiled else ''}no measurements"


def _judged(store, a: str, b: str, rows_a: list, rows_b: list, limit) -> list[dict] | None:
    """One row per (op, variant, shape, dtype, graph) both runs hold, with gate.judge's verdict;
    None where they share none but both hold a step profile."""
    from perfloop.harness import gate

    ref_a = next((r["samples"] for r in rows_a if r["op"] == gate.REFERENCE_OP), None)
    ref_b = next((r["samples"] for r in rows_b if r["op"] == gate.REFERENCE_OP), None)
    ra = {_key(r): r for r in rows_a if r["op"] != gate.REFERENCE_OP}
    rb = {_key(r): r for r in rows_b if r["op"] != gate.REFERENCE_OP}
    common = [k for k in ra if k in rb]
    if not common and _profiles(store, a, b):
        return None
    if not common:
        raise UsageError(f"runs {a} and {b} share no (op, variant, shape, dtype) to compare")
    kind = "cuda" if (rows_a[0].get("env") or {}).get("device", {}).get("kind") == "cuda" else "cpu"
    histories = _histories(store, common, _commit(rows_a), b)
    out = []
    for k in common:
        if not ra[k]["samples"] or not rb[k]["samples"]:
            out.append(_row(k, ra[k], rb[k], _no_samples(ra[k], rb[k]), "medians only"))
            continue
        v = gate.judge(
            ra[k]["samples"],
            rb[k]["samples"],
            fail_above_pct=limit,
            kind=kind,
            a_ref=ref_a,
            b_ref=ref_b,
            history=histories[k],
            contended=gate.contended(ra[k]["meta"]) or gate.contended(rb[k]["meta"]),
        )
        out.append(_row(k, ra[k], rb[k], v, v.method))
    return out


def _row(k: tuple, ra: dict, rb: dict, v, method: str) -> dict:
    """One compared key: its two medians and gate's verdict (gate.Verdict) on them."""
    return (
        dict(zip(("op", "variant", "shape", "dtype"), k[:4], strict=True))
        | {"graph": bool(k[4]), "a_ms": ra["median_ms"], "b_ms": rb["median_ms"]}
        | {"ratio": v.ratio, "drift": v.drift, "adjusted": v.adjusted, "noise_floor": v.floor}
        | {"floor_source": v.floor_source, "p_value": v.p_value, "verdict": v.verdict}
        | {"regression": v.regression, "method": method}
    )


def _no_samples(ra: dict, rb: dict):
    """The verdict on a key whose file kept only its statistics: its medians' ratio, not judged."""
    from perfloop.harness.gate import Verdict

    ratio = rb["median_ms"] / ra["median_ms"]
    why = (
        "cannot judge: the file keeps no samples, only statistics; save them "
        "(pytest --benchmark-save-data) to judge the change against the noise"
    )
    return Verdict(ratio, None, ratio, 0.0, "none (no samples)", 1.0, False, why)


def short(verdict: str, regression: bool) -> str:
    """A verdict for a table cell: its first words ("slower", "same", "cannot judge"); the whole
    of it is printed below the table."""
    head = verdict.split(":")[0].split(" (")[0].strip()
    return head + (" REGRESSION" if regression else "")


def _print(a: str, b: str, out: list[dict], limit, regressed: bool, hidden: int = 0) -> None:
    from perfloop.harness.measurement import fmt_ms

    columns = ["#", "op", "variant", "shape", "dtype", "a (median)", "b (median)", "b/a", "judged b/a"]
    table(
        f"{b} against {a} (b/a of the medians shown; judged b/a: the fast tails, divided by the "
        "machine's own pace where both runs timed it; >1 is slower)",
        [*columns, "noise floor", "p", "verdict"],
        [
            [str(i), r["op"], r["variant"], r["shape"], r["dtype"], fmt_ms(r["a_ms"]), fmt_ms(r["b_ms"])]
            + [f"{r['b_ms'] / r['a_ms']:.3f}" if r["a_ms"] else "-", f"{r['adjusted']:.3f}"]
            + [f"{r['noise_floor']:.1%}", f"{r['p_value']:.2g}", short(r["verdict"], r["regression"])]
            for i, r in enumerate(out, 1)
        ],
    )
    for i, r in enumerate(out, 1):
        if r["verdict"] != short(r["verdict"], False):
            console().print(f"{i}. {r['op']}/{r['variant']} {r['shape']}: {r['verdict']}")
    if hidden:
        console().print(f"{hidden} row(s) judged the same or not judged, not shown (--only-changed)")
    if not out:
        return
    how = out[0]["method"].split("; noise floor")[0]
    sources = ", ".join(sorted({r["floor_source"] for r in out}))
    console().print(f"judged on {how}; noise floor: {sources}")
    if limit is not None and regressed:
        console().print(f"slowdown beyond {limit:g}% and beyond the run-to-run noise", style="red")
    elif limit is not None and any(r["noise_floor"] * 100 > limit for r in out):
        console().print(
            f"note: the noise between runs here is above {limit:g}%, so a slowdown of {limit:g}% "
            "cannot be told from noise; it takes one past the floor",
            style="yellow",
        )


def _profiles(store, a: str, b: str):
    """The two runs' stored step profiles (`profile --script`), if both have one."""
    if store is None:
        return None
    pa = [x["payload"] for x in store.artifacts(a, kind="profile") if x["payload"].get("ops")]
    pb = [x["payload"] for x in store.artifacts(b, kind="profile") if x["payload"].get("ops")]
    return (pa[0], pb[0]) if pa and pb else None


def _compare_profiles(args, pa: dict, pb: dict, a: str, b: str) -> int:
    """Two profiled runs op by op and module by module: device time per call, each side."""
    from perfloop.analysis.attribution import compare_rows
    from perfloop.harness.measurement import fmt_ms

    ops = compare_rows(pa["ops"], pb["ops"], pa["calls"], pb["calls"])
    modules = compare_rows(pa["modules"], pb["modules"], pa["calls"], pb["calls"])
    totals = {k: (pa.get(k), pb.get(k)) for k in ("device_ms_per_call", "wall_ms_per_call")}
    if args.json:
        emit_json({"run_a": a, "run_b": b, "ops": ops, "modules": modules, "totals": totals})
        return 0
    for what, rows in (("op", ops), ("module", modules)):
        table(
            f"{b} against {a}: device time per call by {what}, largest change first",
            [what, "a", "b", "b/a", "change"],
            [
                [
                    r["name"][:60],
                    fmt_ms(r["a_ms"]),
                    fmt_ms(r["b_ms"]),
                    f"{r['ratio']:.2f}" if r["ratio"] is not None else "new",
                    f"{r['change_ms']:+.3f} ms",
                ]
                for r in rows[:15]
            ],
        )
    (da, db), (wa, wb) = totals["device_ms_per_call"], totals["wall_ms_per_call"]
    console().print(
        f"device {fmt_ms(da)} -> {fmt_ms(db)} per call; wall {fmt_ms(wa)} -> {fmt_ms(wb)} "
        "(one profile each: judge a speed-up by timing the step: bench, compare)"
    )
    return 0
