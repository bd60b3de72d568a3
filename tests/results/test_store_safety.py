"""Nothing lost: exports never overwrite the database, foreign files are left untouched, a
failed command leaves no empty run, a corrupt row is skipped with a word (issue 15, 1-4, 10)."""

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

import perfloop as pl
from perfloop.cli import main
from perfloop.results.store import Store, StoreError


def _db_with_a_row(path):
    s = Store(path)
    run = s.new_run("seed")
    s.add(
        run, pl.Measurement(samples_ms=(1.0, 1.1, 0.9)), op="gelu", variant="naive", shape=(8,), dtype="fp32"
    )
    s.close()
    return run


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("flag", ["--csv", "--export-json"])
def test_an_export_onto_the_database_is_refused_and_the_database_survives(tmp_path, capsys, flag):
    db = tmp_path / "r.db"
    _db_with_a_row(db)
    assert main(["report", "--db", str(db), flag, str(db)]) == 2
    assert "the database itself" in capsys.readouterr().err
    assert len(Store(db).rows()) == 1  # still a database, with its row


def test_an_export_over_a_foreign_file_needs_force(tmp_path, capsys):
    db, notes = tmp_path / "r.db", tmp_path / "notes.txt"
    _db_with_a_row(db)
    notes.write_text("my notes\n")
    assert main(["report", "--db", str(db), "--csv", str(notes)]) == 2
    assert "not a perfloop export" in capsys.readouterr().err and notes.read_text() == "my notes\n"
    assert main(["report", "--db", str(db), "--csv", str(notes), "--force"]) == 0
    assert notes.read_text().startswith("run_id,")
    assert main(["report", "--db", str(db), "--csv", str(notes)]) == 0  # our own export: replaced freely


def test_a_foreign_sqlite_file_is_refused_untouched(tmp_path, capsys):
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE runs (id INTEGER, name TEXT)")  # another program's `runs`
    con.execute("INSERT INTO runs VALUES (1, 'x')")
    con.commit()
    con.close()
    before = _digest(db)
    with pytest.raises(StoreError, match="left untouched"):
        Store(db)
    assert (
        main(["bench", "gelu", "--variant", "builtin", "--shape", "64", "--db", str(db), "--budget", "0.1"])
        == 2
    )
    assert "not a perfloop database" in capsys.readouterr().err
    assert _digest(db) == before
    tables = {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
    assert tables == {"runs"} and not (tmp_path / "other.db-wal").exists()


def test_a_newer_schema_is_refused(tmp_path):
    db = tmp_path / "new.db"
    _db_with_a_row(db)
    con = sqlite3.connect(db)
    con.execute("PRAGMA user_version = 7")
    con.close()
    with pytest.raises(StoreError, match="schema version 7"):
        Store(db)


def test_a_failed_command_leaves_no_run(tmp_path):
    db = str(tmp_path / "f.db")
    assert (
        main(["bench", "gelu", "--variant", "builtin", "--shape", "64", "--db", db, "--budget", "0.1"]) == 0
    )
    first = Store(db).runs()
    assert len(first) == 1
    assert main(["bench", "matmul_relu", "--shape", "64x64", "--db", db, "--budget", "0.1"]) == 2  # bad shape
    assert Store(db).runs() == first  # `compare previous latest` still means the last two real runs
    s = Store(db)
    s.new_run("nothing measured")
    assert len(s.runs()) == 1


def test_a_corrupt_row_is_skipped_with_a_word(tmp_path, capsys):
    db = tmp_path / "c.db"
    _db_with_a_row(db)
    s = Store(db)
    run = s.new_run("second")
    s.add(run, pl.Measurement(samples_ms=(2.0, 2.1)), op="gelu", variant="builtin", shape=(8,), dtype="fp32")
    sqlite3.connect(db, isolation_level=None).execute(
        "UPDATE measurements SET samples = '{broken' WHERE id = 1"
    )
    assert main(["report", "--db", str(db)]) == 0
    out = capsys.readouterr()
    assert "builtin" in out.out and "corrupt JSON" in out.err


def test_a_read_only_database_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    import os

    db = tmp_path / "ro.db"
    _db_with_a_row(db)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real(p, mode))
    assert main(["bench", "gelu", "--variant", "builtin", "--shape", "64", "--db", str(db)]) == 2
    assert "read-only" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes read-only folders")
