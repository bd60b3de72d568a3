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

import math
from collections.abc import Sequence
from dataclasses import dataclass

EARLY = 3  # the first steps, compared one by one


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # the numbers, in words, either way
    early_err: float | None = None  # the largest relative difference in the first steps
    early_tol: float | None = None
    end_diff: float | None = None  # |candidate - baseline| of the end's mean loss
    end_tol: float | None = None

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
        return Verdict(True, "no loss seen (no backward() of a scalar in the steps): numerics not checked")
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


def judge_tokens(cand: Sequence[int], base: Sequence[int], noise: Sequence[int] | None) -> Verdict:
    """A generation run's verdict: its greedy tokens (the argmax of each model output) equal to
    the unchanged script's at the same seed, as far as both ran. Where the script's own two runs
    already part, the tokens after that point say nothing, and that is said."""
    if not base:
        return Verdict(True, "no logits seen (no model output with a vocabulary): tokens not checked")
    if not cand:
        return Verdict(False, "the candidate's run gave no tokens, the script's did")
    n = min(len(cand), len(base), len(noise) if noise else len(base))
    own = next((i for i in range(n) if noise[i] != base[i]), None) if noise else None
    if own is not None:
        n = own  # past it, the script's own runs disagree
    differ = next((i for i in range(n) if cand[i] != base[i]), None)
    within = f" (the script's own runs part at token {own}: compared up to it)" if own is not None else ""
    if differ is None:
        return Verdict(True, f"the first {n} greedy tokens equal the script's{within}")
    return Verdict(
        False,
        f"refused: greedy token {differ} is {cand[differ]} where the script's is {base[differ]} "
        f"({differ} of {n} equal before it){within}",
    )
