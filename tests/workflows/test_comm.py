"""Collectives and distributed sweeps on torch.distributed with gloo: 2 ranks on the CPU."""

import json
import time

import pytest

from perfloop.cli import main
from perfloop.results.report import render_html
from perfloop.results.store import Store
from perfloop.workflows import comm


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert comm.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert comm.bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert comm.bus_factor("broadcast", 8) == 1.0


def test_all_five_collectives_are_correct_and_timed_on_two_ranks(tmp_path, capsys):
    db = str(tmp_path / "c.db")
    # 1000 bytes does not divide evenly into 2 ranks of fp32 x 2: rounded, and reported as moved
    rc = main(["comm", "--nproc", "2", "--sizes", "1000", "65536", "--iters", "3", "--json", "--db", db])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {r["collective"] for r in rows} == set(comm.COLLECTIVES)
    assert all(r["correct"] and r["ranks"] == 2 and r["backend"] == "gloo" for r in rows)
    assert all(r["time_ms"] > 0 and r["busbw_gbps"] > 0 for r in rows)
    assert {r["bytes"] for r in rows if r["collective"] == "all_reduce"} == {1000, 65536}
    # nccl-tests' size: all-gather counts its gathered output, reduce-scatter its full input
    for name in ("all_gather", "reduce_scatter"):
        assert {r["bytes"] for r in rows if r["collective"] == name} == {2000, 131072}
    page = render_html(Store(db), tmp_path / "rep").read_text()
    assert "communication" in page and (tmp_path / "rep" / "comm_busbw.png").exists()


def test_world_size_one_and_bad_arguments_are_clear(capsys, tmp_path):
    db = str(tmp_path / "w.db")
    assert main(["comm", "--db", db]) == 2
    assert "world size 1" in capsys.readouterr().err
    assert main(["comm", "--nproc", "1", "--db", db]) == 2
    assert main(["comm", "--nproc", "2", "--collective", "allreduce", "--db", db]) == 2
    assert "valid: all_reduce" in capsys.readouterr().err


def test_a_rank_that_dies_ends_the_others_with_an_error_not_a_hang():
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="failed"):
        comm.spawn(2, "_fail_on_rank", 1, timeout_s=10)
    assert time.monotonic() - t < 120


def test_a_result_larger_than_a_pipe_comes_back_without_waiting_for_the_deadline():
    """Rank 0's result travels through a pipe: 1 MiB blocks its sender until read (a
    sharded sweep's Measurements did, on two H200s, until the spawner's deadline)."""
    t = time.monotonic()
    out = comm.spawn(2, "_big_result", 1 << 20, timeout_s=30)
    assert out == "x" * (1 << 20)
    assert time.monotonic() - t < 60  # the deadline is 4 x 30 + 60 s


def test_sharding_balances_the_work_not_the_count():
    """A sweep's sizes grow geometrically: by index, rank 0 of 2 would get 1+4+16+64 of
    1+2+...+128; by cost each rank gets about half of the total."""
    costs = [2.0**i for i in range(8)]
    owner = comm.shard(costs, 2)
    loads = [sum(c for c, r in zip(costs, owner, strict=True) if r == rank) for rank in range(2)]
    assert max(loads) <= sum(costs) / 2 + max(costs) / 2
    assert loads == [128, 127]
    assert comm.shard([1.0] * 5, 3) == [0, 1, 2, 0, 1]  # equal costs: round-robin
    assert sorted(set(comm.shard(costs, 4))) == [0, 1, 2, 3]


def test_distributed_sweep_shards_points_and_stores_them_once(tmp_path, capsys):
    db = str(tmp_path / "s.db")
    rc = main(
        [
            "sweep",
            "gelu",
            "--variant",
            "naive",
            "--variant",
            "builtin",
            "--shapes",
            "64x64",
            "128x128",
            "--distributed",
            "--nproc",
            "2",
            "--budget",
            "0.2",
            "--json",
            "--db",
            db,
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by_rank"] == {"0": 2, "1": 2}  # sharded evenly
    assert out["stored"] == 4 and out["missing"] == [] and out["rank_failure"] is None
    rows = Store(db).rows(out["run_id"])
    assert len(rows) == 4 and len({(r["variant"], r["shape"]) for r in rows}) == 4  # each point once


def test_a_rank_that_dies_mid_sweep_loses_only_its_own_points(tmp_path, capsys):
    import argparse

    import perfloop as pl
    from perfloop.cli.sweep import distributed as distributed_sweep_cli

    s = Store(tmp_path / "d.db")
    run = s.new_run("dying sweep")
    op = pl.ops.get("gelu")
    shapes = [(64,), (96,), (128,), (160,)]  # by cost: rank 0 takes 160 and 64, rank 1 96 and 128
    assert comm.shard([comm._cost(op, sh, __import__("torch").float32) for sh in shapes], 2) == [0, 1, 1, 0]
    args = argparse.Namespace(nproc=2, budget=0.2, json=True)
    rc = distributed_sweep_cli(
        args, op, ["builtin"], shapes, __import__("torch").float32, s, run, entry="_sweep_then_die"
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and "failed" in out["rank_failure"]
    kept = {r["shape"] for r in Store(tmp_path / "d.db").rows(run)}
    assert {"64", "160"} <= kept  # rank 0's points survive; rank 1 died after its first (96)
    assert "128" not in kept and ["builtin", "128"] in out["missing"]
