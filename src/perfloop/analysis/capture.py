"""One profiled step, as the analyzers read it: a frozen, typed `Capture`, built at the edge by
each source (pl.profile's calls, a script's steps, a trace file) and read by every analyzer in
`analysis.causes`. It holds what was recorded, already parsed: no torch events, nothing worked
out again per question.

A capture saves to JSON and loads back unchanged (`save`, `load`): the tests rank recorded
captures, CPU and GPU, so their verdicts do not hang on the load of the machine that runs them.

>>> c = Capture(device="cpu", calls=1, wall_ms=2.0)
>>> loads(dumps(c)) == c
True
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from perfloop.analysis.attribution import Item
from perfloop.analysis.bound import Bound
from perfloop.analysis.compilation import Compile, CompiledCode, GraphBreak
from perfloop.analysis.idle_record import Cause, Idle
from perfloop.analysis.work import OpWork

FORMAT = 1  # the saved capture's layout; a newer file is refused with the version it needs


@dataclass(frozen=True)
class CompileFacts:
    """What ran compiled in the profiled calls (compilation.CompiledCode) and where its graphs ran:
    None in `Capture.compiled` where nothing did."""

    code: CompiledCode
    regions: tuple = ()  # (start us, end us, compile id) of each compiled region run
    graph_calls: tuple = ()  # (start us, end us) of each compiled graph's call


@dataclass(frozen=True)
class Capture:
    """One profiled step, `calls` calls of it; times per call unless named otherwise.

    items: every kernel (on a CPU every outermost op) of the timed calls, with its op, module,
    phase and line (attribution.Item); records and counted_items: the counted call's op records
    (work.OpWork: FLOPs, bytes, the storages read and written) and its kernels tied to them;
    work: (module, phase, op) -> (FLOPs, bytes, dtype) over all calls; idle: when and why the
    device waited on the host (timeline.Idle, from the host's intervals and stack samples);
    sites: pl.patch's call sites by module (nn.plan.plan)."""

    device: str  # "cuda", or "cpu" where the host's ops are the work
    calls: int
    wall_ms: float  # the step's wall time, as the ranking takes it
    items: tuple = ()
    records: tuple | None = None
    counted_items: tuple | None = None
    work: dict | None = None
    idle: Idle | None = None
    l2_bytes: int = 0
    sites: dict | None = None
    compiled: CompileFacts | None = None
    step: str | None = None  # what one call is: a script's range, or None for pl.profile's calls
    # the models a generation step runs (tokens.model_bytes: weights and KV-cache bytes, the
    # weights' dtypes, the caches' batch) and the tokens a step takes in: None where not known
    model: dict | None = None
    notes: tuple = field(default=(), compare=False)  # how it was recorded, for the reader of a fixture

    @property
    def device_ms(self) -> float:
        return sum(i.ms for i in self.items) / self.calls

    @property
    def step_ms(self) -> float:
        """What a finding's share is of: the wall time, or the device's where that is longer."""
        return max(self.wall_ms, self.device_ms) or 1e-12

    @property
    def code(self) -> CompiledCode | None:
        return self.compiled.code if self.compiled is not None else None


# ------------------------------------------------------------------ saved as JSON

_TYPES = {
    t.__name__: t for t in (Capture, CompileFacts, CompiledCode, Compile, GraphBreak, Item, Idle, OpWork)
}
_ENUMS = {t.__name__: t for t in (Bound, Cause)}


class CaptureFormatError(ValueError):
    """A saved capture this perfloop cannot read."""


def _encode(x):
    if isinstance(x, Enum):
        return {"@enum": type(x).__name__, "v": x.value}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {"@": type(x).__name__}
        for f in dataclasses.fields(x):
            if f.name != "raw":  # Idle's copy before the syncs took their share: not read by ranking
                out[f.name] = _encode(getattr(x, f.name))
        return out
    if isinstance(x, tuple):
        return {"@tuple": [_encode(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {"@set": [_encode(v) for v in sorted(x, key=repr)]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        return {"@dict": [[_encode(k), _encode(v)] for k, v in x.items()]}
    return x


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "@enum" in x:
        return _ENUMS[x["@enum"]](x["v"])
    if "@tuple" in x:
        return tuple(_decode(v) for v in x["@tuple"])
    if "@set" in x:
        return {_decode(v) for v in x["@set"]}
    if "@dict" in x:
        return {_decode(k): _decode(v) for k, v in x["@dict"]}
    cls = _TYPES.get(x.get("@", ""))
    if cls is None:
        raise CaptureFormatError(f"a saved capture holds an unknown record type {x.get('@')!r}")
    return cls(**{k: _decode(v) for k, v in x.items() if k != "@"})


def dumps(capture: Capture, ceilings: dict | None = None) -> str:
    """The capture as JSON, with the ceilings it was ranked against where given."""
    return json.dumps({"format": FORMAT, "capture": _encode(capture), "ceilings": ceilings})


def _doc(text: str) -> dict:
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise CaptureFormatError(f"a saved capture of format {got!r}; this perfloop reads format {FORMAT}")
    return doc


def loads(text: str) -> Capture:
    return _decode(_doc(text)["capture"])


def save(capture: Capture, path: str | os.PathLike, ceilings: dict | None = None) -> Path:
    """Write the capture (and the ceilings it is ranked against) as gzipped JSON (`.json.gz`)."""
    p = Path(path)
    p.write_bytes(gzip.compress(dumps(capture, ceilings).encode(), mtime=0))
    return p


def load(path: str | os.PathLike) -> tuple[Capture, dict | None]:
    """(the capture, the ceilings saved with it) of a file `save` wrote."""
    doc = _doc(gzip.decompress(Path(path).read_bytes()).decode())
    return _decode(doc["capture"]), doc.get("ceilings")
