"""Measurement rows read from files, for `compare`: perfloop's own JSON export (`report
--export-json`, one run) and pytest-benchmark's saved JSON (`--benchmark-json`, `--benchmark-save`).
Each row has the keys `Store.rows` gives, so the comparison is the same code either way."""

from __future__ import annotations

import json
from pathlib import Path


class RowsFileError(ValueError):
    """A file compare cannot read as runs, with what was wrong and how to get a file it can."""


def looks_like_file(spec: str) -> bool:
    """Whether a run argument names a file (a path that exists, or one ending in .json)."""
    return spec.endswith(".json") or Path(spec).is_file()


def read_rows(spec: str) -> tuple[str, list[dict]]:
    """(a label for the run, its rows) from an exported or pytest-benchmark JSON file."""
    path = Path(spec)
    if not path.is_file():
        raise RowsFileError(
            f"{spec}: no such file; give a run id, or a JSON file written by "
            "`perfloop report --export-json` or pytest-benchmark"
        )
    try:
        data = json.loads(path.read_text(), parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise RowsFileError(f"{spec}: not JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("benchmarks"), list):
        return _pytest_benchmark(spec, data)
    if isinstance(data, list) and all(isinstance(r, dict) and "kind" in r for r in data):
        return _export(spec, data)
    raise RowsFileError(
        f"{spec}: neither a perfloop export (a list of rows with 'kind') nor a pytest-benchmark "
        "file (an object with 'benchmarks'); write one with `perfloop report --run ID "
        "--export-json FILE` or `pytest --benchmark-json FILE`"
    )


def _refuse_constant(word: str):
    raise ValueError(f"{word} is not a time")


def _export(spec: str, data: list[dict]) -> tuple[str, list[dict]]:
    rows = [r for r in data if r.get("kind") == "measurement"]
    runs = sorted({r.get("run_id") for r in rows})
    if not rows:
        raise RowsFileError(f"{spec}: the export holds no measurements (only step profiles, or nothing)")
    if len(runs) > 1:
        raise RowsFileError(
            f"{spec}: the export holds {len(runs)} runs ({', '.join(map(str, runs[:4]))}...); "
            "compare takes one run a side: export one with `perfloop report --run ID --export-json FILE`"
        )
    for r in rows:
        _check_samples(spec, f"{r.get('op')}/{r.get('variant')}", r.get("samples"))
    return f"{runs[0]} ({Path(spec).name})", rows


def _pytest_benchmark(spec: str, data: dict) -> tuple[str, list[dict]]:
    """pytest-benchmark keeps seconds; its samples only with --benchmark-save-data."""
    cpu = (data.get("machine_info") or {}).get("cpu") or {}
    device = cpu.get("brand_raw") or (data.get("machine_info") or {}).get("processor") or "cpu"
    commit = (data.get("commit_info") or {}).get("id")
    if commit and (data.get("commit_info") or {}).get("dirty"):
        commit += "-dirty"
    env = {"device": {"kind": "cpu", "name": device}, "git": commit}
    rows = []
    for b in data["benchmarks"]:
        stats = b.get("stats") or {}
        name = b.get("fullname") or b.get("name")
        if not name or not isinstance(stats.get("median"), (int, float)):
            raise RowsFileError(f"{spec}: a benchmark without a name or a median: {str(b)[:80]}")
        samples = [x * 1e3 for x in stats["data"]] if stats.get("data") else None
        _check_samples(spec, name, samples)
        rows.append(
            {
                "run_id": Path(spec).name,
                "op": name,
                "variant": b.get("group") or "pytest-benchmark",
                "shape": json.dumps(b.get("params"), sort_keys=True) if b.get("params") else "",
                "dtype": "",
                "graph": 0,
                "device": device,
                "median_ms": stats["median"] * 1e3,
                "samples": samples,
                "env": env,
                "meta": {},
            }
        )
    if not rows:
        raise RowsFileError(f"{spec}: the pytest-benchmark file holds no benchmarks")
    return f"{Path(spec).name} (pytest-benchmark)", rows


def _check_samples(spec: str, name: str, samples) -> None:
    if samples is None:
        return
    from perfloop.harness.measurement import Measurement

    if not isinstance(samples, list) or not all(isinstance(x, (int, float)) for x in samples):
        raise RowsFileError(f"{spec}: {name}: samples are not a list of numbers")
    try:
        Measurement(samples_ms=tuple(samples))  # what the store takes: finite times > 0
    except ValueError as exc:
        raise RowsFileError(f"{spec}: {name}: not a positive finite time: {exc}") from None
