"""What the launching thread was doing, sampled: a thread that reads the Python stack of the
profiled thread every millisecond (`sys._current_frames()`), so idle device time can be charged
to the line of the user's code that made the device wait. Each sample keeps the innermost frame
of the user's own code (not torch's, perfloop's, the standard library's, an installed
package's, or the code Inductor generated: its caller is the user's line, the generated file
only a tag) and which libraries were on the stack below it (NumPy, the optimizer, the DataLoader),
and whether the innermost frame was torch's own (the thread inside a torch call).

The samples' clock is `time.perf_counter_ns`; `Sampler.align` maps them onto a profiler's
timeline through a range recorded at a known instant.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

CLOCK_RANGE = "perfloop: clock"
_LIBS = {  # a path fragment on the stack -> the tag it gives the sample
    f"{os.sep}numpy{os.sep}": "numpy",
    f"{os.sep}torch{os.sep}optim{os.sep}": "optimizer",
    f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}": "dataloader",
}


def _library_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.add(os.path.dirname(torch.__file__))
    paths.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # perfloop itself
    paths.add(generated_code_dir())
    return tuple(sorted(p for p in paths if p))


def generated_code_dir() -> str:
    """Where Inductor writes the Python it generates (TORCHINDUCTOR_CACHE_DIR, else a folder in
    the temporary directory): its frames are torch's, not the user's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.abspath(cache_dir()) + os.sep


@dataclass(frozen=True)
class Sample:
    t: float  # perf_counter_ns, or profiler microseconds once aligned
    place: str  # "file.py:LINE (function)" of the innermost user frame, "" when none
    # on the stack: "numpy", "optimizer", "dataloader", "compiled" (Inductor's code);
    # "torch": innermost in torch
    tags: frozenset


class Sampler:
    """Samples thread `tid`'s Python stack every `interval_s` while running (a context manager).
    While it runs the interpreter hands the GIL to a waiting thread after `interval_s / 10` (at
    `interval_s` itself the sampler of a thread busy in Python got one sample in several
    intervals), so that thread is sampled at about the sampler's pace."""

    def __init__(self, tid: int | None = None, interval_s: float = 1e-3):
        self.tid = tid if tid is not None else threading.get_ident()
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.unreadable = 0  # samples with no Python frame of the thread (in C the whole time)
        self._stop = threading.Event()
        self._roots = _library_roots()
        self._places: dict = {}  # code object, line -> place (a step repeats its lines)
        self._torch = os.path.dirname(torch.__file__) + os.sep
        self._generated = generated_code_dir()

    def _read(self, frame) -> Sample:
        tags = {"torch"} if frame.f_code.co_filename.startswith(self._torch) else set()
        place = ""
        f = frame
        while f is not None:
            name = f.f_code.co_filename
            for frag, tag in _LIBS.items():
                if frag in name:
                    tags.add(tag)
            if name.startswith(self._generated):
                tags.add("compiled")
            if not place and not name.startswith(self._roots) and not name.startswith("<"):
                key = (f.f_code, f.f_lineno)
                place = self._places.get(key)
                if place is None:
                    place = self._places[key] = f"{os.path.basename(name)}:{f.f_lineno} ({f.f_code.co_name})"
            f = f.f_back
        return Sample(time.perf_counter_ns(), place, frozenset(tags))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.tid)
            if frame is None:
                self.unreadable += 1
                continue
            self.samples.append(self._read(frame))

    def __enter__(self) -> Sampler:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s / 10)
        self._thread = threading.Thread(target=self._run, name="perfloop-sampler", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    @staticmethod
    def mark() -> int:
        """Record the clock range in the running profiler; the perf_counter_ns it began at (a
        fast range: not one of torch.profiler.record_function's, which a script's step finder
        watches)."""
        from torch._C._profiler import _RecordFunctionFast

        with _RecordFunctionFast(CLOCK_RANGE):
            return time.perf_counter_ns()

    @staticmethod
    def offset(events, marked_ns: int) -> float | None:
        """Profiler microseconds minus perf_counter microseconds, from the clock range."""
        starts = [e.time_range.start for e in events if e.name == CLOCK_RANGE]
        return starts[0] - marked_ns / 1e3 if starts else None

    def align(self, events, marked_ns: int) -> list[Sample]:
        """The samples on the profiler's timeline (microseconds), through the clock range."""
        offset = self.offset(events, marked_ns)
        if offset is None:
            return []
        return [Sample(s.t / 1e3 + offset, s.place, s.tags) for s in self.samples]


def unsampled_launcher(events) -> str | None:
    """Why the sampled places may miss: a thread other than the sampled one (and other than
    autograd's backward threads) issued a tenth or more of the work."""
    from perfloop.analysis.attribution import KERNEL_LAUNCHES

    sampled = next((e.thread for e in events if e.name == CLOCK_RANGE), None)
    if sampled is None:
        return None
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    autograd = {e.thread for e in cpu if e.name.startswith("autograd::engine")}
    launches = [e.thread for e in cpu if e.name.startswith(KERNEL_LAUNCHES)] or [
        e.thread for e in cpu if "::" in e.name and e.cpu_parent is None
    ]
    others = Counter(t for t in launches if t != sampled and t not in autograd)
    if not launches or not others or sum(others.values()) < 0.1 * len(launches):
        return None
    thread, n = others.most_common(1)[0]
    return (
        f"thread {thread} issued {n} of the {len(launches)} launches: perfloop samples the Python "
        "stack of the thread that called it, so the idle those launches left is charged by cause but "
        "not to a line"
    )
