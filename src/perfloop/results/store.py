"""The results history: an embedded SQLite file, one tidy row per measurement.

Each row is committed as soon as it is taken, in WAL mode with a busy
timeout, so two processes can write at once and an interrupted sweep keeps
every point already measured. Everything is stored as JSON or plain columns,
never pickle. A run is written with its first row: a command that fails before
measuring anything leaves no empty run behind. A file that is not a perfloop
database of this schema (another program's, an older or newer perfloop's) is
refused before anything is written to it. Location: `--db PATH`, else $PERFLOOP_DB, else the user's data
directory (~/.local/share/perfloop/perfloop.db).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from perfloop.settings import data_dir

if TYPE_CHECKING:  # the read-only verbs (runs, history, compare) import neither torch nor scipy
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
CREATE INDEX IF NOT EXISTS m_run ON measurements(run_id);
CREATE INDEX IF NOT EXISTS a_run ON artifacts(run_id, kind);
"""

SCHEMA_VERSION = 2  # PRAGMA user_version of a database this code wrote
# The ladder: MIGRATIONS[v] takes a database of version v to v + 1 (0: written before versions
# were recorded, the tables of 1). A database of an earlier version is read as it is and
# climbs the ladder at its first write, in one transaction with the new version: a failure
# leaves it as it was. A new schema adds its step here and a test from every earlier version.
MIGRATIONS = {
    0: "",
    1: """CREATE INDEX IF NOT EXISTS m_run ON measurements(run_id);
          CREATE INDEX IF NOT EXISTS a_run ON artifacts(run_id, kind);""",  # compare and report read by run
}
TABLES = {  # our tables and their columns, as SCHEMA makes them
    "runs": {"run_id", "created", "command", "env"},
    "measurements": {
        "id",
        "run_id",
        "created",
        "op",
        "variant",
        "shape",
        "dtype",
        "graph",
        "median_ms",
        "p20_ms",
        "p80_ms",
        "iqr_ms",
        "ci_lo_ms",
        "ci_hi_ms",
        "n",
        "gbps",
        "tflops",
        "sol",
        "speedup",
        "speedup_lo",
        "speedup_hi",
        "baseline",
        "samples",
        "work",
        "meta",
        "warnings",
        "device",
        "env",
    },
    "artifacts": {"id", "run_id", "created", "kind", "op", "variant", "payload"},
}

COLUMNS = [
    "run_id",
    "created",
    "op",
    "variant",
    "shape",
    "dtype",
    "graph",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "iqr_ms",
    "ci_lo_ms",
    "ci_hi_ms",
    "n",
    "gbps",
    "tflops",
    "sol",
    "speedup",
    "speedup_lo",
    "speedup_hi",
    "baseline",
    "device",
]
# after them: what each row is ("measurement", or a stored step profile's "profile op" / "profile
# module" row: its name, device ms per call in median_ms, the profile's calls)
PROFILE_COLUMNS = ["kind", "name", "calls"]
# then where each row came from: the commit its run measured, and when the run began
ORIGIN_COLUMNS = ["commit", "run_created"]


