"""The stability study's statistics (experiments/stability/README.md, "Decision rules"),
fixed before any run and tested on hand-made curves (tests/test_stability_stages.py):
the collapse detector, bootstrap intervals, the critical learning rate and the
one-sided Fisher exact test. Pure functions of numbers: no runs, files or configs.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

# --------------------------------------------------------------------------
# The collapse detector (README, "Decision rules"; fixed before any run).


def moving_average(x: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    x = np.asarray(x, np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def collapse_step(
    rewards: Sequence[float],
    *,
    window: int = 3,
    frac: float = 0.3,
    patience: int = 5,
    min_peak: float = 0.1,
) -> int | None:
    """Index (into ``rewards``) where a collapse begins, or None.

    With m_t the trailing ``window``-step mean of the training reward and M_t its
    running maximum, the run has collapsed at the first t that starts ``patience``
    consecutive steps with m_t < ``frac`` * M_t, where M_t >= ``min_peak`` (a run
    that never learned has nothing to collapse from). A dip that recovers within
    ``patience`` steps is not a collapse; a streak still running at the end of the
    curve but shorter than ``patience`` is not one either.
    """
    if window < 1 or patience < 1 or not 0 < frac < 1:
        raise ValueError(
            f"window={window}, patience={patience} must be >= 1; frac={frac} in (0, 1)"
        )
    x = np.asarray(rewards, np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise ValueError("rewards: expected a finite 1-D sequence")
    m = moving_average(x, window)
    peak = np.maximum.accumulate(m) if len(m) else m
    low = (m < frac * peak) & (peak >= min_peak)
    run = 0
    for t, is_low in enumerate(low):
        run = run + 1 if is_low else 0
        if run == patience:
            return t - patience + 1
    return None


# --------------------------------------------------------------------------
# Intervals.


def bootstrap_ci(
    samples: Sequence[float],
    statistic: Callable[[np.ndarray], float] = np.mean,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(statistic, lower, upper): the percentile bootstrap interval at ``level``,
    resampling ``samples`` with replacement ``n_boot`` times (a fixed ``seed``, so a
    table is the same every time it is made). One sample gives a zero-width interval."""
    x = np.asarray(samples, np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError("samples: expected a non-empty 1-D sequence")
    est = float(statistic(x))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    stats = np.array([statistic(x[i]) for i in idx], np.float64)
    a = (1.0 - level) / 2.0
    return est, float(np.quantile(stats, a)), float(np.quantile(stats, 1.0 - a))


def bootstrap_diff_ci(a, b, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0):
    """(mean(a) - mean(b), lower, upper): percentile bootstrap interval of the
    difference of means, resampling each group's runs (seeds) independently."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or b.ndim != 1 or not len(a) or not len(b):
        raise ValueError("a, b: expected non-empty 1-D sequences")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), (n_boot, len(a)))
    ib = rng.integers(0, len(b), (n_boot, len(b)))
    d = a[ia].mean(axis=1) - b[ib].mean(axis=1)
    q = (1.0 - level) / 2.0
    return float(a.mean() - b.mean()), float(np.quantile(d, q)), float(np.quantile(d, 1 - q))


def critical_lr(lrs: Sequence[float], collapse_rate: Sequence[float], threshold: float = 0.5):
    """The learning rate at which the collapse rate first reaches ``threshold``,
    interpolated linearly in log(lr) between the two grid points that bracket it.

    ``lrs`` ascending. Returns the smallest lr when the rate is already at the
    threshold there, ``math.inf`` when it never reaches it on the grid (censored:
    the critical rate lies above the grid)."""
    lrs = np.asarray(lrs, np.float64)
    p = np.asarray(collapse_rate, np.float64)
    if lrs.shape != p.shape or lrs.ndim != 1 or len(lrs) == 0:
        raise ValueError("lrs and collapse_rate: expected 1-D sequences of one length")
    if np.any(np.diff(lrs) <= 0):
        raise ValueError("lrs: expected strictly ascending learning rates")
    above = np.nonzero(p >= threshold)[0]
    if len(above) == 0:
        return math.inf
    j = int(above[0])
    if j == 0:
        return float(lrs[0])
    lo, hi = math.log(lrs[j - 1]), math.log(lrs[j])
    w = (threshold - p[j - 1]) / (p[j] - p[j - 1])
    return float(math.exp(lo + w * (hi - lo)))


def critical_lr_ci(
    collapsed: dict[float, Sequence[bool]],
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    threshold: float = 0.5,
) -> tuple[float, float, float]:
    """(critical lr, lower, upper): `critical_lr` of the observed collapse rates and
    its percentile bootstrap interval, resampling the seeds at each learning rate
    independently. ``collapsed`` maps each lr to its runs' collapse flags."""
    lrs = sorted(collapsed)
    flags = [np.asarray(collapsed[lr], np.float64) for lr in lrs]
    if any(len(f) == 0 for f in flags):
        raise ValueError("collapsed: every learning rate needs at least one run")
    est = critical_lr(lrs, [f.mean() for f in flags], threshold)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        rates = [f[rng.integers(0, len(f), len(f))].mean() for f in flags]
        boots.append(critical_lr(lrs, rates, threshold))
    # Order statistics, not interpolation: a bound may be infinite (censored).
    boots = np.sort(np.asarray(boots))
    a = (1.0 - level) / 2.0
    lo = np.quantile(boots, a, method="lower")
    hi = np.quantile(boots, 1.0 - a, method="higher")
    return est, float(lo), float(hi)


def fmt_ci(est: float, lo: float, hi: float, spec: str = ".3f") -> str:
    """``0.412 [0.380, 0.441]``; an infinite bound reads ``> grid``."""

    def one(v):
        return "> grid" if math.isinf(v) else format(v, spec)

    return f"{one(est)} [{one(lo)}, {one(hi)}]"


# --------------------------------------------------------------------------
# Counts: a one-sided Fisher exact test.


def fisher_one_sided(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """P-value of "group a has fewer hits than group b" (one-sided Fisher exact test):
    with the margins fixed, the probability that a holds ``a_hits`` or fewer of the
    ``a_hits + b_hits`` hits, under the hypergeometric distribution.

    >>> round(fisher_one_sided(0, 5, 5, 5) * 252, 9)  # 1 / C(10, 5)
    1.0
    """
    for v, name in ((a_hits, "a_hits"), (a_n, "a_n"), (b_hits, "b_hits"), (b_n, "b_n")):
        if int(v) != v or v < 0:
            raise ValueError(f"{name}={v}: expected a non-negative integer")
    if a_hits > a_n or b_hits > b_n:
        raise ValueError(f"hits exceed runs: {a_hits}/{a_n}, {b_hits}/{b_n}")
    n, k = a_n + b_n, a_hits + b_hits
    total = math.comb(n, a_n)
    lo = max(0, k - b_n)
    return sum(math.comb(k, x) * math.comb(n - k, a_n - x) for x in range(lo, a_hits + 1)) / total
