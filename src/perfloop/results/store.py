"""The results history: an embedded SQLite file, one tidy row per measurement.

Each row is committed as soon as it is taken, in WAL mode with a busy
timeout, so two processes can write at once and an interrupted sweep keeps
every point already measured. Everything is stored as JSON or plain columns,
never pickle. Location: `--db PATH`, else $PERFLOOP_DB, else the user's data
directory (~/.local/share/perfloop/perfloop.db).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sqlite3
import uuid
from pathlib import Path

from perfloop.device import data_dir
from perfloop.harness.measurement import Measurement

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    command TEXT,
    env TEXT
);
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    created TEXT NOT NULL,
    op TEXT NOT NULL,
    variant TEXT NOT NULL,
    shape TEXT NOT NULL,
    dtype TEXT NOT NULL,
    graph INTEGER NOT NULL DEFAULT 0,
    median_ms REAL NOT NULL,
    p20_ms REAL, p80_ms REAL, iqr_ms REAL, ci_lo_ms REAL, ci_hi_ms REAL,
    n INTEGER NOT NULL,
    gbps REAL, tflops REAL, sol REAL,
    speedup REAL, speedup_lo REAL, speedup_hi REAL, baseline TEXT,
    samples TEXT NOT NULL,
    work TEXT, meta TEXT, warnings TEXT,
    device TEXT, env TEXT
);
CREATE INDEX IF NOT EXISTS m_key ON measurements(op, variant, shape, dtype);
CREATE TABLE IF NOT EXISTS artifacts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    created TEXT NOT NULL,
    kind TEXT NOT NULL,
    op TEXT, variant TEXT,
    payload TEXT NOT NULL
);
"""

COLUMNS = [
    "run_id", "created", "op", "variant", "shape", "dtype", "graph", "median_ms", "p20_ms",
    "p80_ms", "iqr_ms", "ci_lo_ms", "ci_hi_ms", "n", "gbps", "tflops", "sol", "speedup",
    "speedup_lo", "speedup_hi", "baseline", "device",
]  # fmt: skip


class StoreError(RuntimeError):
    """The database cannot be used; the message says which file and what to do."""


def default_path() -> Path:
    return Path(os.environ.get("PERFLOOP_DB") or data_dir() / "perfloop.db")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def shape_str(shape) -> str:
    return "x".join(str(int(s)) for s in shape)


