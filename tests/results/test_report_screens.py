"""The HTML report as a person sees it: a fixed history rendered in headless Chromium at a
desktop's and a phone's width, each screenshot compared with the reviewed one kept in
tests/fixtures/screens/ (the way visual-regression tools do it: a pixel counts as changed where a
channel moves by more than a tolerance, and the share of changed pixels must stay small).
The comparison reads layout, not glyphs: both are shrunk to a quarter first.

After a deliberate change to the page, look at the new screenshots under
tests/build/test-artifacts/ and take them as the reference with PERFLOOP_UPDATE_SCREENS=1.
"""

import os
import random
import shutil
from pathlib import Path

import pytest

import perfloop as pl
from helpers import ARTIFACTS, open_in_chromium
from perfloop.results import report, store
from perfloop.results.report import render_html
from perfloop.results.store import Store

SCREENS = Path(__file__).resolve().parents[1] / "fixtures" / "screens"
CHANNEL_TOLERANCE = 32  # of 255, after the shrink: anti-aliasing and hinting move edges by less
CHANGED_AT_MOST = 0.005  # share of the pixels


def _history(path: Path) -> Store:
    """Two ops, three variants each, seeded samples, one diagnosis: everything on the page is
    fixed, the run ids and dates included."""
    s = Store(path)
    rng = random.Random(5)
    run = "20261205-090000-a1b2c3"
    env = {"device": {"name": "NVIDIA H200"}, "torch": "2.11.0", "git": "0123abc"}
    for op, base, nbytes in (("gelu", 0.80, 2.1e8), ("softmax", 1.30, 4.2e8)):
        for variant, speed in (("naive", 1.0), ("compiled", 2.2), ("triton", 2.9)):
            samples = tuple(base / speed * (1 + rng.gauss(0, 0.02)) for _ in range(60))
            m = pl.Measurement(samples_ms=samples, work=pl.Work(bytes=nbytes), env=env)
            s.add(run, m, op=op, variant=variant, shape=(4096, 4096), dtype="bf16")
    d = {
        "bound": "memory",
        "advice": "fuse the pointwise chain into one kernel (torch.compile)",
        "evidence": {"gbps": 1042.517, "launches": 9},
    }
    kernels = [
        {"short": f"vectorized_elementwise_kernel<{k}>", "calls": n, "total_ms": ms, "mean_us": ms / n * 1e3}
        | {"share": ms / 32.0}
        for k, n, ms in (("tanh", 40, 12.8), ("mul", 120, 19.2))
    ]
    s.add_artifact(run, "profile", {"kernels": kernels, "diagnosis": d}, op="gelu", variant="naive")
    return s


def _changed_share(a: Path, b: Path, diff: Path) -> float:
    from PIL import Image, ImageChops

    x, y = Image.open(a).convert("RGB"), Image.open(b).convert("RGB")
    if x.size != y.size:
        return 1.0
    # compared at a quarter of the size: a glyph's edges drawn a shade apart by another build of
    # the browser or its fonts average out; a block moved, resized or gone does not
    small = (x.size[0] // 4, x.size[1] // 4)
    x, y = x.resize(small, Image.Resampling.BOX), y.resize(small, Image.Resampling.BOX)
    delta = ImageChops.difference(x, y)
    mask = delta.convert("L").point(lambda v: 255 if v > CHANNEL_TOLERANCE else 0)
    diff.parent.mkdir(parents=True, exist_ok=True)
    mask.save(diff)  # white where the two differ: where to look when the test fails
    return mask.histogram()[255] / (x.size[0] * x.size[1])


def _shoot(tmp_path: Path, monkeypatch, css_extra: str = "") -> dict[int, Path]:
    monkeypatch.setattr(store, "_now", lambda: "2026-12-05T09:00:00")
    monkeypatch.setattr(report, "_CSS", report._CSS + css_extra)
    monkeypatch.chdir(tmp_path)  # no repository here: the trends carry no commit of ours
    page = render_html(_history(tmp_path / "h.db"), tmp_path / "page")
    shots = {}
    for width in (1200, 420):
        shots[width] = ARTIFACTS / "screens" / f"report-{width}{'-broken' if css_extra else ''}.png"
        open_in_chromium(page, tmp_path / f"u{width}", shots[width], width)
        assert shots[width].exists(), "chromium wrote no screenshot"
    return shots


@pytest.mark.slow
def test_the_report_looks_as_reviewed_at_a_desktops_and_a_phones_width(tmp_path, monkeypatch):
    shots = _shoot(tmp_path, monkeypatch)
    for width, shot in shots.items():
        ref = SCREENS / f"report-{width}.png"
        if os.environ.get("PERFLOOP_UPDATE_SCREENS"):
            SCREENS.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, ref)
        share = _changed_share(shot, ref, ARTIFACTS / "screens" / f"diff-{width}.png")
        assert share <= CHANGED_AT_MOST, (
            f"{width} px: {share:.1%} of the pixels differ from {ref.name}; see {shot} and the diff "
            "beside it; if the change is meant, PERFLOOP_UPDATE_SCREENS=1 takes it"
        )


@pytest.mark.slow
def test_the_comparison_catches_a_layout_that_breaks(tmp_path, monkeypatch):
    """The test above can fail: a page whose figures lose their responsive width (the report's
    look before issue 52) differs from the reviewed screenshots well past the tolerance."""
    shots = _shoot(tmp_path, monkeypatch, "img { max-width: none !important; width: 900px !important; }")
    for width, shot in shots.items():
        ref, diff = SCREENS / f"report-{width}.png", ARTIFACTS / "screens" / "diff-broken.png"
        share = _changed_share(shot, ref, diff)
        assert share > 3 * CHANGED_AT_MOST, f"{width} px: a broken layout changed only {share:.2%}"
