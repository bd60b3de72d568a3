"""What a fault probe found in the messages (issue 37): each case says what was wrong and how to
fix it, and suggests only what can run."""

import math
import random

import pytest

from perfloop.cli import main
from perfloop.harness.measurement import Measurement
from perfloop.results.history import Change, Point, Trend, bisect_command
from perfloop.results.store import Store


def _line(db, op, commits, level=1.0):
    rng, s = random.Random(0), Store(db)
    for c in commits:
        m = Measurement(
            samples_ms=tuple(level * math.exp(rng.gauss(0, 0.01)) for _ in range(9)), env={"git": c}
        )
        s.add(s.new_run("x"), m, op=op, variant="v", shape=(8,), dtype="fp32")
    return s


def test_empty_option_values_are_refused_naming_the_option(tmp_path, capsys):
    for argv, flag in ((["report", "--html", ""], "--html"), (["bench", "gelu", "--shape", ""], "--shape")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert f"{flag}: an empty value" in capsys.readouterr().err


def test_report_html_names_why_its_page_cannot_be_written(tmp_path, capsys):
    db = tmp_path / "r.db"
    _line(db, "gelu", ["a" * 12])
    (tmp_path / "page" / "index.html").mkdir(parents=True)  # cannot be written as a file
    assert main(["report", "--db", str(db), "--html", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert "cannot write index.html" in err and "Is a directory" in err


def test_a_mistyped_key_gets_the_close_matches(tmp_path, capsys):
    db = tmp_path / "r.db"
    for op in ("gelu", "layernorm", "softmax", "attention", "rmsnorm", "swiglu", "geglu", "rowsum", "matmul"):
        _line(db, op, ["a" * 12])
    assert main(["history", "layrnorm", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "did you mean: layernorm/v/8/fp32" in err and "attention" not in err


def test_no_bisect_line_for_a_step_bisect_cannot_check_out():
    pts = [
        Point(str(i), "", c, 1.0, (0.9, 1.1))
        for i, c in enumerate(["abc123abc123"] * 3 + ["abc123abc123-dirty"] * 3)
    ]
    dirty = Trend(
        ("k", "v", "", "", "cpu"), pts, [Change(3, 1.5, 9.0, 1e-9, "abc123abc123", "abc123abc123-dirty")]
    )
    assert bisect_command(dirty) is None  # a commit and its own uncommitted state: nothing to bisect
    gone = Trend(
        dirty.key, pts, [Change(3, 1.5, 9.0, 1e-9, "abc123abc123", "def456def456")], gone={"def456def456"}
    )
    assert bisect_command(gone) is None
    kept = Trend(dirty.key, pts, [Change(3, 1.5, 9.0, 1e-9, "abc123abc123", "def456def456")])
    assert bisect_command(kept) == "perfloop bisect --key k/v///cpu -- COMMAND"


def test_report_anchors_differ_for_keys_that_differ_only_in_punctuation(tmp_path):
    from perfloop.results.trend_page import _anchor

    a = Trend(("gelu", "a.b", "8", "fp32", "cpu"), [])
    b = Trend(("gelu", "a-b", "8", "fp32", "cpu"), [])
    assert _anchor(a) != _anchor(b)
