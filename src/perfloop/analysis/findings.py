"""What every analysis answers with: typed findings, and one diagnosis holding them.

A `Finding` is one cause: its kind (the analyzer that found it), its bound, the time it would
save, the evidence (numbers, with a sentence saying them), where in the user's code it is, and
the next step. A `Diagnosis` is a step's findings, largest saving first -- one op's diagnosis is
a one-finding step -- with the step's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from perfloop.analysis.bound import Bound
from perfloop.harness.measurement import fmt_ms

SHOWN = 10


class Kind(str, Enum):
    """The analyzer that found a finding: one place to add a cause. A str, so it compares and
    serializes as its word."""

    ATTENTION = "attention"  # attention written out: its scores through memory
    FUSION = "fusion"  # a run of memory-bound ops in one module
    TINY_OPS = "tiny ops"  # a run of ops too short to fill the device
    PAGEABLE_COPY = "pageable copy"
    LAYOUT_COPY = "layout copy"
    CONV_LAYOUT = "conv layout"  # convolutions in NCHW, transposed around each kernel
    DTYPE_CAST = "dtype cast"
    OPTIMIZER = "optimizer"
    PRECISION = "precision"  # fp32 matmuls with TF32 off
    ROOFLINE = "roofline"  # an op below its ceiling
    LATENCY = "latency"  # ... short kernels, far from both ceilings
    LAUNCH = "launch"  # the device idle while the host launches
    HOST = "host"  # idle for the host's other work (data, allocator, Python, NumPy)
    SYNC = "sync"  # idle after synchronizing calls
    SAMPLING_SYNC = "sampling sync"  # ... a generation step's sampling or token read
    DATA_DEPENDENT = "data-dependent"  # ... of data-dependent shapes (nonzero, boolean masks)
    COMPILE = "compile"  # compilation inside the profiled steps
    RECOMPILE = "recompile"
    GRAPH_BREAK = "graph break"
    CUDA_GRAPHS_SKIPPED = "cuda graphs skipped"  # reduce-overhead asked for, Inductor skipped it
    DECODE_WEIGHTS = "decode weights"  # fp32 weights read once a token in a generation step
    SDPA_MATH = "sdpa math"  # scaled_dot_product_attention run by its math backend
    KV_CAT = "kv cache cat"  # a generation step's KV cache grown by torch.cat each token
    CUDNN_PLAN = "cudnn plan"  # SDPA's cuDNN backend building a plan for each new shape
    SMALL_BATCH = "small batch"  # a generation step bound by its weights' read, few tokens a step
    DATA_PREP = "data preparation"  # a training step's batch built op by op before the forward

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Site:
    """Where a finding is in the user's code: the module (qualified name) and the line
    ("train.py:42 (forward)"); either may be empty."""

    module: str = ""
    line: str = ""

    def __str__(self) -> str:
        return " at ".join(x for x in (self.module, self.line) if x)

    def __bool__(self) -> bool:
        return bool(self.module or self.line)


@dataclass(frozen=True)
class Evidence:
    """The numbers behind a finding (`values`) and the sentence that says them (`text`). Reads as
    its text: `str(e)`, `"nonzero" in e`."""

    text: str
    values: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text

    def __contains__(self, part: str) -> bool:
        return part in self.text

    def to_dict(self) -> dict:
        return {"text": self.text, **self.values}


@dataclass(frozen=True)
class Finding:
    title: str
    saves_ms: float  # per call
    share: float  # of the step's wall time
    bound: Bound
    evidence: Evidence | str
    advice: str
    where: str = ""  # the call site in the user's code, and whether pl.patch reaches it, in words
    kind: Kind | None = None  # the analyzer that found it
    site: Site = field(default_factory=Site)

    def __str__(self) -> str:
        saves = f"saves up to {fmt_ms(self.saves_ms)} per call ({self.share:.0%} of the step)"
        where = [f"where: {self.where}"] if self.where else []
        lines = [self.title, f"{saves}, {self.bound}-bound", f"evidence: {self.evidence}", *where]
        return "\n    ".join([*lines, f"next: {self.advice}"])

    def to_dict(self) -> dict:
        ev = self.evidence
        return {
            "kind": self.kind,
            "title": self.title,
            "saves_ms": self.saves_ms,
            "share": self.share,
            "bound": self.bound,
            "evidence": str(ev),
            "values": ev.values if isinstance(ev, Evidence) else {},
            "advice": self.advice,
            "where": self.where,
            "site": {"module": self.site.module, "line": self.site.line},
        }


REPLAYED = "cuda_graphs_replayed"  # a step's values: the share of its device time CUDA graphs replayed


@dataclass
class Diagnosis:
    """A step's findings, largest saving first, with the step's numbers (times per call). For
    one op (`single`), one finding, said as its bound, evidence and next step."""

    findings: list[Finding]
    wall_ms: float
    device_ms: float
    busy_share: float

    at_ceiling: str = ""  # with nothing to gain: the op that takes the step, at its ceiling
    ceiling_bound: Bound | None = None  # and which ceiling (COMPUTE, MEMORY)
    note: str = ""  # why there is nothing to rank, where that is not "nothing above 1%"
    single: bool = False  # one op's diagnosis (classify's): its one finding's evidence is the step's
    values: dict = field(default_factory=dict)  # the step's (or op's) numbers beside wall, device, busy

    @property
    def opportunities(self) -> list[Finding]:
        return self.findings

    @property
    def bound(self) -> Bound:
        if self.findings:
            return self.findings[0].bound
        return self.ceiling_bound or Bound.NONE

    @property
    def advice(self) -> str:
        if self.findings:
            return self.findings[0].advice
        if self.at_ceiling:
            return (
                f"{self.at_ceiling}: nothing to gain in this code; only less work (a lower precision) helps"
            )
        return self.note or "nothing ranks above 1% of the step"

    @property
    def evidence(self) -> dict:
        if self.single:
            return self.values
        return {
            "wall_time": fmt_ms(self.wall_ms),
            "device_time": fmt_ms(self.device_ms),
            "busy": f"{self.busy_share:.0%}",
            "opportunities": len(self.findings),
            **self.values,
        }

    def _blockers_moved(self) -> bool:
        return any(a.saves_ms < b.saves_ms for a, b in zip(self.findings, self.findings[1:], strict=False))

    def __str__(self) -> str:
        if self.single:
            ev = ", ".join(f"{k}={_fmt(v)}" for k, v in self.values.items())
            return f"{self.bound}-bound\n  evidence: {ev}\n  next: {self.advice}"
        n = len(self.findings)
        head = (
            f"step: wall {fmt_ms(self.wall_ms)}, device {fmt_ms(self.device_ms)}, busy "
            f"{self.busy_share:.0%}; {n} {'opportunity' if n == 1 else 'opportunities'}"
            + (", largest first" if n > 1 else "")
            + (" (what blocks CUDA graphs before them)" if self._blockers_moved() else "")
        )
        if self.values.get(REPLAYED):
            head += f"\n{self.values[REPLAYED]:.0%} of the device time replayed from CUDA graphs"
        lines = [head] + [f"{i}. {o}" for i, o in enumerate(self.findings[:SHOWN], 1)]
        if n > SHOWN:
            lines.append(f"... and {n - SHOWN} smaller ones (.findings)")
        if not self.findings:
            lines.append(f"{self.bound}-bound: {self.advice}" if self.at_ceiling else self.advice)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = {
            "bound": self.bound,
            "wall_ms": self.wall_ms,
            "device_ms": self.device_ms,
            "advice": self.advice,
            "opportunities": [f.to_dict() for f in self.findings],
        }
        if self.single:
            out["evidence"] = self.values
        elif REPLAYED in self.values:
            out[REPLAYED] = self.values[REPLAYED]
        return out


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def count_words(n: int, one: str, many: str) -> str:
    """`n` with the word that fits it: "1 call", "3 calls"."""
    return f"{n} {one if n == 1 else many}"
