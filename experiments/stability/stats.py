"""The stability study's statistics (experiments/stability/README.md, "Decision rules"),
fixed before any run and tested on hand-made curves (tests/test_stability_stages.py):
the collapse detector, bootstrap intervals, the critical learning rate and the
one-sided Fisher exact test, and the one-seed guard of every interval-sign rule
(`sign_verdict`). Pure functions of numbers: no runs, files or configs.
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


# A bootstrap over one seed has an interval of zero width, so every interval-sign rule
# of the stages refuses a verdict from fewer than two seeds.
MIN_SEEDS = 2
ONE_SEED = "no verdict (one seed)"


def sign_verdict(ci, n: int, *, above: str, below: str, neither: str) -> str:
    """``above`` if the interval ``ci`` = (estimate, lower, upper) lies above 0, ``below``
    if it lies below, else ``neither``; `ONE_SEED` when it rests on fewer than
    `MIN_SEEDS` seeds (``n``)."""
    _, lo, hi = ci
    return seeds_allow(above if lo > 0 else (below if hi < 0 else neither), n)


def seeds_allow(verdict: str, n: int) -> str:
    """``verdict``, or `ONE_SEED` when it rests on fewer than `MIN_SEEDS` seeds."""
    return ONE_SEED if n < MIN_SEEDS else verdict


def preliminary(verdict: str, complete: bool) -> bool:
    """Whether a report marks ``verdict`` "(preliminary)": it rests on fewer seeds than
    planned (not ``complete``) and is a verdict (not `ONE_SEED`, not "no runs")."""
    return not complete and verdict not in (ONE_SEED, "no runs")


def seeds_text(n: int) -> str:
    """ "1 seed", "3 seeds"."""
    return f"{n} seed" + ("" if n == 1 else "s")


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


# --------------------------------------------------------------------------
# Stage 5's detector: a collapse that counts only after the policy has learned
# (README, "Stage 5", fixed before any stage-5 run; tests/test_stability_stage5.py).

LEARN_FACTOR = 1.25  # the held-out reward the policy must reach, × its warm start's
LEARN_MIN_GAIN = 0.05  # ... and at least this much above it (a warm start near 0)
EVAL_WINDOW = 2  # evaluations averaged for "learned" (one evaluation is noisy)

# A run's outcome under the rule, one of:
LEARNED_COLLAPSED = "learned, then collapsed"
LEARNED_HELD = "learned, held"
EARLY_COLLAPSE = "collapsed before learning"  # stages 2-3's regime
NEVER_LEARNED = "never learned, no collapse"
OUTCOMES = (LEARNED_COLLAPSED, LEARNED_HELD, EARLY_COLLAPSE, NEVER_LEARNED)


def learned_step(
    eval_rewards: Sequence[float],
    eval_start: float,
    *,
    factor: float = LEARN_FACTOR,
    min_gain: float = LEARN_MIN_GAIN,
    window: int = EVAL_WINDOW,
) -> int | None:
    """Index (into ``eval_rewards``, the run's held-out evaluations in order) of the
    first evaluation at which the trailing ``window``-evaluation mean reaches
    max(``factor`` × ``eval_start``, ``eval_start`` + ``min_gain``), ``eval_start``
    being the warm start's held-out reward; None if it never does. The first
    ``window - 1`` evaluations are averaged over fewer."""
    if not factor > 1 or window < 1 or not min_gain > 0:
        raise ValueError(
            f"factor={factor} must be > 1, min_gain={min_gain} > 0, window={window} >= 1"
        )
    if not (math.isfinite(eval_start) and eval_start >= 0):
        raise ValueError(f"eval_start={eval_start}: expected a held-out reward >= 0")
    x = np.asarray(eval_rewards, np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise ValueError("eval_rewards: expected a finite 1-D sequence")
    target = max(factor * eval_start, eval_start + min_gain)
    hits = np.nonzero(moving_average(x, window) >= target)[0]
    return int(hits[0]) if len(hits) else None


def learned_collapse(
    steps: Sequence[int],
    rewards: Sequence[float],
    eval_steps: Sequence[int],
    eval_rewards: Sequence[float],
    eval_start: float,
    *,
    frac: float = 0.3,
    factor: float = LEARN_FACTOR,
    window: int = 3,
    patience: int = 5,
    min_peak: float = 0.1,
) -> dict:
    """Stage 5's reading of one run (README, "Stage 5", "Detector").

    * *Learned* at RL step ``t_learn``: the first held-out evaluation at which the
      mean of the last two evaluations reaches ``factor`` × the warm start's, and at
      least 0.05 above it (`learned_step`).
    * *Collapsed after learning*: stage 2's detector (`collapse_step`, threshold
      ``frac``) on the training reward from ``t_learn`` on, its running maximum taken
      from ``t_learn`` on, so the peak it falls from is one the learned policy reached.
    * A run that never learned but which stage 2's detector calls collapsed on its
      whole curve is ``EARLY_COLLAPSE`` (the regime of stages 2 and 3); one that
      learned is ``LEARNED_HELD`` unless it collapsed after learning.

    ``steps``/``rewards``: the training reward per RL step; ``eval_steps`` /
    ``eval_rewards``: the held-out evaluations and their RL steps. Returns
    ``dict(outcome, learned_at, collapse_at, peak_eval)`` (RL steps, or None).
    """
    steps = [int(s) for s in steps]
    if len(steps) != len(rewards):
        raise ValueError(f"steps ({len(steps)}) and rewards ({len(rewards)}): unequal lengths")
    if len(eval_steps) != len(eval_rewards):
        raise ValueError(
            f"eval_steps ({len(eval_steps)}) and eval_rewards ({len(eval_rewards)}): "
            "unequal lengths"
        )
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError("steps: expected strictly ascending RL steps")
    kw = dict(frac=frac, window=window, patience=patience, min_peak=min_peak)
    i = learned_step(eval_rewards, eval_start, factor=factor) if len(eval_rewards) else None
    peak = float(np.max(eval_rewards)) if len(eval_rewards) else None
    if i is None:
        early = collapse_step(rewards, **kw) if len(rewards) else None
        return dict(
            outcome=NEVER_LEARNED if early is None else EARLY_COLLAPSE,
            learned_at=None,
            collapse_at=None if early is None else steps[early],
            peak_eval=peak,
        )
    t_learn = int(eval_steps[i])
    start = next((j for j, s in enumerate(steps) if s >= t_learn), len(steps))
    after = collapse_step(rewards[start:], **kw) if start < len(steps) else None
    return dict(
        outcome=LEARNED_HELD if after is None else LEARNED_COLLAPSED,
        learned_at=t_learn,
        collapse_at=None if after is None else steps[start + after],
        peak_eval=peak,
    )
