"""What tune says: the table of trials (each candidate alone, then the stacks, predicted beside
realized, the loss check, memory, warm-up), where a prediction missed, the confirmation (the best
kept beside torch.compile alone, interleaved with the unchanged script), the lines to add."""

from __future__ import annotations

from perfloop.workflows.tune.trials import CheckedOn
from perfloop.workflows.tune.tuner import Result, Trial, lines_to_add, missed


def _per_s(tokens: int | None, ms: float | None) -> float | None:
    return tokens * 1e3 / ms if tokens and ms else None


def _row(t: Trial, base: Trial, tokens: int | None = None) -> dict:
    s = t.stats or {}
    runs = [r for r in t.runs if r.get("ok")]
    peak = max((r["peak_mb"] for r in runs), default=None)
    warm = sorted(r["warm_s"] for r in runs if r.get("warm_s") is not None)
    base_warm = sorted(r["warm_s"] for r in base.runs if r.get("warm_s") is not None)
    return {
        "candidate": t.label,
        "names": list(t.names),
        "runs": len(runs),
        "median_ms": s.get("median_ms"),
        "tokens_per_s": _per_s(tokens, s.get("median_ms")),  # a generation script's
        "speedup": s.get("speedup"),
        "ci": list(s["ci"]) if s else None,
        "p_value": s.get("p_value"),
        "predicted_ms": t.predicted_ms,
        "realized_ms": (s["base_ms"] - s["median_ms"]) if s else None,
        "verified": t.verdict.ok if t.verdict and t.verdict.checked else None,
        "check": _check(t),
        "loss_check": t.verdict.to_dict() if t.verdict else None,
        "peak_mb": peak,
        "warmup_s": warm[0] if warm else None,
        "warmup_extra_s": (warm[0] - base_warm[0]) if warm and base_warm else None,
        "run_s": [r.get("took_s") for r in t.runs],  # each search run's wall time, start-up included
        "confirm_s": [r.get("took_s") for r in t.final_runs],
        # each run's candidates' own work on the model (pl.patch's checks and first builds)
        "setup_s": [r.get("setup_s") or {} for r in [*t.runs, *t.final_runs]],
        "builds_s": [r.get("builds_s", 0.0) for r in [*t.runs, *t.final_runs]],  # of it, C++ builds
        "kept": t.kept,
        "error": t.error,
        "cut": t.cut,  # the error is the budget's
        "missed": missed(t) or None,
        "stacked_on": t.step["over"] if t.step else None,
        "over_stacked_on": t.step.get("speedup") if t.step else None,
        "taken": t.step["taken"] if t.step else None,
        "confirmed": _final(t, tokens),
    }


def _check(t: Trial) -> str | None:
    """The check's outcome in words: never "ok" where nothing was compared (no loss, no logits)."""
    if t.verdict is None:
        return None
    if not t.verdict.checked:
        return "not checked"
    return "ok" if t.verdict.ok else "refused"


def _final(t: Trial, tokens: int | None = None) -> dict | None:
    if not t.final:
        return None
    return {
        "runs": len(t.final_runs),
        "median_ms": t.final["median_ms"],
        "tokens_per_s": _per_s(tokens, t.final["median_ms"]),
        "speedup": t.final["speedup"],
        "ci": list(t.final["ci"]),
        "p_value": t.final["p_value"],
    }


def payload(r: Result) -> dict:
    base = r.trials[0]
    speed = {t.label: t.stats["speedup"] for t in r.trials[1:] if t.stats}
    b, c, found = r.best, r.compile_alone, r.searched
    best, comp = r.speedup(b), r.speedup(c)  # both confirmed, in the same interleaved rounds, or None
    tokens = next((x["tokens_per_step"] for x in base.runs if x.get("tokens_per_step")), None)
    return {
        "script": r.script,
        "device": r.device,
        "checked_on": r.checked_on.value,
        "warmup": r.warmup,
        "baseline_ms": _base_median(r),
        "findings": [{k: f.get(k) for k in ("kind", "title", "saves_ms", "share")} for f in r.findings],
        "tokens_per_step": tokens,  # a generation script's: the tokens one step (model call) picks
        "candidates": [_row(t, base, tokens) for t in r.trials[1:]],
        "speedups": speed,  # the search's, each alone against the search's baselines
        "best": b.label if b else None,  # kept: confirmed faster over runs
        "best_speedup": best,  # confirmed
        "compile_speedup": comp,  # confirmed, in the same rounds as the best (None: not confirmed)
        "compile_reference": c.label if c else None,  # the torch.compile mode read against
        "best_over_compile": (best / comp) if best and comp else None,  # one regime: the confirmation's
        "confirmed": b is not None,
        "searched_best": found.label if found else None,  # the search's pick, confirmed or not
        "searched_speedup": found.stats["speedup"] if found and found.stats else None,
        "why_nothing_kept": _why_nothing(r) if b is None else None,
        "confirmation_baseline_ms": _base_median(r, final=True),
        "confirmation_rounds": len(base.final_runs),
        "lines": lines_to_add(b, r.sites),
        "sites": r.sites,  # where the script builds its model and optimizer, and first calls it
        "elapsed_s": r.elapsed_s,
        "budget_s": r.budget_s,
        "stopped": r.stopped or None,
        "notes": r.notes,
    }