class Store:
    """Results history in SQLite.

    >>> s = Store(":memory:")
    >>> run = s.new_run("doc")
    >>> s.runs()[0]["run_id"] == run
    True
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = str(path) if path is not None else str(default_path())
        if self.path != ":memory:":
            p = Path(self.path)
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"--db {p}: cannot create its folder ({exc}); pass a writable path") from exc
        try:
            self.conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA busy_timeout = 30000")
            if self.path != ":memory:":
                self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"--db {self.path}: not a usable perfloop database ({exc}). Move the file aside, "
                "or pass another --db / PERFLOOP_DB; nothing in it was changed."
            ) from exc

    def close(self) -> None:
        self.conn.close()

    def _write(self, sql: str, args: tuple) -> int:
        try:
            cur = self.conn.execute(sql, args)  # autocommit: each row lands at once
            return cur.lastrowid
        except sqlite3.OperationalError as exc:
            raise StoreError(f"--db {self.path}: write failed ({exc}); is it read-only?") from exc

    # ------------------------------------------------------------ writing
    def new_run(self, command: str = "", env: dict | None = None) -> str:
        run_id = dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self._write(
            "INSERT INTO runs(run_id, created, command, env) VALUES (?, ?, ?, ?)",
            (run_id, _now(), command, json.dumps(env or {})),
        )
        return run_id

    def add(
        self,
        run_id: str,
        m: Measurement,
        *,
        op: str,
        variant: str,
        shape,
        dtype: str,
        speedup=None,
        baseline: str | None = None,
    ) -> int:
        lo, hi = m.ci95_ms
        sp, sp_lo, sp_hi = (speedup.speedup, *speedup.ci) if speedup else (None, None, None)
        return self._write(
            """INSERT INTO measurements(run_id, created, op, variant, shape, dtype, graph,
                median_ms, p20_ms, p80_ms, iqr_ms, ci_lo_ms, ci_hi_ms, n, gbps, tflops, sol,
                speedup, speedup_lo, speedup_hi, baseline, samples, work, meta, warnings,
                device, env)
               VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
            (
                run_id, _now(), op, variant,
                shape if isinstance(shape, str) else shape_str(shape), dtype,
                int(bool(m.meta.get("graph"))), m.median_ms, m.p20_ms, m.p80_ms, m.iqr_ms,
                lo, hi, m.n, m.gbps, m.tflops, m.sol, sp, sp_lo, sp_hi, baseline,
                json.dumps(list(m.samples_ms)),
                json.dumps(m.work.__dict__ if m.work else None),
                json.dumps(m.meta), json.dumps(list(m.warnings)),
                (m.env.get("device") or {}).get("name"), json.dumps(m.env),
            ),
        )  # fmt: skip

    def add_artifact(self, run_id: str, kind: str, payload: dict, op=None, variant=None) -> int:
        return self._write(
            "INSERT INTO artifacts(run_id, created, kind, op, variant, payload) VALUES (?,?,?,?,?,?)",
            (run_id, _now(), kind, op, variant, json.dumps(payload, default=str)),
        )

    # ------------------------------------------------------------ reading
    def runs(self) -> list[dict]:
        q = """SELECT r.run_id, r.created, r.command, COUNT(m.id) AS rows
               FROM runs r LEFT JOIN measurements m ON m.run_id = r.run_id
               GROUP BY r.run_id ORDER BY r.created DESC, r.rowid DESC"""
        return [dict(r) for r in self.conn.execute(q)]

    def resolve_run(self, run_id: str) -> str:
        """A run id, or 'latest' / 'previous'; raises StoreError listing recent runs."""
        runs = self.runs()
        if run_id in ("latest", "last") and runs:
            return runs[0]["run_id"]
        if run_id == "previous" and len(runs) > 1:
            return runs[1]["run_id"]
        matches = [r["run_id"] for r in runs if r["run_id"].startswith(run_id)]
        if len(matches) == 1:
            return matches[0]
        recent = ", ".join(r["run_id"] for r in runs[:5]) or "none yet"
        why = "is ambiguous" if matches else "does not exist"
        raise StoreError(f"run {run_id!r} {why} in {self.path}; recent runs: {recent}")

    def _select(self, table: str, **where) -> list[dict]:
        """Rows of `table` matching the non-None column filters, oldest first."""
        cols = {k: v for k, v in where.items() if v is not None}
        q = f"SELECT * FROM {table}" + (" WHERE " + " AND ".join(f"{k} = ?" for k in cols) if cols else "")
        return [dict(r) for r in self.conn.execute(q + " ORDER BY id", list(cols.values()))]

    def rows(self, run_id: str | None = None, op: str | None = None) -> list[dict]:
        out = self._select("measurements", run_id=run_id, op=op)
        for d in out:
            for k in ("samples", "work", "meta", "warnings", "env"):
                d[k] = json.loads(d[k]) if d[k] else None
        return out

    def artifacts(self, run_id: str | None = None, kind: str | None = None) -> list[dict]:
        return [
            a | {"payload": json.loads(a["payload"])}
            for a in self._select("artifacts", run_id=run_id, kind=kind)
        ]

    def measurement(self, row: dict) -> Measurement:
        from perfloop.harness.measurement import Work

        return Measurement(
            samples_ms=tuple(row["samples"]),
            work=Work(**row["work"]) if row.get("work") else None,
            label=f"{row['op']}/{row['variant']}",
            env=row.get("env") or {},
            meta=row.get("meta") or {},
        )

    # ------------------------------------------------------------ export
    def export_csv(self, run_id: str | None = None) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in self.rows(run_id):
            w.writerow(r)
        return buf.getvalue()

    def export_json(self, run_id: str | None = None) -> str:
        return json.dumps(self.rows(run_id), indent=1)
