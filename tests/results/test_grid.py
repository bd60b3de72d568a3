"""The guard on a kernel's grid (issue 25): a point that fell more than 10% against its reference
since the last recorded run is named, noise is not, a point no longer measured is said."""

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from perfloop.results import grid

GRID = list(
    itertools.product(
        (1, 2, 4, 8),
        (8, 16, 32),
        (512, 1000, 2047, 3000, 4096, 8192),
        (64, 128),
        ("full", "causal"),
        ("fwd", "fwd+bwd"),
    )
)
PLANTED = "b=2 h=8 t=3000 d=64 mask=causal mode=fwd"  # 0.998x SDPA a turn ago, 0.41x after a change


def _recording(seed: int, wobble: float, planted: dict | None = None) -> dict:
    rng = random.Random(seed)
    points = {}
    for b, h, t, d, mask, mode in GRID:
        key = f"b={b} h={h} t={t} d={d} mask={mask} mode={mode}"
        base = random.Random(key).uniform(0.75, 1.1)  # each point's own level, the same in every run
        s = (planted or {}).get(key, base * (1 + rng.uniform(-wobble, wobble)))
        half = s * rng.uniform(0.005, 0.02)  # a run's CI: 0.5-2%
        points[key] = {"speedup": s, "ci": [s - half, s + half]}
    return {"device": "NVIDIA H200", "points": points}


def test_a_point_that_fell_past_10_percent_is_named_and_noise_is_not():
    last = _recording(1, 0.03)
    now = _recording(2, 0.03, {PLANTED: 0.41})
    found = grid.drops(last, now)
    assert [d.key for d in found] == [PLANTED]
    assert found[0].ratio < 0.5 and "0.41" in str(found[0])
    assert grid.drops(last, _recording(3, 0.03)) == []  # 3% wobble between runs: nothing


def test_a_point_no_longer_measured_is_a_drop_with_the_reason():
    last, now = _recording(1, 0.02), _recording(2, 0.02)
    key = next(iter(now["points"]))
    now["points"][key] = {"error": "OutOfMemoryError: 41 GiB"}
    del now["points"][PLANTED]
    found = {d.key: d for d in grid.drops(last, now)}
    assert set(found) == {key, PLANTED}
    assert found[key].now is None and "OutOfMemoryError" in str(found[key])
    assert "absent from this run" in str(found[PLANTED])


def test_worst_points_and_the_heatmap(tmp_path):
    rec = _recording(1, 0.02, {PLANTED: 0.41})
    assert grid.worst(rec, 3)[0] == (PLANTED, 0.41)
    path = grid.heatmap(
        rec, tmp_path / "grid.png", rows="b h", cols="t", panels="d mask mode", title="attention / SDPA"
    )
    from PIL import Image

    img = Image.open(path).convert("RGB")
    assert img.width > 1500 and img.height > 800  # eight panels, four a row
    colors = {img.getpixel((x, y)) for x in range(0, img.width, 7) for y in range(0, img.height, 7)}
    assert len(colors) > 50


def test_a_recording_that_is_not_one_is_refused_with_the_reason(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": {"b=1": {"speedup": "fast"}}}))
    with pytest.raises(ValueError, match="point 'b=1': needs a speedup > 0 and a ci"):
        grid.read(bad)
    with pytest.raises(ValueError, match="no points"):
        bad.write_text("[]")
        grid.read(bad)
    with pytest.raises(ValueError, match="limit: a fraction"):
        grid.drops(_recording(1, 0.0), _recording(1, 0.0), limit=10)


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_two_recorded_runs_of_unchanged_code_raise_no_drop_and_a_real_one_is_still_caught():
    # run23 and run24 timed the same kernels minutes of GPU time apart (batch 1-2): points of a
    # few tens of us moved 0.79-1.46x against SDPA between them, points of >= 0.5 ms 0.99-1.03x
    last = grid.read(RESULTS / "2026-12-02-h200-run23-native" / "attention-grid.json")
    now = grid.read(RESULTS / "2026-12-02-h200-run24-check" / "call2" / "grid" / "attention-grid.json")
    last = {**last, "points": {k: p for k, p in last["points"].items() if k in now["points"]}}
    assert len(last["points"]) == 288
    assert grid.drops(last, now) == []
    small, large = "b=1 h=8 t=3000 d=64 mask=full mode=fwd", "b=2 h=32 t=8192 d=128 mask=causal mode=fwd+bwd"
    assert now["points"][small]["sdpa_ms"] < 0.1 and now["points"][large]["sdpa_ms"] > 1
    # the 0.998x -> 0.41x at a short point; 15% off a long one
    for key, fell_to, held in ((small, 0.41, "35%"), (large, 0.85, "10%")):
        p = now["points"][key]
        slower = {
            **p,
            "speedup": p["speedup"] * fell_to,
            "ci": [c * fell_to for c in p["ci"]],
            "triton_ms": p["triton_ms"] / fell_to,
        }
        found = grid.drops(last, {**now, "points": {**now["points"], key: slower}})
        assert [d.key for d in found] == [key], (key, found)
        assert f"held to a {held} fall" in str(found[0])

    # 20% off a short point is within what such points moved between the two runs
    def moved(k):
        return abs(math.log(now["points"][k]["speedup"] / last["points"][k]["speedup"]))

    steady = min((k for k, p in now["points"].items() if p["sdpa_ms"] < 0.1), key=moved)
    p = now["points"][steady]
    slower = {**p, "speedup": p["speedup"] * 0.8, "ci": [c * 0.8 for c in p["ci"]]}
    assert grid.drops(last, {**now, "points": {**now["points"], steady: slower}}) == []
