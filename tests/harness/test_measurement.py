import dataclasses

import pytest
import torch

import perfloop as pl
from perfloop.harness.measurement import Measurement


def test_measurement_is_immutable_and_round_trips():
    x = torch.randn(1 << 14)
    m = pl.bench(torch.nn.functional.gelu, x, work=pl.Work(bytes=2 * x.nbytes), budget_s=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.samples_ms = (1.0,)
    d = m.to_dict()
    m2 = Measurement.from_dict(d)
    assert m2.samples_ms == m.samples_ms and m2.median_ms == m.median_ms
    assert m2.gbps == pytest.approx(m.gbps) and m.gbps > 0
    assert m.sol is not None and m.sol > 0  # against the measured copy ceiling
    assert m.env["torch"] == torch.__version__ and "precision" in m.env


def test_statistics_come_from_the_samples():
    m = Measurement(samples_ms=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100))
    assert m.median_ms == 6 and m.min_ms == 1
    assert m.p20_ms < m.median_ms < m.p80_ms
    assert any("noisy" in w for w in m.warnings)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_sample_that_is_no_time_is_refused_before_anything_is_stored(bad, tmp_path):
    """Issue 52: NaN samples reached the store as a raw IntegrityError with an orphan run row; inf
    medians compared "same"; a 0 ms row broke compare with a math domain error."""
    from perfloop.results.store import Store

    with pytest.raises(ValueError, match=r"samples_ms: times must be finite and > 0 ms, got .* at index 1"):
        Measurement(samples_ms=(1.0, bad, 1.2))
    s = Store(tmp_path / "h.db")
    assert s.rows() == []
