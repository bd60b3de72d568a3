"""Script mode never breaks the script (issue 65): a profiling window that opens or closes
inside a module's forward, or on a worker thread's module call; a script that runs its own
torch.profiler or leaves its own ranges open; and the notes saying whose warning each is."""

import runpy

import pytest

from helpers import assert_no_profiling_left, write_script
from perfloop.cli import main
from perfloop.workflows.script import ScriptError, profile_script

# each forward takes 0.3 s between its two Linears: a window of 0.15:0.3 s starts while the first
# forward sleeps (opening at `b`'s call, `Slow`'s range begun before it) and ends 0.3 s after it
# opens, at a `b` call again (the ranges of `Slow` and `a` begun under the profiler still open)
SLOW = """
import time, torch
class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
    def forward(self, x):
        x = self.a(x)
        time.sleep(0.3)
        return self.b(x)
m = Slow()
for _ in range(3):
    m(torch.randn(8, 64))
open("done.txt", "w").write("done")
"""


def test_a_window_that_opens_and_closes_inside_forwards_leaves_the_script_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, SLOW)
    p = profile_script(script, [], None, window=(0.15, 0.3))
    assert_no_profiling_left()
    assert (tmp_path / "done.txt").exists()  # the script ran to its end
    assert not any("ended" in w for w in p.warnings), p.warnings
    assert 250 <= p.wall_ms_per_call <= 1000, p.wall_ms_per_call  # the window's 0.3 s, not cut short
    assert {"a", "b"} <= {i.module for i in p.items()}


THREADED = """
import threading, time, torch
class Worker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.small = torch.nn.Linear(16, 16)
    def forward(self, x):
        return self.small(x)
class Main(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(256, 256)
    def forward(self, x):
        return self.big(x)
worker, model = Worker(), Main()
stop = []
def work():
    while not stop:
        worker(torch.randn(4, 16))
t = threading.Thread(target=work)
t.start()
end = time.perf_counter() + 0.6
while time.perf_counter() < end:
    model(torch.randn(64, 256))
    time.sleep(0.02)
stop.append(1)
t.join()
"""


def test_a_time_window_records_the_scripts_main_thread_though_a_worker_calls_modules_more_often(tmp_path):
    """torch.profiler records the thread that starts it: started at a worker thread's module
    call, the window recorded the worker alone and none of the script's own steps."""
    script = write_script(tmp_path, THREADED)
    p = profile_script(script, [], None, window=(0.1, 0.3))
    assert_no_profiling_left()
    assert "big" in {i.module for i in p.items()}


RAISES = """
import time, torch
import perfloop as pl
lin = torch.nn.Linear(64, 64)
end = time.perf_counter() + 0.3
while time.perf_counter() < end:
    lin(torch.randn(8, 64))
{fail}
"""


@pytest.mark.parametrize(
    "fail, said",
    [
        ('raise RuntimeError("boom")', "the script raised RuntimeError"),
        ('pl.annotate("")', "perfloop's own code raised ValueError inside the script"),
    ],
)
def test_a_window_cut_short_by_an_error_says_whose_error_ended_it(tmp_path, fail, said):
    script = write_script(tmp_path, RAISES.format(fail=fail))
    with pytest.raises(ScriptError) as info:
        profile_script(script, [], None, window=(0.1, 5.0))
    assert_no_profiling_left()
    [cut] = [w for w in info.value.profile.warnings if w.startswith("--window:")]
    assert cut.startswith(f"--window: {said} 0.") and "into the window of 5 s" in cut, cut
    assert str(info.value).startswith(said), str(info.value)


# ---- the script's own torch.profiler, with a schedule and prof.step(): what it records under
# perfloop is what it records under plain python
THEIRS = """
import time, torch
from torch.profiler import profile, schedule
lin = torch.nn.Linear(64, 64)
end = time.perf_counter() + {before}
while time.perf_counter() < end:  # unprofiled work first: perfloop's window may fall here
    lin(torch.randn(8, 64))
with profile(schedule=schedule(wait=1, warmup=1, active=2), acc_events=True) as prof:
    for _ in range(6):
        lin(torch.randn(8, 64))
        prof.step()
linears = [e.count for e in prof.key_averages() if e.key == "aten::linear"]
open("seen.txt", "w").write(str(linears))
"""


def _plain(script, tmp_path) -> str:
    """What the script's profiler records under plain python (runpy, in this process)."""
    runpy.run_path(str(script), run_name="__main__")
    return (tmp_path / "seen.txt").read_text()


