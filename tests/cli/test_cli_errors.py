"""Clear errors, exit 2, no traceback, for the mistakes users make (issue 15, 7a, 10, 12, 13)."""

import json

import pytest

import perfloop as pl
from perfloop.cli import main
from perfloop.results.store import Store


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code


@pytest.mark.parametrize(
    "args, flag",
    [
        (["bench", "gelu", "--budget", "nan"], "--budget"),
        (["bench", "gelu", "--shape", "12xx3"], "--shape"),
        (["bench", "matmul_relu", "--shape", "64x64"], "--shape"),
        (["bench", "attention", "--shape", "1x2x64x64", "--variant", "builtin"], "--shape"),
        (["bench", "gelu", "--variant", "builtin", "--shape", "10000000x10000000"], "--shape"),
        (["sweep", "gelu", "--shapes", "64", "0x3"], "--shapes"),
        (["bench", "gelu", "--dtype", "fp8"], "--dtype"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_flag(tmp_path, capsys, args, flag):
    rc = _exit_code([*args, "--db", str(tmp_path / "e.db")])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err


def _run_on(store, device, ms):
    run = store.new_run(f"on {device}")
    m = pl.Measurement(
        samples_ms=tuple(ms * (1 + 0.01 * i) for i in range(20)),
        env={"device": {"name": device, "kind": "cpu"}},
    )
    store.add(run, m, op="gelu", variant="builtin", shape=(8,), dtype="fp32")
    return run


def test_compare_refuses_runs_from_different_devices(tmp_path, capsys):
    db = tmp_path / "d.db"
    s = Store(db)
    a, b = _run_on(s, "NVIDIA H200", 0.5), _run_on(s, "AMD EPYC", 30.0)
    assert main(["compare", a, b, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "different devices" in err and "NVIDIA H200" in err and "AMD EPYC" in err


def test_env_records_the_users_commit_and_perfloops_version_apart(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # not a git working tree
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["git"] is None  # the code measured here is in no repository
    assert info["perfloop"]["version"]


def test_compare_shows_the_ratio_of_the_medians_it_shows_and_short_verdicts(tmp_path, capsys):
    """issue 52: compare showed medians 60.1 -> 58.0 ms beside a ratio "1.000" (its verdict's
    figure, from the runs' fast tails) and ~60-word verdicts in a table cell."""
    import numpy as np

    import perfloop as pl
    from perfloop.cli import main
    from perfloop.results.store import Store

    db = tmp_path / "h.db"
    s = Store(db)
    rng = np.random.default_rng(0)
    a = tuple(float(x) for x in 60.1 + rng.gamma(2.0, 1.0, 40) - 2.0)
    b = tuple(float(x) for x in 58.0 + rng.gamma(2.0, 1.0, 40) - 2.0)
    ids = []
    for samples in (a, b):
        run = s.new_run("bench")
        s.add(run, pl.Measurement(samples_ms=samples), op="gelu", variant="v", shape=(8,), dtype="fp32")
        ids.append(run)
    s.close()
    assert main(["compare", ids[0], ids[1], "--db", str(db)]) in (0, 1)
    out = capsys.readouterr().out
    ma, mb = float(np.median(a)), float(np.median(b))
    row = next(line for line in out.splitlines() if "gelu" in line and "v" in line)
    assert f"{mb / ma:.3f}" in row  # the ratio of the figures shown
    cell_words = row.split("│")[-2].split() if "│" in row else row.split()[-3:]
    assert len(cell_words) <= 4, row  # a short verdict in the cell; the whole one below
