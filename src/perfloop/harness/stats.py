"""What a set of timing samples says: robust summaries, confidence intervals, tests.

Timing samples are skewed (a floor plus rare slow outliers), so perfloop reports
order statistics -- median, p20/p80, IQR -- and a distribution-free confidence
interval of the median, never a mean alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

BUSY_OTHERS = 0.3  # other processes' CPU use, in cores, above which CPU samples are contended


def quantile(samples: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of the samples, linearly interpolated."""
    return float(np.quantile(np.asarray(samples, dtype=float), q))


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (binomial order statistics).

    With n samples the median lies between the j-th and k-th smallest with
    probability given by Binomial(n, 1/2); no normality assumed. For fewer than
    6 samples no 95% interval exists and the full range is returned.
    """
    from scipy import stats  # imported on use: the read-only verbs stay light

    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    if n == 0:
        raise ValueError("samples: empty; need at least one sample for a confidence interval")
    # j = smallest count with P(Bin(n, 1/2) <= j) >= alpha/2; the interval is
    # [x_(j), x_(n-j+1)] in 1-based order statistics.
    j = int(stats.binom.ppf((1.0 - confidence) / 2, n, 0.5))
    lo, hi = (j - 1, n - j) if j >= 1 else (0, n - 1)
    return float(x[lo]), float(x[hi])


def relative_ci_halfwidth(samples: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of the median's CI, as a fraction of the median."""
    lo, hi = median_ci(samples, confidence)
    med = float(np.median(samples))
    return (hi - lo) / 2.0 / med if med > 0 else math.inf


