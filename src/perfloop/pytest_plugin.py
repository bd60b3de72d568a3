"""pytest plugin: record kernel timings in a test suite and fail on a regression.

    def test_my_kernel_speed(perfloop):
        x = torch.randn(1 << 20, device="cuda")
        perfloop.bench(my_kernel, x, name="my_kernel/1M")

    pytest --perfloop-save base.json             # record a baseline
    pytest --perfloop-compare base.json          # fail a test that got slower
           [--perfloop-fail-above 5]             #   by more than 5% (default), beyond noise

A slowdown fails only when it is both larger than the threshold and outside
the noise: the new median's CI must lie wholly above the baseline's CI upper
end, scaled by the threshold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfloop.harness.measurement import Measurement


def pytest_addoption(parser):
    g = parser.getgroup("perfloop", "perfloop benchmarks")
    g.addoption("--perfloop-save", metavar="PATH", help="write the measurements taken to PATH (JSON)")
    g.addoption("--perfloop-compare", metavar="PATH", help="compare against a saved baseline")
    g.addoption(
        "--perfloop-fail-above",
        metavar="PCT",
        type=float,
        default=5.0,
        help="slowdown in percent beyond which a compared test fails (default 5)",
    )


class Recorder:
    def __init__(self, config, nodeid: str):
        self.config = config
        self.nodeid = nodeid

    def bench(self, fn, *args, name: str | None = None, **kwargs) -> Measurement:
        from perfloop.harness.timing import bench

        name = name or self.nodeid
        m = bench(fn, *args, label=name, **kwargs)
        self.config._perfloop_taken[name] = m
        base = self.config._perfloop_baseline.get(name)
        if base is not None:
            verdict = regression(base, m, self.config.getoption("--perfloop-fail-above"))
            if verdict:
                pytest.fail(f"perfloop regression in {name}: {verdict}", pytrace=False)
        return m


def regression(base: Measurement, new: Measurement, fail_above_pct: float) -> str | None:
    """A message if `new` is significantly slower than `base` by more than the threshold."""
    ratio = new.median_ms / base.median_ms
    limit = 1 + fail_above_pct / 100
    if ratio > limit and new.ci95_ms[0] > base.ci95_ms[1] * limit:
        return (
            f"{new.median_ms:.4g} ms vs baseline {base.median_ms:.4g} ms "
            f"({ratio:.2f}x slower, over the {fail_above_pct:g}% limit and outside both CIs)"
        )
    return None


def pytest_configure(config):
    config._perfloop_taken = {}
    config._perfloop_baseline = {}
    path = config.getoption("--perfloop-compare", default=None)
    if path:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise pytest.UsageError(f"--perfloop-compare: cannot read baseline {path}: {exc}") from exc
        config._perfloop_baseline = {k: Measurement.from_dict(v) for k, v in raw.items()}


def pytest_unconfigure(config):
    path = config.getoption("--perfloop-save", default=None)
    taken = getattr(config, "_perfloop_taken", {})
    if path and taken:
        Path(path).write_text(json.dumps({k: m.to_dict() for k, m in taken.items()}, indent=1))


@pytest.fixture
def perfloop(request) -> Recorder:
    """Benchmark inside a test: `perfloop.bench(fn, *args, name=...)` -> Measurement."""
    return Recorder(request.config, request.node.nodeid)
