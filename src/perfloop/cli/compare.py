"""`perfloop compare`: what got faster or slower between two stored runs, and whether it is noise."""

from __future__ import annotations

from perfloop.cli.args import FAILED, UsageError, open_store, parse_percent
from perfloop.cli.output import console, emit_json, table


def register(verb) -> None:
    p = verb("compare", "what got faster or slower between two runs, and whether it is noise", run, db=True)
    p.add_argument("run_a", help="run id (or 'previous')")
    p.add_argument("run_b", help="run id (or 'latest')")
    p.add_argument("--fail-above", metavar="PCT", help="exit 1 on a significant slowdown beyond PCT")


def run(args) -> int:
    from perfloop.harness import stats
    from perfloop.harness.measurement import fmt_ms
    from perfloop.results.store import StoreError

    store = open_store(args)
    try:
        a, b = store.resolve_run(args.run_a), store.resolve_run(args.run_b)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    limit = parse_percent(args.fail_above) if args.fail_above is not None else None

    def key(r):
        return (r["op"], r["variant"], r["shape"], r["dtype"], r["graph"])

    ra = {key(r): r for r in store.rows(a)}
    rb = {key(r): r for r in store.rows(b)}
    common = [k for k in ra if k in rb]
    if not common:
        raise UsageError(f"runs {a} and {b} share no (op, variant, shape, dtype) to compare")
    out, regressed = [], False
    for k in common:
        s = stats.independent_ratio(ra[k]["samples"], rb[k]["samples"])
        sig = s["p_value"] < 0.01 and not (s["ci"][0] <= 1.0 <= s["ci"][1])
        if not sig:
            verdict = "same (noise)"
        elif abs(s["ratio"] - 1) < 0.01:
            verdict = "same (<1%)"  # statistically detectable, practically nothing
        else:
            verdict = "slower" if s["ratio"] > 1 else "faster"
        fail = bool(limit is not None and sig and s["ratio"] > 1 + limit / 100)
        regressed |= fail
        out.append({"op": k[0], "variant": k[1], "shape": k[2], "dtype": k[3], "graph": bool(k[4]),
                    "a_ms": ra[k]["median_ms"], "b_ms": rb[k]["median_ms"], "ratio": s["ratio"],
                    "ci": s["ci"], "p_value": s["p_value"], "significant": sig,
                    "verdict": verdict, "regression": fail})  # fmt: skip
    if args.json:
        emit_json({"run_a": a, "run_b": b, "rows": out, "regressed": regressed})
    else:
        table(f"{b} against {a} (time ratio b/a; >1 is slower)",
              ["op", "variant", "shape", "dtype", "a", "b", "ratio [95% CI]", "p", "verdict"],
              [[r["op"], r["variant"], r["shape"], r["dtype"], fmt_ms(r["a_ms"]), fmt_ms(r["b_ms"]),
                f"{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]", f"{r['p_value']:.2g}",
                r["verdict"] + (" REGRESSION" if r["regression"] else "")] for r in out])  # fmt: skip
        if regressed:
            console().print(f"significant slowdown beyond {limit:g}%", style="red")
    return FAILED if regressed else 0