def test_a_time_window_before_the_scripts_scheduled_profiler_is_taken_and_theirs_records_as_alone(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, THEIRS.format(before=0.3))
    alone = _plain(script, tmp_path)
    assert alone == "[2]"  # the two active steps
    p = profile_script(script, [], None, window=(0.0, 0.1))
    assert_no_profiling_left()
    assert p.calls == 1 and any(i.op == "aten::linear" for i in p.items())
    assert (tmp_path / "seen.txt").read_text() == alone


def test_a_time_window_the_scripts_scheduled_profiler_starts_inside_gives_way_and_says_so(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, THEIRS.format(before=0.1))
    alone = _plain(script, tmp_path)
    with pytest.raises(ValueError, match="runs torch.profiler itself.*--trace-file"):
        profile_script(script, [], None, window=(0.0, 30.0))
    assert_no_profiling_left()
    assert (tmp_path / "seen.txt").read_text() == alone


# a script whose profiler starts inside a module's forward and stops after it returns: the
# module's range, begun before any profiler ran, is exited under the script's
INSIDE = """
import torch
class Profiled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        self.prof = torch.profiler.profile()
        self.prof.__enter__()
        return self.lin(x)
lin = torch.nn.Linear(64, 64)
for _ in range(20):
    lin(torch.randn(8, 64))
model = Profiled()
model(torch.randn(8, 64)).sum().backward()
model.prof.__exit__(None, None, None)
open("seen.txt", "w").write(str([e.count for e in model.prof.key_averages() if e.key == "aten::linear"]))
"""


@pytest.mark.parametrize("window", [(0.0, 1e-4), (0.0, 30.0)])
def test_the_scripts_profiler_started_in_a_forward_runs_as_under_plain_python(tmp_path, monkeypatch, window):
    """(0, 1e-4): perfloop's window was taken before; (0, 30): the script's profiler starts
    inside perfloop's window, which gives way."""
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, INSIDE)
    alone = _plain(script, tmp_path)
    try:
        profile_script(script, [], None, window=window)
    except ValueError as exc:
        assert window[1] == 30.0 and "runs torch.profiler itself" in str(exc)
    assert_no_profiling_left()
    assert (tmp_path / "seen.txt").read_text() == alone == "[1]"


OPEN_RANGES = """
import time, torch
from torch.profiler import record_function
lin = torch.nn.Linear(64, 64)
epoch = record_function("epoch")  # opened before the window, closed after it
epoch.__enter__()
late = None
for i in range(40):
    if late is None and torch.autograd.profiler._is_profiler_enabled:
        late = record_function("late")  # opened inside the window, closed after it
        late.__enter__()
    lin(torch.randn(8, 64))
    time.sleep(0.01)
late.__exit__(None, None, None)
epoch.__exit__(None, None, None)
open("done.txt", "w").write("done")
"""


def test_the_scripts_ranges_left_open_across_the_window_neither_break_it_nor_go_unsaid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, OPEN_RANGES)
    p = profile_script(script, [], None, window=(0.05, 0.1))
    assert_no_profiling_left()
    assert (tmp_path / "done.txt").exists()
    assert any("past the window's end" in w and "still open" in w for w in p.warnings), p.warnings


# ---- warnings: each labelled with whoever raised it
WARNS = """
import warnings, torch
import perfloop.nn as pnn
lin = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
for _ in range(6):
    lin(torch.randn(4, 8)).sum().backward()
    opt.step()
warnings.warn("the script's own warning")
with torch.backends.cuda.sdp_kernel(enable_flash=False):
    pass
pnn.LayerNorm(8)(torch.randn(4, 8))
"""


def test_each_warning_is_labelled_with_whoever_raised_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # perfloop.nn's kernels fall back: it warns
    # perfloop.nn warns once a process; the script runs in this one, after other tests' fallbacks
    monkeypatch.setattr("perfloop.nn.modules._WARNED", set())
    script = write_script(tmp_path, WARNS, name="train.py")
    assert main(["profile", "--db", str(tmp_path / "r.db"), "--script", str(script)]) == 0
    err = capsys.readouterr().err
    assert "note (the script's UserWarning, train.py:9): the script's own warning" in err, err
    assert "note (torch FutureWarning): `torch.backends.cuda.sdp_kernel()` is deprecated" in err, err
    assert "note (perfloop RuntimeWarning): perfloop.nn.LayerNorm:" in err, err
    assert "note (perfloop UserWarning)" not in err and "note (perfloop FutureWarning)" not in err
