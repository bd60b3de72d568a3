"""The regression gate: is a later run slower than an earlier one by more than runs of the same
code vary by?

Samples within one run say nothing about the spread between runs: a machine's clocks, its other
load, the memory a process happened to get all move from run to run. The gate therefore judges
a slowdown against three things, and says which it used:

1. the fast tail of each run's samples (their 10th percentile): interference only ever adds
   time, so the fastest samples are the ones least touched by it;
2. a reference workload measured in both runs (`reference()`: a copy on a GPU, an elementwise
   tanh over torch's threads on a CPU): its change between the runs is the machine's drift,
   and is divided out -- round by round, by the lower quartile of the per-round ratios, where
   the reference was timed interleaved with the code. In a contended run (another process
   busy on a core) only where the reference followed the code round by round (dividing
   narrows the spread), and a clear raw change the division would silence is "cannot
   judge", not a pass. Where the machine moved more than MAX_DRIFT against the code (faster
   while the code got slower) the raw tails stand, a lower bound of the code's change (under
   load only past MAX_DRIFT itself); where it moved more than that the code's way there is
   nothing to judge; under load, a machine that moved the code's way (any amount, and did not
   follow it round by round) leaves only raw / machine surely the code's, judged past the floor
   like any change, and a raw change inside the floor that is past it with the machine's move
   divided out is "cannot judge", not "same";
3. a noise floor: the run-to-run spread of this key over earlier runs of the same code (the
   same commit) when the history holds at least three, else a default for the device kind.
A slowdown is a regression only past the larger of the user's threshold and that floor, when
the raw times moved too (by a quarter of the floor, half in a contended run: else only the
reference did), and when the two runs' samples differ significantly (Mann-Whitney).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perfloop.harness import stats

DEFAULT_FLOOR = {"cpu": 0.15, "cuda": 0.03}  # run-to-run spread assumed when no history is known
CONTENDED_FLOOR = 0.4  # ... when another process took CPU time while either run was timed
MIN_HISTORY = 3  # runs of the same code needed to learn the floor
TAIL = 0.1  # the quantile that stands for a run: its fast tail
ROUND_Q = 0.25  # interleaved with the reference: this quantile of the per-round ratios
SIGMAS = 4  # the learned floor: this many robust standard deviations of the runs' spread
REFERENCE_OP = "_reference"  # the stored rows of the reference workload
REFERENCE_N = {"cuda": 2**24, "cpu": 2**18}  # its elements: 64 MiB on a GPU (past its L2), 1 MiB on a CPU


def tail_ms(samples: Sequence[float]) -> float:
    return float(np.quantile(np.asarray(samples, dtype=float), TAIL))


def normalized_tail(samples: Sequence[float], ref: Sequence[float] | None) -> float:
    """A run's fast tail divided by its reference workload's: round by round where the two
    were interleaved (equal counts), else tail over tail."""
    if ref is None:
        return tail_ms(samples)
    if len(ref) == len(samples):
        ratios = np.asarray(samples, dtype=float) / np.asarray(ref, dtype=float)
        return float(np.quantile(ratios, ROUND_Q))
    return tail_ms(samples) / tail_ms(ref)


@dataclass(frozen=True)
class Verdict:
    ratio: float  # b/a, fast tails, as measured
    drift: float | None  # the reference workload's b/a: the machine's own change
    adjusted: float  # ratio / drift
    floor: float  # run-to-run spread a change must exceed (a fraction)
    floor_source: str
    p_value: float
    regression: bool
    verdict: str
    divided: bool = True  # whether the reference's change was divided out

    @property
    def method(self) -> str:
        if self.drift and self.divided:
            how = f"fast tails (p10), divided by the reference workload ({self.drift:.3f}x)"
        elif self.drift:
            how = (
                f"fast tails (p10), not divided by the reference workload ({self.drift:.3f}x): "
                "it did not follow the code"
            )
        else:
            how = "fast tails (p10)"
        return f"{how}; noise floor {self.floor:.1%} ({self.floor_source})"


def tracks(samples: Sequence[float], ref: Sequence[float] | None) -> bool:
    """Whether the reference followed the code round by round: dividing by it narrows the
    spread of the run's log times (their median absolute deviation)."""
    if ref is None or len(ref) != len(samples) or len(samples) < 5:
        return False
    raw = np.log(np.asarray(samples, dtype=float))
    per_round = raw - np.log(np.asarray(ref, dtype=float))
    mad = lambda x: float(np.median(np.abs(x - np.median(x))))
    return mad(per_round) < mad(raw)


def contended(meta: dict | None) -> bool:
    """Whether a measurement's samples were taken while other processes took CPU time."""
    cores = (meta or {}).get("other_cpu_cores")
    return cores is not None and cores > stats.BUSY_OTHERS