def _why_nothing(r: Result) -> str:
    found = r.searched
    if found is None:
        return (
            f"no candidate was both verified on the {r.checked_on.value} and faster at 95% confidence "
            "in the search"
        )
    if not found.final:
        return f"the search's best ({found.label}) was not confirmed: the budget ran out before it"
    f = found.final
    return (
        f"the search's best ({found.label}) was not confirmed faster as the script is written: "
        f"{f['speedup']:.3f}x [{f['ci'][0]:.3f}, {f['ci'][1]:.3f}] over {len(found.final_runs)} run(s)"
    )


def _base_median(r: Result, final: bool = False) -> float | None:
    s = r.trials[0].samples(r.warmup, final=final)
    return sorted(s)[len(s) // 2] if s else None


_DASH = "-"


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


_CHECK = {  # what a candidate is checked on -> (its column, the checks' heading)
    CheckedOn.LOSS: ("loss", "loss checks (tolerance from the script's own spread):"),
    CheckedOn.TOKENS: (
        "toks",
        "token checks (greedy tokens and top logits against the script's at its seed, to the first tie):",
    ),
}


def text(r: Result) -> list[str]:
    data = payload(r)
    rate = _per_s(data["tokens_per_step"], data["baseline_ms"])
    out = [
        f"perfloop tune {r.script} on {r.device}: baseline {_fmt(data['baseline_ms'], '.3f')} ms/step"
        + (f" ({rate:.1f} tokens/s)" if rate else "")
    ]
    if any(t.step for t in r.trials):
        out.append("search: each candidate alone, then stacked on the best (+: taken over what it adds to)")
    head = (
        f"{'candidate':34} {'ms/step':>9} {'speed-up [95% CI]':>22} {'predicted':>9} {'realized':>9} "
        f"{_CHECK[r.checked_on][0]:>9} {'peak MB':>8} {'warm-up':>8}  kept"
    )
    out.append(head)
    for row in data["candidates"]:
        ci = row["ci"]
        sp = f"{row['speedup']:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}]" if row["speedup"] else "-"
        loss = {"ok": "ok", "refused": "NO", "not checked": "unchecked", None: "-"}[row["check"]]
        mark = {True: "+ ", False: "  ", None: ""}[row["taken"]]
        out.append(
            f"{(mark + row['candidate'])[:34]:34} {_fmt(row['median_ms'], '9.3f', _DASH)} {sp:>22} "
            f"{_fmt(row['predicted_ms'], '9.3f', _DASH)} {_fmt(row['realized_ms'], '9.3f', _DASH)} "
            f"{loss:>9} {_fmt(row['peak_mb'], '8.0f', _DASH)} {_fmt(row['warmup_s'], '7.1f', _DASH)}s  "
            f"{'yes' if row['kept'] else 'no'}"
        )
    out.append(_CHECK[r.checked_on][1])
    for row in data["candidates"]:
        if row["error"]:
            out.append(f"  {row['candidate']}: {'' if row['cut'] else 'failed: '}{row['error']}")
        elif row["loss_check"]:
            out.append(f"  {row['candidate']}: {row['loss_check']['reason']}")
    misses = [row["missed"] for row in data["candidates"] if row["missed"]]
    if misses:
        out.append("predictions that missed by more than 30%:")
        out.extend(f"  {m}" for m in misses)
    out.extend(_verdict_lines(data))
    return out


def _verdict_lines(data: dict) -> list[str]:
    out = []
    rows = {row["candidate"]: row for row in data["candidates"]}
    if data["confirmation_rounds"]:
        out.append(
            f"confirmed, interleaved with the unchanged script as written "
            f"({_fmt(data['confirmation_baseline_ms'], '.3f')} ms/step), 95% CI over runs:"
        )
        for name in dict.fromkeys(n for n in (data["compile_reference"], data["searched_best"]) if n in rows):
            c = rows[name]["confirmed"]
            if c:
                rate = f" ({c['tokens_per_s']:.1f} tokens/s)" if c["tokens_per_s"] else ""
                out.append(
                    f"  {name}: {c['median_ms']:.3f} ms/step{rate}, {c['speedup']:.3f}x "
                    f"[{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] over {c['runs']} run(s)"
                )
    if data["best"]:
        vs = ""
        if data["best_over_compile"] and data["compile_reference"] != data["best"]:
            vs = (
                f"; torch.compile alone ({data['compile_reference']}) {data['compile_speedup']:.3f}x in the "
                f"same runs, so {data['best_over_compile']:.2f}x compile's"
            )
        out.append(f"best kept: {data['best']}: {data['best_speedup']:.3f}x the unchanged script{vs}")
        out.append("to keep it, add to the script:")
        out.extend(f"    {line}" for line in data["lines"])
    else:
        out.append(f"nothing confirmed: {data['why_nothing_kept']}; no line to add")
    if data["stopped"]:
        out.append(f"stopped early ({data['stopped']}): what was measured is above")
    out.append(f"tune took {data['elapsed_s']:.0f} s of a {data['budget_s']:.0f} s budget")
    out.extend(f"note: {n}" for n in data["notes"])
    return out
