"""Is a candidate's training the script's own? Its loss curve judged against the spread the
unchanged script has anyway.

The reference is the baseline at the script's seed; the spread is measured, never assumed:
- `noise`: the baseline run twice at the same seed (its own nondeterminism, per step);
- `seeds`: the baseline at another seed (the script's seeds shifted by one): how far two
  equally good trainings end apart.
Two checks, both printed with their tolerance:
1. the first steps (before the curves may part): each within `max(numerics floor, 3 x noise)`
   relative, the floor being what the candidate is declared to move (the last bits of fp32 sums,
   TF32's mantissa, bf16's); a kernel that is wrong by a small bias parts here;
2. the end (the last third of the steps, averaged): within the seed spread plus 3 x noise.
A NaN or inf the baseline does not have refuses a candidate outright.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

EARLY = 3  # the first steps, compared one by one


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # the numbers, in words, either way
    early_err: float | None = None  # the largest relative difference in the first steps
    early_tol: float | None = None
    end_diff: float | None = None  # |candidate - baseline| of the end's mean loss
    end_tol: float | None = None
    checked: bool = True  # False: nothing to compare (no loss, no logits seen); never kept
    compared: int | None = None  # a generation run's: the positions compared

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _end(curve: Sequence[float]) -> float:
    tail = list(curve)[-max(1, len(curve) // 3) :]
    return sum(tail) / len(tail)


def judge(
    cand: Sequence[float],
    base: Sequence[float],
    noise: Sequence[float] | None,
    seeds: Sequence[float] | None,
    floor: float,
) -> Verdict:
    """The verdict on a candidate's losses `cand` against the baseline `base` (same seed),
    `noise` (the baseline again, same seed) and `seeds` (the baseline at another seed)."""
    if not base:
        return Verdict(
            False, "not checked: no loss seen (no backward() of a scalar in the steps)", checked=False
        )
    if not cand:
        return Verdict(False, "the candidate's run backpropagated no loss, the script's did")
    n = min(len(cand), len(base), *(len(c) for c in (noise, seeds) if c))
    bad = [i for i in range(len(cand)) if not math.isfinite(cand[i])]
    if bad and all(math.isfinite(x) for x in base[:n]):
        return Verdict(False, f"loss not finite at step {bad[0]} ({cand[bad[0]]}); the script's is finite")
    cand, base = list(cand[:n]), list(base[:n])
    wobble = [_rel(noise[i], base[i]) for i in range(n)] if noise else [0.0] * n
    k = min(EARLY, n)
    tol = max(floor, 3 * max(wobble[:k], default=0.0))
    errs = [_rel(cand[i], base[i]) for i in range(k)]
    early = max(errs, default=0.0)
    if early > tol:
        i = errs.index(early)
        return Verdict(
            False,
            f"step {i}'s loss {cand[i]:.6g} vs the script's {base[i]:.6g}: {early:.2g} relative, "
            f"over the tolerance {tol:.2g} (what the change may move: {floor:.0e}; the script's own "
            f"run-to-run: {max(wobble[:k], default=0.0):.2g})",
            early,
            tol,
        )
    end_c, end_b = _end(cand), _end(base)
    spread = abs(_end(seeds[:n]) - end_b) if seeds else 0.0
    end_tol = spread + 3 * abs(_end(noise[:n]) - end_b) if noise else spread
    end_tol = max(end_tol, floor * abs(end_b))
    diff = abs(end_c - end_b)
    words = (
        f"first {k} steps within {early:.2g} of the script's (tolerance {tol:.2g}); the last "
        f"{max(1, n // 3)} steps' mean {end_c:.5g} vs {end_b:.5g} ({diff:.3g} apart; another seed "
        f"ends {spread:.3g} apart, tolerance {end_tol:.3g})"
    )
    return Verdict(
        diff <= end_tol, ("" if diff <= end_tol else "refused: ") + words, early, tol, diff, end_tol
    )


@dataclass(frozen=True)
class Logits:
    """A generation run's model calls as its child read them (workflows.tune.logits): at each
    position (each row of each call's logits, in turn) the greedy token, the largest logits
    (largest first) with their tokens, and the logits' scale (the largest |logit|); `calls`: the
    positions each call added; `missing`: where none were read, why."""

    tokens: list[int]
    top: list[list[float]] = field(default_factory=list)
    top_tokens: list[list[int]] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    dtype: str | None = None
    calls: list[int] = field(default_factory=list)
    missing: str | None = None

    @staticmethod
    def of(run: dict) -> Logits:
        """From a child's result."""
        return Logits(
            tokens=list(run.get("tokens") or []),
            top=run.get("top_logits") or [],
            top_tokens=run.get("top_tokens") or [],
            scale=run.get("logit_scale") or [],
            dtype=run.get("logits_dtype"),
            calls=run.get("logit_calls") or [],
            missing=run.get("logits_missing"),
        )

    def where(self, i: int) -> str:
        """Position i in words, with the model call it came from."""
        ends = enumerate(itertools.accumulate(self.calls))
        call = next((c for c, end in ends if i < end), None)
        return f"position {i}" if call is None else f"position {i} (model call {call})"


# A model computed in bf16 or fp16 moves its logits by its own rounding whatever else a candidate
# changes (sums in another order, a fused kernel): a few units in the last place of the largest.
ULPS = 4
EPS = {"torch.bfloat16": 2**-7, "torch.float16": 2**-10}


def judge_tokens(cand: Logits, base: Logits, noise: Logits | None, floor: float) -> Verdict:
    """A generation run's verdict against the unchanged script's at the same seed (`base`, and
    `noise`: the script again). Position by position, its greedy token and its top logits (the
    k-th largest against the k-th largest: blind to which of two tied tokens is which), each
    within `floor` of the logits' scale (widened by the logits' own rounding and 3 x the script's
    run-to-run), up to the first token that differs: a tie where the script's own margin between
    its token and the candidate's is within that floor (after it the sequences part, as they
    may: not compared), refused otherwise. No logits read in the script's run: not checked."""
    if not base.tokens:
        why = base.missing or "no model output seen"
        return Verdict(False, f"not checked: no logits read from the script's model ({why})", checked=False)
    if not cand.tokens:
        return Verdict(
            False,
            f"refused: the candidate's run gave no logits ({cand.missing}), the script's did",
            compared=0,
        )
    n, own = _comparable(cand, base, noise)
    rel, why = _floor(cand, base, noise, n, floor)
    flip = next((i for i in range(n) if cand.tokens[i] != base.tokens[i]), None)
    end = n if flip is None else flip + 1
    gaps = [_of_scale(_gap(cand, base, i), base.scale[i]) for i in range(end)]
    parted = next((i for i in range(end) if gaps[i] > rel), None)
    words = _Words(cand, base, rel, why, own)
    if flip is not None and not _tie(cand, base, flip, rel):
        return Verdict(False, words.flip(flip, parted), _margin(cand, base, flip)[0], rel, compared=end)
    if parted is not None:
        return Verdict(False, words.parted(parted, flip), gaps[parted], rel, compared=parted + 1)
    worst = max(gaps, default=0.0)
    return Verdict(True, words.agreed(end, flip, worst), worst, rel, compared=end)


def _comparable(cand: Logits, base: Logits, noise: Logits | None) -> tuple[int, int | None]:
    """The positions both runs have, and where the script's own two runs part (None: they do
    not): past it, they say nothing."""
    n = min(len(cand.tokens), len(base.tokens))
    if not (noise and noise.tokens):
        return n, None
    n = min(n, len(noise.tokens))
    own = next((i for i in range(n) if noise.tokens[i] != base.tokens[i]), None)
    return (n if own is None else own), own


def _floor(cand: Logits, base: Logits, noise: Logits | None, n: int, floor: float) -> tuple[float, str]:
    """The tolerance, relative to the logits' scale, and what set it."""
    spread = (
        max((_of_scale(_gap(noise, base, i), base.scale[i]) for i in range(n)), default=0.0) if noise else 0.0
    )
    terms = [(floor, f"the candidate's numerics floor {floor:.0e}")]
    for run in (base, cand):
        if run.dtype in EPS:
            terms.append(
                (ULPS * EPS[run.dtype], f"{run.dtype[6:]} logits' rounding ({ULPS} units in the last place)")
            )
    terms.append((3 * spread, f"3 x the script's own run-to-run {spread:.2g}"))
    return max(terms, key=lambda t: t[0])


def _of_scale(x: float, scale: float) -> float:
    if x == 0:
        return 0.0
    return x / scale if scale > 0 else math.inf


def _gap(cand: Logits, base: Logits, i: int) -> float:
    """The largest difference of the sorted top logits at position i: the k-th largest of two
    vectors part by no more than the vectors do, whichever tokens hold them."""
    return max((_diff(a, b) for a, b in zip(cand.top[i], base.top[i], strict=False)), default=0.0)


def _diff(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    d = abs(a - b)
    return d if math.isfinite(d) else math.inf  # a NaN or inf the other run does not have


def _margin(cand: Logits, base: Logits, i: int) -> tuple[float, bool]:
    """The script's margin at position i between its top logit and the candidate's token,
    relative to the logits' scale, and whether it is known (the token is among the script's
    top ones; else the margin is at least the one returned)."""
    token, top, tokens = cand.tokens[i], base.top[i], base.top_tokens[i]
    known = token in tokens
    other = top[tokens.index(token)] if known else top[-1]
    return _of_scale(top[0] - other, base.scale[i]), known


def _tie(cand: Logits, base: Logits, i: int, rel: float) -> bool:
    margin, known = _margin(cand, base, i)
    return known and margin <= rel


@dataclass(frozen=True)
class _Words:
    """A token verdict's reason: what was compared, and the numbers."""

    cand: Logits
    base: Logits
    rel: float
    why: str
    own: int | None

    def _floor(self, i: int) -> str:
        s = self.base.scale[i]
        return f"the floor {self.rel * s:.3g} ({self.rel:.2g} of the logits' scale {s:.3g}: {self.why})"

    def _within(self) -> str:
        if self.own is None:
            return ""
        return f" (the script's own runs part at position {self.own}: compared up to it)"

    def flip(self, i: int, parted: int | None) -> str:
        margin, known = _margin(self.cand, self.base, i)
        s = self.base.scale[i]
        size = (
            f"{margin * s:.3g}"
            if known
            else f"at least {margin * s:.3g} (not among its top {len(self.base.top[i])})"
        )
        first = (
            f"; its top logits had parted already at {self.base.where(parted)}"
            if parted is not None and parted < i
            else ""
        )
        return (
            f"refused: greedy token {self.cand.tokens[i]} at {self.base.where(i)} where the script's is "
            f"{self.base.tokens[i]}: the script's margin between them is {size}, over {self._floor(i)}; "
            f"{i} positions agreed before it{first}{self._within()}"
        )

    def parted(self, i: int, flip: int | None) -> str:
        gap = _gap(self.cand, self.base, i)
        there = (
            f"the greedy token there is {self.cand.tokens[i]} where the script's is {self.base.tokens[i]}"
            if flip == i
            else "the greedy tokens agree up to it"
        )
        return (
            f"refused: the top logits at {self.base.where(i)} differ from the script's by {gap:.3g}, over "
            f"{self._floor(i)}; {there}{self._within()}"
        )

    def agreed(self, n: int, flip: int | None, worst: float) -> str:
        k = len(self.base.top[0])
        close = f"their top {k} logits at most {worst:.2g} of the logits' scale from the script's"
        if flip is None:
            floor = f"floor {self.rel:.2g}: {self.why}"
            return f"the first {n} greedy tokens equal the script's, {close} ({floor}){self._within()}"
        margin, _ = _margin(self.cand, self.base, flip)
        s = self.base.scale[flip]
        return (
            f"the first {flip} greedy tokens equal the script's, then a tie at {self.base.where(flip)}: "
            f"token {self.cand.tokens[flip]} where the script's is {self.base.tokens[flip]}, the script's "
            f"margin between them {margin * s:.3g} within {self._floor(flip)}; {close} up to it; past it the "
            f"sequences part, as they may: {n} positions compared{self._within()}"
        )