def learned_floor(history: Sequence[float]) -> float | None:
    """SIGMAS robust standard deviations of log(time) over runs of the same code, as a fraction;
    None with fewer than MIN_HISTORY runs."""
    if len(history) < MIN_HISTORY:
        return None
    logs = np.log(np.asarray(history, dtype=float))
    sigma = 1.4826 * float(np.median(np.abs(logs - np.median(logs))))
    return max(0.01, math.exp(SIGMAS * sigma) - 1)


MAX_DRIFT = 2.0  # a reference that moved more than this between the runs: two different machines


def _floor(history: Sequence[float] | None, contended: bool, kind: str) -> tuple[float, str]:
    """(the noise floor, as a fraction, and where it comes from): learned from the runs of the
    same code where there are enough, else the default for the run's device and load."""
    learned = learned_floor(history or [])
    if learned is not None and contended and learned < CONTENDED_FLOOR:
        floor, source = (
            CONTENDED_FLOOR,
            f"a contended run (the {len(history)} runs of the same code say {learned:.0%})",
        )
    elif learned is not None:
        floor, source = learned, f"learned from {len(history)} runs of the same code"
    else:
        floor = CONTENDED_FLOOR if contended else DEFAULT_FLOOR.get(kind, DEFAULT_FLOOR["cpu"])
        source = ("default for a contended run" if contended else f"default for a {kind} run") + (
            "; no history of the same code"
        )
    return floor, source


def _machine_moved(ratio, drift, adjusted, floor, source, divided, contended, against) -> Verdict | None:
    """A "cannot judge" verdict where the machine's own pace (the reference workload) moved
    between the runs by enough to leave the code's change unknown; None where it did not."""
    if drift is not None and abs(math.log(drift)) > math.log(MAX_DRIFT) and not against:
        # the machine itself ran that much slower or faster in one run, the way the code moved:
        # what remains of the code's change after dividing that out is not a measurement
        word = "slower" if drift > 1 else "faster"
        why = (
            f"cannot judge: the machine ran {max(drift, 1 / drift):.1f}x {word} in the later run "
            "(the reference workload); run both again on a quiet machine"
        )
        return Verdict(ratio, drift, adjusted, floor, source, 1.0, False, why, divided)
    machine = max(drift, 1 / drift) if drift is not None else 1.0
    same_way = drift is not None and (drift > 1) == (ratio > 1)
    # the most of the raw change the machine's move could explain: all of it when the two moved
    # the same way (the code's own change is then only ratio / machine), up to MAX_DRIFT against
    bound = machine * (1 + floor) if same_way else min(machine, MAX_DRIFT)
    moved = machine > 1 + floor or same_way  # a move the code's way counts at any size
    if contended and not divided and moved and abs(math.log(ratio)) < math.log(bound):
        # another process moved the machine's pace between the runs (the code's way, or past the
        # noise floor against it), in a way the reference could not divide out, by enough to
        # leave the code's change unknown
        if same_way:
            why = (
                f"cannot judge: with another process busy on a core, the machine's pace (the "
                f"reference workload) moved {machine:.2f}x the code's way between the runs, round "
                f"by round unlike the code: of the code's raw {ratio:.2f}x only "
                f"{max(ratio, 1 / ratio) / machine:.2f}x is surely its own, inside the {floor:.0%} "
                "floor; run both again on a quiet machine"
            )
        else:
            why = (
                f"cannot judge: with another process busy on a core, the machine's pace (the "
                f"reference workload) moved {machine:.2f}x between the runs, round by round unlike "
                f"the code, and the code's raw {ratio:.2f}x is less than {bound:.2f}x; run both "
                "again on a quiet machine"
            )
        return Verdict(ratio, drift, adjusted, floor, source, 1.0, False, why, divided)
    would = ratio / drift if drift is not None else ratio  # the code's change were the move divided out
    if contended and not divided and abs(math.log(ratio)) <= math.log1p(floor) < abs(math.log(would)):
        # inside the floor raw, past it with the machine's move divided out: neither is sure
        word = "faster" if drift < 1 else "slower"
        why = (
            f"cannot judge: with another process busy on a core, the raw times read the same "
            f"({ratio:.2f}x) but {would:.2f}x with the machine's pace divided out (the reference "
            f"workload ran {machine:.2f}x {word}, round by round unlike the code); run both "
            "again on a quiet machine"
        )
        return Verdict(ratio, drift, adjusted, floor, source, 1.0, False, why, divided)
    return None


