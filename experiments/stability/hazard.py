"""A training collapse as a time-to-event outcome: each run is a subject, the step of
its collapse the event time, and a run that ended (or was stopped) without collapsing
is right-censored at its last step. The Kaplan-Meier curve with a Greenwood band, the
log-rank test with the Peto hazard ratio, Schoenfeld's event count for a planned
comparison, and the sustained-run helper that collapse definitions share (tested
against scipy.stats and hand-worked examples in tests/test_stability_hazard.py).
Pure functions of numbers: no runs, files or configs.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import stats

# --------------------------------------------------------------------------
# Input checks.


def _survival_data(
    times: Sequence[float], events: Sequence[bool], name: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """(times, events) as float64 and bool arrays, after checking that both are 1-D
    and of one length, the times finite and >= 0 and the events booleans (or 0/1)."""
    t = np.asarray(times, np.float64)
    e = np.asarray(events)
    if t.ndim != 1 or not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"times{name}: expected a 1-D sequence of finite values >= 0")
    if e.ndim != 1 or len(e) != len(t):
        raise ValueError(f"events{name}: expected a 1-D sequence as long as times{name}")
    if e.dtype != bool and not np.all((e == 0) | (e == 1)):
        raise ValueError(f"events{name}: expected booleans (True = event observed)")
    return t, e.astype(bool)


def _in_unit(value: float, name: str) -> float:
    """``value``, after checking that 0 < value < 1 (a ValueError naming ``name``)."""
    if not 0 < value < 1:
        raise ValueError(f"{name}={value}: expected a value in (0, 1)")
    return value


def _z_sum(alpha: float, power: float, share: float) -> float:
    """z_{1 - alpha/2} + z_power, the standard normal quantiles of a two-sided test at
    level ``alpha`` with the given ``power``, after checking the three arguments."""
    _in_unit(share, "share")
    q = stats.norm.ppf
    return float(q(1 - _in_unit(alpha, "alpha") / 2) + q(_in_unit(power, "power")))


# --------------------------------------------------------------------------
# The survival curve.


def kaplan_meier(
    times: Sequence[float], events: Sequence[bool], level: float = 0.95
) -> dict[str, np.ndarray]:
    """The Kaplan-Meier estimate of the survival function (Kaplan & Meier 1958).

    At each distinct event time t_j, with n_j subjects at risk (time >= t_j: a run
    censored at t_j is still at risk at t_j) and d_j events there,
    S(t_j) = prod_{i <= j} (1 - d_i / n_i), the survival just after t_j.
    The pointwise band at ``level`` uses Greenwood's variance on the log(-log) scale
    (Greenwood 1926; Kalbfleisch & Prentice, "The Statistical Analysis of Failure Time
    Data", 2nd ed. 2002):
    with G_j = sum_{i <= j} d_i / (n_i (n_i - d_i)) and z = z_{(1 + level)/2},
    se_j = sqrt(G_j) / |ln S_j|, lower = S_j^exp(z se_j), upper = S_j^exp(-z se_j),
    which stays inside [0, 1]. Where S_j is 0 or 1 the band is S_j itself.

    Returns ``time`` (the distinct event times, ascending), ``at_risk``, ``events``
    (the d_j), ``survival``, ``lower`` and ``upper``; all empty when no event was seen.
    """
    t, e = _survival_data(times, events)
    z = float(stats.norm.ppf(0.5 + _in_unit(level, "level") / 2))
    time = np.unique(t[e])
    at_risk = np.array([np.sum(t >= s) for s in time], np.int64)
    died = np.array([np.sum(e & (t == s)) for s in time], np.int64)
    survival = np.cumprod(1.0 - died / at_risk) if len(time) else np.zeros(0)
    lower, upper = survival.copy(), survival.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        greenwood = np.cumsum(died / (at_risk * (at_risk - died)))
        inside = (survival > 0) & (survival < 1)
        se = np.sqrt(greenwood[inside]) / np.abs(np.log(survival[inside]))
        lower[inside] = survival[inside] ** np.exp(z * se)
        upper[inside] = survival[inside] ** np.exp(-z * se)
    return {
        "time": time,
        "at_risk": at_risk,
        "events": died,
        "survival": survival,
        "lower": lower,
        "upper": upper,
    }


def survival_at(km: dict[str, np.ndarray], t: float) -> float:
    """S(t) from a `kaplan_meier` result: the right-continuous step function,
    S(t) = S(t_j) for the last event time t_j <= t, and 1.0 before the first."""
    j = int(np.searchsorted(km["time"], t, side="right")) - 1
    return 1.0 if j < 0 else float(km["survival"][j])


# --------------------------------------------------------------------------
# Two arms.


def logrank(
    times_a: Sequence[float],
    events_a: Sequence[bool],
    times_b: Sequence[float],
    events_b: Sequence[bool],
) -> dict[str, float]:
    """The log-rank test of arm a against arm b (Mantel 1966; Peto & Peto 1972).

    At each distinct event time t_j of the pooled sample, with n_aj, n_bj at risk
    (n_j = n_aj + n_bj) and d_j = d_aj + d_bj events, the expected events of a are
    E_aj = d_j n_aj / n_j and the hypergeometric variance is
    V_j = d_j (n_aj / n_j)(n_bj / n_j)(n_j - d_j) / (n_j - 1)  (0 when n_j = 1).
    With O_a = sum d_aj, E_a = sum E_aj, V = sum V_j:
    chi2 = (O_a - E_a)^2 / V, p = P(chi2_1 > chi2) (two-sided), and E_b = O_a + O_b - E_a.
    The Peto one-step estimate of the hazard ratio of a against b is
    log_hr = (O_a - E_a) / V with standard error 1 / sqrt(V) (Yusuf, Peto et al. 1985,
    Prog. Cardiovasc. Dis. 27:335; good for hazard ratios near 1, biased away from 1
    for large ones), and ``hr_low``, ``hr_high`` = exp(log_hr -/+ 1.96 / sqrt(V)).

    With no events at all (or no information, V = 0: e.g. one run at risk at each
    event) there is nothing to test: chi2 = 0, p = 1, and log_hr, hr and its bounds are nan.
    """
    ta, ea = _survival_data(times_a, events_a, "_a")
    tb, eb = _survival_data(times_b, events_b, "_b")
    time = np.unique(np.concatenate([ta[ea], tb[eb]]))
    n_a = np.array([np.sum(ta >= s) for s in time], np.float64)
    n_b = np.array([np.sum(tb >= s) for s in time], np.float64)
    d_a = np.array([np.sum(ea & (ta == s)) for s in time], np.float64)
    d_b = np.array([np.sum(eb & (tb == s)) for s in time], np.float64)
    n, d = n_a + n_b, d_a + d_b
    observed_a, observed_b = float(d_a.sum()), float(d_b.sum())
    expected_a = float(np.sum(d * n_a / n)) if len(time) else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        v = d * n_a * n_b * (n - d) / (n**2 * (n - 1))
    variance = float(np.sum(v[n > 1]))
    result = {
        "observed_a": observed_a,
        "expected_a": expected_a,
        "observed_b": observed_b,
        "expected_b": observed_a + observed_b - expected_a,
        "variance": variance,
    }
    if variance <= 0:
        nan = float("nan")
        return result | {
            "chi2": 0.0,
            "p": 1.0,
            "log_hr": nan,
            "hr": nan,
            "hr_low": nan,
            "hr_high": nan,
        }
    chi2 = (observed_a - expected_a) ** 2 / variance
    log_hr = (observed_a - expected_a) / variance
    half = float(stats.norm.ppf(0.975)) / math.sqrt(variance)
    return result | {
        "chi2": chi2,
        "p": float(stats.chi2.sf(chi2, 1)),
        "log_hr": log_hr,
        "hr": math.exp(log_hr),
        "hr_low": math.exp(log_hr - half),
        "hr_high": math.exp(log_hr + half),
    }


# --------------------------------------------------------------------------
# Planning: how many collapses (and runs) a comparison needs.


def schoenfeld_events(
    hr: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5
) -> float:
    """Events a two-sided log-rank test at level ``alpha`` needs to detect hazard
    ratio ``hr`` with probability ``power``, ``share`` of the subjects in one arm
    (Schoenfeld 1983, Biometrika 70:499):
    D = (z_{1 - alpha/2} + z_power)^2 / (share (1 - share) (ln hr)^2).
    hr = 2 at the defaults gives D = 65.35 (66 events)."""
    if not 0 < hr < math.inf or hr == 1:
        raise ValueError(f"hr={hr}: expected a finite hazard ratio > 0 and != 1")
    z = _z_sum(alpha, power, share)
    return z**2 / (share * (1 - share) * math.log(hr) ** 2)


def detectable_hr(
    events: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5
) -> float:
    """The smallest hazard ratio (> 1) that ``events`` events detect, the inverse of
    `schoenfeld_events` (Schoenfeld 1983):
    hr = exp((z_{1 - alpha/2} + z_power) / sqrt(share (1 - share) events)).
    Its reciprocal is the detectable ratio below 1."""
    if not events > 0 or not math.isfinite(events):
        raise ValueError(f"events={events}: expected a finite count > 0")
    z = _z_sum(alpha, power, share)
    return math.exp(z / math.sqrt(share * (1 - share) * events))


def runs_needed(hr: float, event_prob: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Runs in all (both arms, split equally) whose expected number of collapses,
    runs * event_prob, reaches `schoenfeld_events` (Schoenfeld 1983):
    runs = ceil(D / event_prob), where ``event_prob`` is the chance that a run
    collapses within its steps, averaged over the two arms."""
    if not 0 < event_prob <= 1:
        raise ValueError(f"event_prob={event_prob}: expected a probability in (0, 1]")
    return math.ceil(schoenfeld_events(hr, alpha, power, 0.5) / event_prob)


# --------------------------------------------------------------------------
# The helper of collapse definitions.


def first_sustained(flags: Sequence[bool], patience: int) -> int | None:
    """The index where the first run of at least ``patience`` consecutive True values
    of ``flags`` begins, or None (a run still going at the end but shorter than
    ``patience`` does not count). The same rule as `stats.collapse_step`'s streak."""
    if isinstance(patience, bool) or int(patience) != patience or patience < 1:
        raise ValueError(f"patience={patience}: expected an integer >= 1")
    f = np.asarray(flags)
    if f.ndim != 1:
        raise ValueError("flags: expected a 1-D sequence of booleans")
    streak = 0
    for i, flag in enumerate(f.astype(bool)):
        streak = streak + 1 if flag else 0
        if streak == patience:
            return i - patience + 1
    return None
