"""The immutable records a measurement produces: Work, Measurement, Comparison, Sweep.

A Measurement keeps its raw samples; every statistic is derived from them, so
nothing reported can disagree with what was taken.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from perfloop.harness import stats

OVER_CEILING = 1.05  # a share of a measured ceiling above this is not believed
NOISY_IQR = 0.10  # IQR/median above this: the spread is too large to trust small differences
FEW_SAMPLES = 10


@dataclass(frozen=True)
class Work:
    """What a call must do at the least: bytes through memory and floating-point ops.

    `bytes` counts each input read once and each output written once; with it a
    time becomes GB/s, and against the copy ceiling, a speed-of-light fraction.
    """

    bytes: float = 0.0
    flops: float = 0.0
    dtype: str | None = None  # picks the matmul ceiling (bf16/fp16 vs fp32)

    def __post_init__(self):
        for name in ("bytes", "flops"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
                raise ValueError(f"Work.{name}: must be a finite number >= 0, got {v!r}")

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity, flops per byte."""
        return self.flops / self.bytes if self.bytes else None

    def gbps(self, ms: float) -> float | None:
        """GB/s when this work takes `ms` milliseconds (None without bytes)."""
        return self.bytes / (ms * 1e-3) / 1e9 if self.bytes and ms > 0 else None

    def tflops(self, ms: float) -> float | None:
        """TFLOP/s when this work takes `ms` milliseconds (None without flops)."""
        return self.flops / (ms * 1e-3) / 1e12 if self.flops and ms > 0 else None