def test_a_wal_database_in_a_read_only_folder_is_read_not_called_unusable(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    _one_row(folder / "r.db")
    folder.chmod(0o555)
    try:
        assert [r["op"] for r in Store(folder / "r.db").rows()] == ["gelu"]
        with pytest.raises(StoreError, match="read-only"):
            Store(folder / "r.db").check_writable()
    finally:
        folder.chmod(0o755)


def test_a_folder_reported_unwritable_opens_the_database_immutable_and_reads_it(tmp_path, monkeypatch):
    _one_row(tmp_path / "r.db")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    before = sorted(p.name for p in tmp_path.iterdir())
    reader = Store(tmp_path / "r.db")
    assert [r["op"] for r in reader.rows()] == ["gelu"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no -shm or -wal made beside it
    reader.close()


def _one_row(path) -> None:
    from perfloop.harness.measurement import Measurement

    s = Store(path)
    s.add(
        s.new_run("x"),
        Measurement(samples_ms=(1.0, 1.1, 0.9)),
        op="gelu",
        variant="v",
        shape=(4,),
        dtype="fp32",
    )
    s.close()


def test_a_result_finished_while_another_process_holds_the_database_is_written_aside_not_lost(
    tmp_path, capsys
):
    """issue 52's probe: a database locked longer than the busy wait discarded the finished
    measurement with a traceback. Now the rows go to a file beside it, said once, and
    `perfloop runs --import-aside` adds them once the lock is gone."""
    db = tmp_path / "h.db"
    _db_with_a_row(db)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process, mid-transaction
    store = Store(db, busy_s=0.3)
    m = pl.Measurement(samples_ms=(1.0, 1.1, 1.2), label="late")
    with pytest.warns(UserWarning, match=r"stayed locked .* written aside to (\S+\.jsonl)") as said:
        store.add("r-late", m, op="gelu", variant="late", shape=(8,), dtype="fp32")
        store.add("r-late", m, op="gelu", variant="later", shape=(8,), dtype="fp32")
    assert len(said) == 1  # said once, both rows in the one file
    aside = store.aside
    assert len(Path(aside).read_text().splitlines()) == 3  # the run's row + its 2 measurements
    holder.execute("ROLLBACK")
    holder.close()
    assert main(["runs", "--db", str(db), "--import-aside", aside]) == 0
    assert "added 3 row(s)" in capsys.readouterr().out
    got = sqlite3.connect(db).execute("SELECT variant FROM measurements WHERE run_id = 'r-late'").fetchall()
    assert sorted(v for (v,) in got) == ["late", "later"]


def test_a_file_that_is_not_rows_written_aside_is_refused(tmp_path, capsys):
    db = tmp_path / "h.db"
    _db_with_a_row(db)
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"sql": "DROP TABLE runs", "args": []}\n')
    assert main(["runs", "--db", str(db), "--import-aside", str(bad)]) == 2
    assert "not a file of rows written aside" in capsys.readouterr().err
    assert sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone()[0] >= 1


@pytest.mark.parametrize("version", [0, 1])
def test_a_history_of_every_earlier_schema_is_read_as_it_is_and_climbs_the_ladder_at_its_first_write(
    tmp_path, version
):
    """issue 52: a new schema version would have refused every existing history."""
    from perfloop.results import store as st

    db = tmp_path / "old.db"
    run = _db_with_a_row(db)
    con = sqlite3.connect(db)
    for v in range(st.SCHEMA_VERSION - 1, version - 1, -1):  # back down the ladder: as version wrote it
        for stmt in filter(str.strip, st.MIGRATIONS[v].split(";")):
            name = stmt.split("EXISTS")[1].split()[0] if "INDEX" in stmt else None
            if name:
                con.execute(f"DROP INDEX {name}")
    con.execute(f"PRAGMA user_version = {version}")
    con.commit()
    con.close()
    before = _digest(db)
    s = Store(db)
    assert [r["variant"] for r in s.rows(run)] == ["naive"]  # read as it is ...
    s.close()
    assert _digest(db) == before  # ... and reading changed nothing
    s = Store(db)
    s.add(
        s.new_run("later"),
        pl.Measurement(samples_ms=(2.0, 2.1)),
        op="gelu",
        variant="b",
        shape=(8,),
        dtype="fp32",
    )
    s.close()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == st.SCHEMA_VERSION
    indexes = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"m_run", "a_run", "m_key"} <= indexes
    assert con.execute("SELECT count(*) FROM measurements").fetchone()[0] == 2  # the old row kept
