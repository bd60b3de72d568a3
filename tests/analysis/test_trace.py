"""A Chrome trace recorded elsewhere with torch.profiler, read back: what it carries."""

import json

import pytest
import torch

from perfloop.analysis.trace import from_trace
from perfloop.cli import main


def _record(path, record_shapes=True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    sched = torch.profiler.schedule(wait=0, warmup=1, active=2)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    ready = lambda p: p.export_chrome_trace(str(path))  # noqa: E731
    with torch.profiler.profile(activities=cpu, record_shapes=record_shapes, with_stack=True,
                                with_modules=True, schedule=sched, on_trace_ready=ready) as prof:  # fmt: skip
        for _ in range(3):
            net(x).sum().backward()
            prof.step()
    return path


def test_a_trace_with_shapes_gives_modules_steps_flops_and_bytes(tmp_path):
    p = from_trace(_record(tmp_path / "t.json"))
    assert p.calls == 2  # its two ProfilerStep ranges
    rows = {r.name: r for r in p.breakdown("module")}
    assert {"Linear_0", "Linear_1", "GELU_0"} <= set(rows)  # with_modules names: class and instance
    # second Linear: forward 2*64*256*256, backward dx and dW the same each, two steps
    assert rows["Linear_1"].flops == pytest.approx(3 * 2 * 64 * 256 * 256 * 2)
    assert rows["Linear_1"].backward_ms > 0 and rows["GELU_0"].bytes > 0
    assert any("inputs" in w for w in p.warnings)


def test_a_trace_without_shapes_still_gives_time_and_says_what_it_lacks(tmp_path):
    p = from_trace(_record(tmp_path / "t.json", record_shapes=False))
    assert any("record_shapes=True" in w for w in p.warnings)
    rows = p.breakdown("op")
    assert rows and all(r.flops is None for r in rows)


def test_what_is_not_a_torch_trace_is_refused_with_the_reason(tmp_path, capsys):
    (tmp_path / "x.json").write_text(
        json.dumps({"traceEvents": [{"ph": "X", "name": "a", "ts": 0, "dur": 1}]})
    )
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="no operator events"):
        from_trace(tmp_path / "x.json")
    assert main(["profile", "--trace-file", str(tmp_path / "y.json")]) == 2
    assert "--trace-file: cannot read" in capsys.readouterr().err
    good = _record(tmp_path / "t.json")
    assert main(["profile", "--db", str(tmp_path / "r.db"), "--trace-file", str(good)]) == 0
    assert "ProfilerStep" in capsys.readouterr().out
