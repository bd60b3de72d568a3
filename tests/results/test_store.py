"""The results store: tidy rows, concurrent writers, interruptions, bad databases."""

import json
import multiprocessing as mp
import sqlite3

import pytest

import perfloop as pl
from helpers import busy
from perfloop.results.store import Store, StoreError


def test_rows_round_trip_with_raw_samples(tmp_path):
    s = Store(tmp_path / "r.db")
    run = s.new_run("test")
    m = pl.bench(busy(0.2), work=pl.Work(bytes=1e6), budget_s=0.2)
    s.add(run, m, op="busy", variant="a", shape=(3, 5), dtype="fp32")
    [row] = s.rows(run)
    assert row["shape"] == "3x5" and row["samples"] == list(m.samples_ms)
    assert row["median_ms"] == pytest.approx(m.median_ms) and row["gbps"] == pytest.approx(m.gbps)
    assert s.measurement(row).median_ms == pytest.approx(m.median_ms)
    assert "busy" in s.export_csv(run).splitlines()[1]
    assert json.loads(s.export_json(run))[0]["variant"] == "a"
    raw = sqlite3.connect(tmp_path / "r.db").execute("SELECT samples FROM measurements").fetchone()[0]
    assert json.loads(raw) == list(m.samples_ms)  # JSON, not pickle


def _writer(path, tag, n):
    s = Store(path)
    run = s.new_run(tag)
    m = pl.Measurement(samples_ms=(1.0, 1.1, 0.9))
    for i in range(n):
        s.add(run, m, op="w", variant=tag, shape=(i + 1,), dtype="fp32")


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "c.db")
    Store(path).close()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, f"p{i}", 60)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = Store(path).rows()
    assert len(rows) == 120
    assert {r["variant"] for r in rows} == {"p0", "p1"}


def test_an_interrupted_sweep_keeps_the_points_already_measured(tmp_path):
    s = Store(tmp_path / "i.db")
    run = s.new_run("sweep")

    def factory(n):
        if n == 3:
            raise KeyboardInterrupt  # Ctrl-C while the third size is set up
        return busy(0.1 * n)

    def on_point(p):
        s.add(run, p.measurement, op="busy", variant="x", shape=(p.size,), dtype="fp32")

    with pytest.raises(KeyboardInterrupt):
        pl.sweep(factory, sizes=[1, 2, 3, 4], on_point=on_point, budget_s=0.2)
    assert [r["shape"] for r in Store(tmp_path / "i.db").rows(run)] == ["1", "2"]


def test_a_corrupt_database_is_a_clear_error_and_is_left_untouched(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    before = bad.read_bytes()
    with pytest.raises(StoreError, match="not a usable perfloop database"):
        Store(bad)
    assert bad.read_bytes() == before


def test_unknown_run_ids_list_the_recent_ones(tmp_path):
    s = Store(tmp_path / "u.db")
    run = s.new_run("x")
    s.add(run, pl.Measurement(samples_ms=(1.0, 1.1)), op="o", variant="v", shape=(1,), dtype="fp32")
    with pytest.raises(StoreError, match=f"does not exist.*{run}"):
        s.resolve_run("nope")
    assert s.resolve_run("latest") == run
