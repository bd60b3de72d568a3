"""What programs read: `bench --json` with the environment, commit and raw samples; the CSV
export with each row's commit and run time; a dtype no variant takes named as a usage error."""

import csv
import io
import json
import statistics

from perfloop.cli import main


def test_bench_json_carries_the_environment_commit_and_raw_samples(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    assert (
        main(
            [
                "bench",
                "gelu",
                "--variant",
                "builtin",
                "--shape",
                "4096",
                "--budget",
                "0.2",
                "--db",
                db,
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["env"]["torch"] and out["env"]["device"]["kind"] == "cpu" and "commit" in out
    assert out["commit"] == out["env"]["git"]
    [row] = out["rows"]
    assert len(row["samples_ms"]) >= 5 and row["median_ms"] == statistics.median(row["samples_ms"])
    assert main(["report", "--db", db, "--csv", str(tmp_path / "r.csv")]) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "r.csv").read_text())))
    gelu = [r for r in rows if r["op"] == "gelu"]
    assert gelu and all(r["commit"] == (out["commit"] or "") and r["run_created"] for r in gelu)


def test_a_dtype_no_variant_takes_is_a_usage_error_naming_dtype(tmp_path, capsys):
    assert main(["bench", "gelu", "--dtype", "fp64", "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert "--dtype: no variant of gelu takes float64; use one of bf16, fp16, fp32" in err
    assert "Traceback" not in err and not (tmp_path / "r.db").exists()