def _interval(boot: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central `confidence` interval of bootstrap replicates (percentile method)."""
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def paired_speedup(
    base: Sequence[float],
    cand: Sequence[float],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """Speed-up of `cand` over `base` from paired (interleaved) samples.

    Point estimate: ratio of medians. CI: bootstrap over rounds, resampling the
    pairs together so the drift that hit both runs of a round stays paired.
    Test: Wilcoxon signed-rank on the per-round log ratios (H0: no difference).
    """
    from scipy import stats  # imported on use: the read-only verbs stay light

    b = np.asarray(base, dtype=float)
    c = np.asarray(cand, dtype=float)
    if len(b) != len(c) or len(b) < 2:
        raise ValueError("base/cand: need the same number (>= 2) of paired samples")
    speedup = float(np.median(b) / np.median(c))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(b), size=(n_boot, len(b)))  # the same rounds for both: pairs kept
    lo, hi = _interval(np.median(b[idx], axis=1) / np.median(c[idx], axis=1), confidence)
    logr = np.log(b / c)
    if np.allclose(logr, 0.0):
        p = 1.0
    else:
        p = float(stats.wilcoxon(logr, zero_method="zsplit").pvalue)
    return {"speedup": speedup, "ci": (lo, hi), "p_value": p}


def fit_power_floor(sizes: Sequence[float], times: Sequence[float]) -> dict:
    """Fit time = floor + c * size**k (the lecture's "flat, then polynomial").

    Fitted in log space so small and large sizes weigh alike. Returns the floor
    (fixed overhead), c, the exponent k, the size where c*size**k equals the
    floor (where work starts to dominate), and R^2 in log space.
    """
    from scipy import optimize  # imported on use: the read-only verbs stay light

    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(n) < 3:
        raise ValueError("sizes: need at least 3 sizes to fit floor + c*size^k")
    if np.any(n <= 0) or np.any(t <= 0):
        raise ValueError("sizes/times: must all be positive to fit in log space")
    # Start from the slope of the two largest points and the smallest time.
    order = np.argsort(n)
    n, t = n[order], t[order]
    k0 = max(0.1, np.log(t[-1] / t[-2]) / np.log(n[-1] / n[-2])) if n[-1] != n[-2] else 1.0
    k0 = min(k0, 4.0)
    c0 = t[-1] / n[-1] ** k0

    def model(logn, floor, logc, k):
        return np.log(floor + np.exp(logc + k * logn))

    if len(np.unique(n)) < 3:
        raise ValueError("sizes: need at least 3 distinct sizes to fit floor + c*size^k")
    floor0 = max(t[0] * 0.5, 1e-12)
    try:
        # scipy warns when it cannot estimate the parameters' covariance: unused here, and a
        # poor fit shows in R^2, which the caller reports
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optimize.OptimizeWarning)
            (floor, logc, k), _ = optimize.curve_fit(
                model,
                np.log(n),
                np.log(t),
                p0=[floor0, np.log(c0), k0],
                bounds=([0.0, -np.inf, 0.0], [np.inf, np.inf, 6.0]),
                maxfev=20000,
            )
    except RuntimeError:  # no convergence: fall back to a pure power law
        k, logc = np.polyfit(np.log(n), np.log(t), 1)
        floor = 0.0
    pred = model(np.log(n), floor, logc, k)
    ss_res = float(np.sum((np.log(t) - pred) ** 2))
    ss_tot = float(np.sum((np.log(t) - np.log(t).mean()) ** 2))
    c = float(np.exp(logc))
    log_knee = (math.log(floor) - logc) / k if floor > 0 and k > 1e-9 else math.inf
    knee = math.exp(log_knee) if log_knee < 700 else None  # None: work never overtakes the floor
    return {
        "floor": float(floor),
        "c": c,
        "exponent": float(k),
        "knee": knee,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
    }


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict:
    """Least-squares line y = a + b*x with its R^2 (scipy.stats.linregress)."""
    from scipy import stats  # imported on use: the read-only verbs stay light

    r = stats.linregress(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    return {"intercept": float(r.intercept), "slope": float(r.slope), "r2": float(r.rvalue**2)}


def independent_ratio(
    a: Sequence[float],
    b: Sequence[float],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """Ratio of medians b/a from two independent sample sets (two runs, two days).

    CI: bootstrap of both sets; test: Mann-Whitney U (no normality assumed).
    """
    from scipy import stats  # imported on use: the read-only verbs stay light

    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if len(x) < 2 or len(y) < 2:
        raise ValueError("a/b: need at least 2 samples on each side")
    rng = np.random.default_rng(seed)
    bx = np.median(x[rng.integers(0, len(x), size=(n_boot, len(x)))], axis=1)
    by = np.median(y[rng.integers(0, len(y), size=(n_boot, len(y)))], axis=1)
    lo, hi = _interval(by / bx, confidence)
    p = float(stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    return {"ratio": float(np.median(y) / np.median(x)), "ci": (lo, hi), "p_value": p}


def runs_ratio(
    a_runs: Sequence[Sequence[float]],
    b_runs: Sequence[Sequence[float]],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """Ratio of medians b/a where the samples come in runs (processes) whose levels differ: the
    CI resamples the runs, then the samples within each run drawn (a hierarchical bootstrap), so
    two runs of one program that disagree widen it, as steps of one run cannot; p: the
    bootstrap's two-sided share of ratios on the other side of 1."""
    a = [np.asarray(r, dtype=float) for r in a_runs if len(r)]
    b = [np.asarray(r, dtype=float) for r in b_runs if len(r)]
    if not a or not b or sum(map(len, a)) < 2 or sum(map(len, b)) < 2:
        raise ValueError("a_runs/b_runs: need at least one run with samples, and 2 samples, on each side")
    rng = np.random.default_rng(seed)

    def medians(runs: list[np.ndarray]) -> np.ndarray:
        out = np.empty(n_boot)
        for i in range(n_boot):
            picked = [runs[j] for j in rng.integers(0, len(runs), size=len(runs))]
            out[i] = np.median(np.concatenate([r[rng.integers(0, len(r), size=len(r))] for r in picked]))
        return out

    boot = medians(b) / medians(a)
    lo, hi = _interval(boot, confidence)
    below = float(np.mean(boot < 1.0))
    p = min(1.0, 2 * min(below, 1.0 - below) + 1.0 / n_boot)
    ratio = float(np.median(np.concatenate(b)) / np.median(np.concatenate(a)))
    return {"ratio": ratio, "ci": (lo, hi), "p_value": p, "runs": (len(a), len(b))}