def judge(
    a: Sequence[float],
    b: Sequence[float],
    *,
    fail_above_pct: float | None = None,
    kind: str = "cpu",
    a_ref: Sequence[float] | None = None,
    b_ref: Sequence[float] | None = None,
    history: Sequence[float] | None = None,
    contended: bool = False,
    alpha: float = 0.01,
) -> Verdict:
    """Whether samples `b` (a later run) are slower than `a` beyond run-to-run noise.

    >>> v = judge([1.0, 1.01, 0.99] * 5, [1.5, 1.52, 1.49] * 5, fail_above_pct=5)
    >>> v.regression, v.verdict
    (True, 'slower')
    """
    ratio = tail_ms(b) / tail_ms(a)
    a_raw, b_raw = a, b
    drift = None
    if a_ref is not None and b_ref is not None:
        drift = ratio * normalized_tail(a, a_ref) / normalized_tail(b, b_ref)
    # the reference is divided out on a quiet machine, and where the machine's change is in
    # bounds; a machine that ran more than MAX_DRIFT faster while the code ran slower (or the
    # reverse) leaves the raw change as a lower bound of the code's
    against = drift is not None and abs(math.log(drift)) > math.log(MAX_DRIFT) and (drift > 1) != (ratio > 1)
    follows = not contended or (tracks(a, a_ref) and tracks(b, b_ref))
    divided = drift is not None and follows and not against
    adjusted = ratio / drift if divided else ratio
    if divided and len(a_ref) == len(a) and len(b_ref) == len(b):  # interleaved: test the per-round ratios
        a = [x / r for x, r in zip(a, a_ref, strict=True)]
        b = [x / r for x, r in zip(b, b_ref, strict=True)]
    floor, source = _floor(history, contended, kind)
    unsure = _machine_moved(ratio, drift, adjusted, floor, source, divided, contended, against)
    if unsure is not None:
        return unsure
    p = stats.independent_ratio(a, b)["p_value"] if len(a) > 1 and len(b) > 1 else 1.0
    # the raw times must have moved too: where they did not, only the reference workload did,
    # and its change is not the code's (code whose time does not follow the machine: a wait)
    raw_moved = abs(math.log(ratio)) > math.log1p(floor / (2 if contended else 4))
    significant = p < alpha and abs(math.log(adjusted)) > math.log1p(floor) and raw_moved
    if contended and divided:  # the reference followed the code, but a hog moves both unevenly
        p_raw = stats.independent_ratio(a_raw, b_raw)["p_value"] if len(a) > 1 and len(b) > 1 else 1.0
        raw_says = p_raw < alpha and abs(math.log(ratio)) > math.log1p(floor)
        if raw_says and not significant:  # a clear raw change the reference would silence: said
            why = _two_readings(
                "with another process busy on a core, ", ratio, adjusted, raw_says, significant
            )
            return Verdict(ratio, drift, adjusted, floor, source, p, False, why, divided)
    if divided and significant and (ratio > 1) != (adjusted > 1):
        # the raw times moved one way and, divided by the reference, the other: the reference's
        # own move is the whole of the change, and the two measurements disagree on its sign
        why = _two_readings(
            "", ratio, adjusted, True, True, f"the machine's pace moved {max(drift, 1 / drift):.2f}x"
        )
        return Verdict(ratio, drift, adjusted, floor, source, p, False, why, divided)
    if not significant and p >= alpha and abs(math.log(adjusted)) > math.log1p(floor) and raw_moved:
        # past the floor, but the runs' samples are too spread to tell it from noise: said, not "same"
        why = (
            f"cannot judge: {adjusted:.2f}x is past the {floor:.0%} noise floor, but the two runs' "
            f"samples do not differ significantly (p {p:.2g}); run both again on a quieter "
            "machine"
        )
        return Verdict(ratio, drift, adjusted, floor, source, p, False, why, divided)
    if not significant:
        verdict = f"same (within {floor:.0%} noise)"
    else:
        verdict = "slower" if adjusted > 1 else "faster"
    limit = max(floor, (fail_above_pct or 0) / 100)
    regression = bool(fail_above_pct is not None and significant and adjusted > 1 + limit)
    return Verdict(ratio, drift, adjusted, floor, source, p, regression, verdict, divided)


def _two_readings(when: str, ratio: float, adjusted: float, raw: bool, divided: bool, why: str = "") -> str:
    """A "cannot judge" where the raw times and the times divided by the reference disagree."""
    word = lambda yes, r: ("slower" if r > 1 else "faster") if yes else "the same"
    return (
        f"cannot judge: {when}the raw times read {word(raw, ratio)} ({ratio:.2f}x) and divided by the "
        f"reference {word(divided, adjusted)} ({adjusted:.2f}x){': ' + why if why else ''}; run both again "
        "on a quiet machine"
    )


@functools.lru_cache(maxsize=2)
def _reference_inputs(device: str):
    import torch

    x = torch.randn(
        REFERENCE_N[device], device=device, generator=torch.Generator(device=device).manual_seed(0)
    )
    return x, torch.empty_like(x)


def reference(device: str):
    """The fixed workload measured in every run: on a GPU a copy (bandwidth), on a CPU an
    elementwise tanh that torch spreads over its threads like most tensor code, so it feels
    the same clocks, cache and thread scheduling; its change between two runs is the
    machine's, not the code's."""
    import torch

    x, y = _reference_inputs(device)
    if device == "cuda":
        return functools.partial(y.copy_, x)
    return functools.partial(torch.tanh, x, out=y)