def is_our_export(path: str | os.PathLike) -> bool:
    """Whether an existing file is an export perfloop wrote (so overwriting it loses nothing)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return False
    csv_ours = head.startswith(",".join(COLUMNS))  # with or without the profile columns
    json_ours = head.lstrip().startswith("[") and ('"run_id"' in head or head.strip() == "[]")
    return csv_ours or json_ours


class StoreError(RuntimeError):
    """The database cannot be used; the message says which file and what to do."""


IN_MEMORY = ":memory:"  # SQLite's database that lives as long as its connection: no file


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

    def __init__(self, path: str | os.PathLike | None = None, busy_s: float = 30.0):
        self.path = str(path) if path is not None else str(default_path())
        self.busy_s = busy_s  # how long a write waits for another process's lock
        self.aside: str | None = None  # where rows went that waited longer (import_aside reads it)
        self._pending: dict[str, tuple[str, str, str]] = {}  # run_id -> (created, command, env)
        self._written: set[str] = set()  # runs whose row this store wrote or found
        self.skipped: list[str] = []  # stored rows that could not be read, and why
        self._wal = False
        self._version = SCHEMA_VERSION  # the file's, once read (_check_schema)
        if self.path != IN_MEMORY:
            p = Path(self.path)
            if p.is_dir():
                raise StoreError(f"database {p}: is a folder; give a file path, e.g. {p / 'perfloop.db'}")
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"database {p}: cannot create its folder ({exc}); pass a writable path"
                ) from exc
        # a database in a folder this process cannot write is read as immutable: SQLite would
        # otherwise need to create the WAL's -shm file beside it, and fail as if the file were bad
        frozen = (
            self.path != IN_MEMORY
            and Path(self.path).is_file()
            and not os.access(Path(self.path).parent, os.W_OK)
        )
        target = f"{Path(self.path).resolve().as_uri()}?immutable=1" if frozen else self.path
        try:
            self.conn = sqlite3.connect(target, timeout=busy_s, isolation_level=None, uri=frozen)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute(f"PRAGMA busy_timeout = {int(busy_s * 1000)}")
            self._fresh = self._check_schema()
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"database {self.path}: not a usable perfloop database ({exc}). Move the file aside, "
                "or pass another path (--db, PERFLOOP_DB); nothing in it was changed."
            ) from exc

    def _check_schema(self) -> bool:
        """True for an empty file (ours to create); raises StoreError, writing nothing, for one
        that holds other tables, or ours with other columns or another schema version."""
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables.discard("sqlite_sequence")
        if not tables:
            return True
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        problems = []
        if not 0 <= version <= SCHEMA_VERSION:  # earlier ones climb the ladder at the first write
            problems.append(f"schema version {version}, this perfloop reads up to {SCHEMA_VERSION}")
        self._version = version
        for name, cols in TABLES.items():
            if name not in tables:
                problems.append(f"no {name} table")
                continue
            have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({name})")}
            if have != cols:
                problems.append(f"table {name} has columns {sorted(have ^ cols)} that differ from ours")
        if problems:
            raise StoreError(
                f"database {self.path}: not a perfloop database of this version ({'; '.join(problems)}). "
                "It was left untouched; pass another path (--db, PERFLOOP_DB)."
            )
        return False

    def close(self) -> None:
        self.conn.close()

    def _write(self, sql: str, args: tuple) -> int:
        # SQLite answers "database is locked" at once, without its busy wait, where two
        # connections would deadlock (both switching a fresh file to WAL, or making its tables):
        # those are tried again, for up to the busy timeout
        if self.aside is not None:  # once aside, the run's later rows follow: one file holds them
            return self._write_aside(sql, args)
        deadline = time.monotonic() + self.busy_s
        while True:
            try:
                return self._write_once(sql, args)
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) and time.monotonic() > deadline:
                    return self._write_aside(sql, args)
                if "locked" not in str(exc):
                    raise StoreError(
                        f"database {self.path}: write failed ({exc}); is it read-only? Pass a writable "
                        "path (--db, PERFLOOP_DB)."
                    ) from None
                time.sleep(0.05)

    def _write_aside(self, sql: str, args: tuple) -> int:
        """Another process held the database longer than busy_s: the row goes to a file beside
        it (one JSON line per row), said once, so a finished result is never lost to a lock;
        `perfloop runs --import-aside FILE` (import_aside) adds the rows later."""
        import warnings

        if self.aside is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.aside = f"{self.path}.aside-{stamp}-{os.getpid()}.jsonl"
            warnings.warn(
                f"database {self.path} stayed locked by another process for {self.busy_s:g} s: "
                f"this run's results are written aside to {self.aside}; add them later with "
                f"`perfloop runs --db {self.path} --import-aside {self.aside}`",
                stacklevel=3,
            )
        with open(self.aside, "a") as f:
            f.write(json.dumps({"sql": sql, "args": list(args)}) + "\n")
        return -1

    def import_aside(self, path: str | os.PathLike) -> int:
        """Add the rows a busy database made this store write aside (`_write_aside`); the number
        added. Rows already there (a run's row) are kept as they are."""
        try:
            lines = Path(path).read_text().splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path}: not a file of rows written aside by perfloop ({exc})") from None
        for row in rows:
            if not (
                isinstance(row, dict) and str(row.get("sql", "")).lstrip().startswith(("INSERT", "UPDATE"))
            ):
                raise StoreError(
                    f"{path}: not a file of rows written aside by perfloop (a line holds {row!r:.80})"
                )
        for row in rows:
            self._write(row["sql"], tuple(row["args"]))
        return len(rows)

    def _write_once(self, sql: str, args: tuple) -> int:
        try:
            if not self._wal:  # the first write: WAL, and our tables in a fresh file
                if self.path != IN_MEMORY:
                    self.conn.execute("PRAGMA journal_mode = WAL")
                if self._fresh:  # in one transaction: another process never sees half the tables
                    self.conn.executescript(
                        f"BEGIN IMMEDIATE;{SCHEMA}PRAGMA user_version = {SCHEMA_VERSION};COMMIT;"
                    )
                    self._fresh = False
                elif self._version < SCHEMA_VERSION:
                    self._migrate()
                self._wal = True
            cur = self.conn.execute(sql, args)  # autocommit: each row lands at once
            return cur.lastrowid
        except sqlite3.OperationalError as exc:
            if self.conn.in_transaction:  # the tables' transaction, cut short: tried again whole
                self.conn.execute("ROLLBACK")
            if "locked" in str(exc):
                raise
            raise StoreError(
                f"database {self.path}: write failed ({exc}); is it read-only? Pass a writable path "
                "(--db, PERFLOOP_DB)."
            ) from exc

    def _migrate(self) -> None:
        """Climb the ladder from this database's version to ours, in one transaction (re-read
        under the lock: another process may have climbed it first)."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            for v in range(version, SCHEMA_VERSION):
                for stmt in filter(str.strip, MIGRATIONS[v].split(";")):
                    self.conn.execute(stmt)
            self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self._version = SCHEMA_VERSION

    def check_writable(self) -> None:
        """Raise StoreError now if the file cannot take a row (read-only file or folder), so a
        command fails before it measures, not after."""
        if self.path == IN_MEMORY:
            return
        p = Path(self.path)
        if (p.exists() and not os.access(p, os.W_OK)) or not os.access(p.parent, os.W_OK):
            raise StoreError(f"database {p}: read-only; pass a writable path (--db, PERFLOOP_DB)")

    def _ensure_run(self, run_id: str) -> None:
        """The run's row, written with its first measurement or artifact (once per store)."""
        if run_id in self._written:
            return
        self._written.add(run_id)
        created, command, env = self._pending.pop(run_id, (_now(), "", "{}"))
        self._write(
            "INSERT OR IGNORE INTO runs(run_id, created, command, env) VALUES (?, ?, ?, ?)",
            (run_id, created, command, env),
        )
        if command:  # another process (a rank) may have written it first, bare
            self._write(
                "UPDATE runs SET command = ?, env = ? WHERE run_id = ? AND command = ''",
                (command, env, run_id),
            )

    def adopt_run(self, run_id: str) -> None:
        """Give a run that other processes wrote rows into this store's command and env, if it
        has rows at all."""
        if run_id in self._pending and (self.has_rows(run_id) or self._select("artifacts", run_id=run_id)):
            self._ensure_run(run_id)

    def has_rows(self, run_id: str, op: str | None = None) -> bool:
        """Whether the run holds a measurement (of `op`, when given), without reading any."""
        if self._empty():
            return False
        q = "SELECT 1 FROM measurements WHERE run_id = ?" + (" AND op = ?" if op else "") + " LIMIT 1"
        return self.conn.execute(q, (run_id, op) if op else (run_id,)).fetchone() is not None

    # ------------------------------------------------------------ writing
    def new_run(self, command: str = "", env: dict | None = None) -> str:
        """A new run's id; the run is written with its first row (no run without rows)."""
        run_id = dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self._pending[run_id] = (_now(), command, json.dumps(env or {}))
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
        self._ensure_run(run_id)
        lo, hi = m.ci95_ms
        sp, sp_lo, sp_hi = (speedup.speedup, *speedup.ci) if speedup else (None, None, None)
        return self._write(
            """INSERT INTO measurements(run_id, created, op, variant, shape, dtype, graph,
                median_ms, p20_ms, p80_ms, iqr_ms, ci_lo_ms, ci_hi_ms, n, gbps, tflops, sol,
                speedup, speedup_lo, speedup_hi, baseline, samples, work, meta, warnings,
                device, env)
               VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
            (
                run_id,
                _now(),
                op,
                variant,
                shape if isinstance(shape, str) else shape_str(shape),
                dtype,
                int(bool(m.meta.get("graph"))),
                m.median_ms,
                m.p20_ms,
                m.p80_ms,
                m.iqr_ms,
                lo,
                hi,
                m.n,
                m.gbps,
                m.tflops,
                m.sol,
                sp,
                sp_lo,
                sp_hi,
                baseline,
                json.dumps(list(m.samples_ms)),
                json.dumps(m.work.__dict__ if m.work else None),
                json.dumps(m.meta),
                json.dumps(list(m.warnings)),
                (m.env.get("device") or {}).get("name"),
                json.dumps(m.env),
            ),
        )

    def add_artifact(self, run_id: str, kind: str, payload: dict, op=None, variant=None) -> int:
        self._ensure_run(run_id)
        return self._write(
            "INSERT INTO artifacts(run_id, created, kind, op, variant, payload) VALUES (?,?,?,?,?,?)",
            (run_id, _now(), kind, op, variant, json.dumps(payload, default=str)),
        )

    # ------------------------------------------------------------ reading
    def _empty(self) -> bool:
        """Nothing written to this file yet, by us or by another process."""
        if self._fresh:
            q = "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'measurements'"
            self._fresh = not self.conn.execute(q).fetchone()[0]
        return self._fresh

    def runs(self) -> list[dict]:
        if self._empty():
            return []
        q = """SELECT r.run_id, r.created, r.command, r.env,
                      (SELECT COUNT(*) FROM measurements m WHERE m.run_id = r.run_id) AS rows,
                      (SELECT COUNT(*) FROM artifacts a WHERE a.run_id = r.run_id) AS artifacts
               FROM runs r ORDER BY r.created DESC, r.rowid DESC"""
        out = []
        for r in self.conn.execute(q):
            d = dict(r)
            try:
                d["env"] = json.loads(d["env"]) if d["env"] else {}
            except json.JSONDecodeError:
                d["env"] = {}
            out.append(d)
        return out

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
        if self._empty():
            return []
        cols = {k: v for k, v in where.items() if v is not None}
        q = f"SELECT * FROM {table}" + (" WHERE " + " AND ".join(f"{k} = ?" for k in cols) if cols else "")
        return [dict(r) for r in self.conn.execute(q + " ORDER BY id", list(cols.values()))]

    def rows(self, run_id: str | None = None, op: str | None = None) -> list[dict]:
        out = []
        for d in self._select("measurements", run_id=run_id, op=op):
            try:
                for k in ("samples", "work", "meta", "warnings", "env"):
                    d[k] = json.loads(d[k]) if d[k] else None
            except (json.JSONDecodeError, TypeError) as exc:
                self.skipped.append(
                    f"row {d['id']} ({d['op']}/{d['variant']} {d['shape']}): corrupt JSON ({exc})"
                )
                continue
            out.append(d)
        return out

    def artifacts(self, run_id: str | None = None, kind: str | None = None) -> list[dict]:
        out = []
        for a in self._select("artifacts", run_id=run_id, kind=kind):
            try:
                out.append(a | {"payload": json.loads(a["payload"])})
            except json.JSONDecodeError as exc:
                self.skipped.append(f"artifact {a['id']} ({a['kind']}): corrupt JSON ({exc})")
        return out

    def measurement(self, row: dict) -> Measurement:
        from perfloop.harness.measurement import Measurement, Work

        return Measurement(
            samples_ms=tuple(row["samples"]),
            work=Work(**row["work"]) if row.get("work") else None,
            label=f"{row['op']}/{row['variant']}",
            env=row.get("env") or {},
            meta=row.get("meta") or {},
        )

    # ------------------------------------------------------------ export
    def export_csv(self, run_id: str | None = None) -> str:
        """Every measurement, then every stored step profile's op and module rows."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLUMNS + PROFILE_COLUMNS + ORIGIN_COLUMNS, extrasaction="ignore")
        w.writeheader()
        runs = {r["run_id"]: r for r in self.runs()}

        def origin(rid: str, env: dict | None) -> dict:
            run = runs.get(rid) or {}
            commit = (env or {}).get("git") or (run.get("env") or {}).get("git") or ""
            return {"commit": commit, "run_created": run.get("created", "")}

        for r in self.rows(run_id):
            w.writerow(r | {"kind": "measurement"} | origin(r["run_id"], r.get("env")))
        for a in self.artifacts(run_id, kind="profile"):
            p, calls = a["payload"], a["payload"].get("calls") or 1
            for what in ("op", "module"):
                for row in p.get(f"{what}s") or []:
                    w.writerow(
                        {
                            "run_id": a["run_id"],
                            "created": a["created"],
                            "op": a["op"],
                            "variant": a["variant"],
                            "kind": f"profile {what}",
                            "name": row.get("name"),
                            "calls": calls,
                            "median_ms": row.get("device_ms", 0.0) / calls,
                            "device": p.get("kind"),
                        }
                        | origin(a["run_id"], None)
                    )
        return buf.getvalue()

    def export_json(self, run_id: str | None = None) -> str:
        """A list: every measurement row, then every stored profile (its whole payload)."""
        rows = [r | {"kind": "measurement"} for r in self.rows(run_id)]
        rows += [
            {
                "kind": "profile",
                "run_id": a["run_id"],
                "created": a["created"],
                "op": a["op"],
                "variant": a["variant"],
                "profile": a["payload"],
            }
            for a in self.artifacts(run_id, kind="profile")
        ]
        return json.dumps(rows, indent=1, default=str)