@dataclass(frozen=True)
class Measurement:
    """Timing samples of one function, and everything derived from them.

    >>> m = Measurement(samples_ms=(1.0, 1.1, 0.9, 1.0), work=Work(bytes=2e6))
    >>> round(m.median_ms, 3), round(m.gbps, 1)
    (1.0, 2.0)
    """

    samples_ms: tuple[float, ...]
    work: Work | None = None
    label: str = ""
    ceilings: dict | None = None
    env: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # stop reason, graph, flush, calls per sample...
    extra_warnings: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "samples_ms", tuple(float(s) for s in self.samples_ms))
        if not self.samples_ms:
            raise ValueError("samples_ms: a Measurement needs at least one sample")
        bad = next(((i, s) for i, s in enumerate(self.samples_ms) if not (math.isfinite(s) and s > 0)), None)
        if (
            bad is not None
        ):  # stored, a NaN broke the store's row, an inf read "same", a 0 broke compare's log
            raise ValueError(
                f"samples_ms: times must be finite and > 0 ms, got {bad[1]!r} at index {bad[0]}: "
                "drop the failed samples (or time more calls per sample) before making a Measurement"
            )

    # --- statistics, all from the raw samples
    @property
    def n(self) -> int:
        return len(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def p20_ms(self) -> float:
        return stats.quantile(self.samples_ms, 0.2)

    @property
    def p80_ms(self) -> float:
        return stats.quantile(self.samples_ms, 0.8)

    @property
    def iqr_ms(self) -> float:
        return stats.quantile(self.samples_ms, 0.75) - stats.quantile(self.samples_ms, 0.25)

    @property
    def ci95_ms(self) -> tuple[float, float]:
        return stats.median_ci(self.samples_ms, 0.95)

    # --- throughput against the measured ceilings
    @property
    def gbps(self) -> float | None:
        return self.work.gbps(self.median_ms) if self.work else None

    @property
    def tflops(self) -> float | None:
        return self.work.tflops(self.median_ms) if self.work else None

    @property
    def sol(self) -> float | None:
        """Speed of light: the larger of GB/s over copy GB/s and TFLOP/s over matmul TFLOP/s."""
        if not self.ceilings:
            return None
        fracs = []
        if self.gbps and self.ceilings.get("copy_gbps"):
            fracs.append(self.gbps / self.ceilings["copy_gbps"])
        peak = matmul_ceiling(self.ceilings, self.work.dtype if self.work else None)
        if self.tflops and peak:
            fracs.append(self.tflops / peak)
        return max(fracs) if fracs else None

    @property
    def warnings(self) -> tuple[str, ...]:
        w = list(self.extra_warnings)
        med = self.median_ms
        if med > 0 and self.iqr_ms / med > NOISY_IQR:
            w.append(
                f"noisy: IQR is {self.iqr_ms / med:.0%} of the median (over {NOISY_IQR:.0%}); "
                "close other work on the machine or raise the budget"
            )
        if self.n < FEW_SAMPLES:
            w.append(f"few samples: {self.n} (under {FEW_SAMPLES}); the CI is wide")
        if self.sol is not None and self.sol > OVER_CEILING:
            w.append(self._over_ceiling())
        return tuple(w)

    def _over_ceiling(self) -> str:
        """Why a rate above the measured ceiling is suspect, and what to check."""
        c = self.ceilings or {}
        gb = self.gbps / c["copy_gbps"] if self.gbps and c.get("copy_gbps") else 0
        peak = matmul_ceiling(c, self.work.dtype if self.work else None)
        tf = self.tflops / peak if self.tflops and peak else 0
        if tf >= gb:
            dtype = self.work.dtype if self.work and self.work.dtype else None
            hint = (
                f"Work.dtype is {dtype}: is that the precision the matmuls ran in?"
                if dtype
                else "Work.dtype is not given, so the fp32 ceiling applies: under bf16 autocast give "
                "Work(..., dtype='bf16')"
            )
            return (
                f"suspect: {tf:.0%} of the measured matmul ceiling, above the ceiling: the flops "
                f"are overcounted or the ceiling is the wrong one. {hint}"
            )
        return (
            f"suspect: {gb:.0%} of the measured copy ceiling, above the ceiling: the bytes are "
            "overcounted (an input read once counted twice?) or the data stayed in cache "
            "(flush_l2=False, or inputs smaller than the L2)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {
            "label": self.label,
            "samples_ms": list(self.samples_ms),
            "work": asdict(self.work) if self.work else None,
            "ceilings": self.ceilings,
            "env": self.env,
            "meta": self.meta,
            "extra_warnings": list(self.extra_warnings),
        }
        # Derived values, for readers that do not recompute them (ignored by from_dict).
        d["summary"] = {
            "median_ms": self.median_ms,
            "p20_ms": self.p20_ms,
            "p80_ms": self.p80_ms,
            "iqr_ms": self.iqr_ms,
            "ci95_ms": list(self.ci95_ms),
            "gbps": self.gbps,
            "tflops": self.tflops,
            "sol": self.sol,
            "warnings": list(self.warnings),
        }
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(
            samples_ms=tuple(d["samples_ms"]),
            work=Work(**d["work"]) if d.get("work") else None,
            label=d.get("label", ""),
            ceilings=d.get("ceilings"),
            env=d.get("env") or {},
            meta=d.get("meta") or {},
            extra_warnings=tuple(d.get("extra_warnings") or ()),
        )

    def __str__(self) -> str:
        lo, hi = self.ci95_ms
        s = f"{self.label or 'fn'}: {fmt_ms(self.median_ms)}"
        s += f" (CI95 {fmt_ms(lo)}..{fmt_ms(hi)}, n={self.n})"
        if self.gbps:
            s += f", {self.gbps:.4g} GB/s"
        if self.tflops:
            s += f", {self.tflops:.4g} TFLOP/s"
        if self.sol is not None:
            s += f", {self.sol:.0%} of SOL" + (" (suspect: see warnings)" if self.sol > OVER_CEILING else "")
        return s


@dataclass(frozen=True)
class Speedup:
    name: str
    speedup: float
    ci: tuple[float, float]
    p_value: float
    significant: bool


@dataclass(frozen=True)
class Comparison:
    """Interleaved measurements of several candidates and their speed-ups over a baseline."""

    baseline: str
    measurements: dict[str, Measurement]
    speedups: dict[str, Speedup]
    reference: Measurement | None = None  # a reference workload timed in the same rounds

    def __str__(self) -> str:
        lines = []
        for name, m in self.measurements.items():
            s = self.speedups.get(name)
            tail = ""
            if s is not None:
                sig = "significant" if s.significant else "not significant"
                tail = (
                    f"  {s.speedup:.2f}x [{s.ci[0]:.2f}, {s.ci[1]:.2f}] vs {self.baseline}"
                    f" (p={s.p_value:.2g}, {sig})"
                )
            lines.append(f"{name:>12}: {fmt_ms(m.median_ms)}{tail}")
        return "\n".join(lines)


@dataclass(frozen=True)
class SweepPoint:
    size: Any
    measurement: Measurement | None
    error: str | None = None


@dataclass(frozen=True)
class Sweep:
    """A Measurement per size, and the fit time = floor + c*size^k."""

    points: tuple[SweepPoint, ...]
    fit: dict | None
    fit_error: str | None = None  # why there is no fit, when there is none

    @property
    def measurements(self) -> dict:
        return {p.size: p.measurement for p in self.points if p.measurement is not None}

    def __str__(self) -> str:
        lines = [f"{'size':>12}  {'median':>10}"]
        for p in self.points:
            t = fmt_ms(p.measurement.median_ms) if p.measurement else f"error: {p.error}"
            lines.append(f"{p.size!s:>12}  {t:>10}")
        if self.fit:
            lines.append(fmt_fit(self.fit))
        elif self.fit_error:
            lines.append(self.fit_error)
        return "\n".join(lines)


def fmt_fit(fit: dict, size: str = "size") -> str:
    """A sweep's fit in one sentence: time = floor + c*n^k, and where the work starts to dominate."""
    knee = f"{fit['knee']:.3g}" if fit.get("knee") else "n/a"
    return (
        f"fit: time = {fmt_ms(fit['floor'])} + c*n^{fit['exponent']:.2f}; work dominates above "
        f"{size} ~{knee} (R^2 {fit['r2']:.3f})"
    )


def matmul_ceiling(ceil: dict | None, dtype: object) -> float | None:
    """The matmul TFLOP/s ceiling that applies to a dtype (fp16 uses the bf16 one)."""
    if not ceil:
        return None
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    if name in ("bfloat16", "float16", "bf16", "fp16"):
        return ceil.get("matmul_bf16_tflops") or ceil.get("matmul_fp32_tflops")
    if name == "tf32":  # fp32 inputs on tensor cores
        return ceil.get("matmul_tf32_tflops") or ceil.get("matmul_fp32_tflops")
    return ceil.get("matmul_fp32_tflops")


def fmt_ms(ms: float) -> str:
    """A time with a unit a person reads at a glance."""
    if ms is None or not math.isfinite(ms):
        return "n/a"
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3f} ms"
    if ms >= 1e-3:
        return f"{ms * 1e3:.2f} us"
    return f"{ms * 1e6:.0f} ns"


_UNITS_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_ms(cell) -> float | None:
    """fmt_ms's text ("8.327 ms", "86.98 us") back to milliseconds; None for text that holds
    no time ("-", "n/a"): experiments draw their plots from their stored tables with it."""
    if isinstance(cell, (int, float)):
        return float(cell)
    value, _, unit = str(cell).partition(" ")
    try:
        return float(value) * _UNITS_MS[unit]
    except (KeyError, ValueError):
        return None
