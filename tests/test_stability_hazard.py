"""experiments/stability/hazard.py: the Kaplan-Meier curve and its Greenwood band, the
log-rank test and the Peto hazard ratio (against hand-worked examples and scipy.stats),
Schoenfeld's event count and its inverses, and the sustained-run helper."""

import math
import warnings

import numpy as np
import pytest
from scipy import stats

from experiments.stability import hazard

# times [1, 2, 2, 3, 4, 5], events [1, 1, 0, 1, 0, 1]; by hand (a run censored at t is at risk at t):
#   t=1: n=6, d=1 -> S = 5/6
#   t=2: n=5, d=1 -> S = 5/6 * 4/5 = 2/3   (the run censored at 2 still counts at 2)
#   t=3: n=3, d=1 -> S = 2/3 * 2/3 = 4/9   (t=4 is censored: no step)
#   t=5: n=1, d=1 -> S = 0
TIMES = [1, 2, 2, 3, 4, 5]
EVENTS = [1, 1, 0, 1, 0, 1]


def _censored(times, events):
    times, events = np.asarray(times, float), np.asarray(events, bool)
    return stats.CensoredData(uncensored=times[events], right=times[~events])


def _sample(rng, n):
    """Integer times (many ties) and about a third censored."""
    return rng.integers(0, 8, n).astype(float), rng.random(n) > 0.35


def test_kaplan_meier_hand_example():
    km = hazard.kaplan_meier(TIMES, EVENTS)
    np.testing.assert_array_equal(km["time"], [1, 2, 3, 5])
    np.testing.assert_array_equal(km["at_risk"], [6, 5, 3, 1])
    np.testing.assert_array_equal(km["events"], [1, 1, 1, 1])
    np.testing.assert_allclose(km["survival"], [5 / 6, 2 / 3, 4 / 9, 0.0], rtol=1e-12)
    # The step function: 1 before the first event, constant between events, 0 after the last.
    assert hazard.survival_at(km, 0.5) == 1.0
    assert hazard.survival_at(km, 1) == pytest.approx(5 / 6)
    assert hazard.survival_at(km, 3.9) == pytest.approx(4 / 9)
    assert hazard.survival_at(km, 4) == pytest.approx(4 / 9)
    assert hazard.survival_at(km, 99) == 0.0
    # At S = 0 the band is S itself; elsewhere it holds S strictly.
    assert km["lower"][-1] == km["upper"][-1] == 0.0
    assert np.all(km["lower"][:-1] < km["survival"][:-1]) and np.all(km["survival"][:-1] < km["upper"][:-1])


def test_greenwood_loglog_band_by_hand():
    km = hazard.kaplan_meier(TIMES, EVENTS, level=0.90)
    # At t=3: Greenwood's sum = 1/(6*5) + 1/(5*4) + 1/(3*2) = 15/60 = 1/4, S = 4/9.
    s, z = 4 / 9, 1.6448536269514722
    se = math.sqrt(1 / 4) / abs(math.log(s))
    assert km["lower"][2] == pytest.approx(s ** math.exp(z * se), rel=1e-10)
    assert km["upper"][2] == pytest.approx(s ** math.exp(-z * se), rel=1e-10)


def test_kaplan_meier_against_scipy():
    rng = np.random.default_rng(0)
    times, events = _sample(rng, 40)
    km = hazard.kaplan_meier(times, events)
    res = stats.ecdf(_censored(times, events))
    np.testing.assert_allclose(km["survival"], res.sf.evaluate(km["time"]), rtol=1e-12)
    # scipy's "exponential Greenwood" band is the same log(-log) band (away from S = 0).
    with warnings.catch_warnings():  # scipy warns of its nan band where S = 0; compared only where S > 0
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = res.sf.confidence_interval(0.95, method="log-log")
    inside = km["survival"] > 0
    t = km["time"][inside]
    np.testing.assert_allclose(km["lower"][inside], ci.low.evaluate(t), rtol=1e-10)
    np.testing.assert_allclose(km["upper"][inside], ci.high.evaluate(t), rtol=1e-10)
    np.testing.assert_allclose(km["survival"], hazard.kaplan_meier(times, events.astype(int))["survival"])


def test_kaplan_meier_all_censored_and_bad_input():
    km = hazard.kaplan_meier([3, 5, 8], [False, False, False])
    assert len(km["time"]) == 0 and len(km["survival"]) == 0 and len(km["lower"]) == 0
    assert hazard.survival_at(km, 100) == 1.0
    for times, events, name in [
        ([1, 2], [True], "events"),
        ([1, -2], [True, True], "times"),
        ([1, np.nan], [True, True], "times"),
        ([[1, 2]], [[True, True]], "times"),
        ([1, 2], [1, 2], "events"),
    ]:
        with pytest.raises(ValueError, match=name):
            hazard.kaplan_meier(times, events)
    with pytest.raises(ValueError, match="level"):
        hazard.kaplan_meier(TIMES, EVENTS, level=1.0)


def test_logrank_hand_example():
    # a: events at 1, 2, censored at 3; b: events at 2, 4. Pooled event times 1, 2, 4:
    #   t=1: n_a=3, n_b=2, d=1 -> E_a = 3/5,     V = 1*3*2*4 / (25*4) = 0.24
    #   t=2: n_a=2, n_b=2, d=2 -> E_a = 2*2/4 = 1, V = 2*2*2*2 / (16*3) = 1/3
    #   t=4: n_a=0, n_b=1, d=1 -> E_a = 0,       V = 0 (one at risk)
    r = hazard.logrank([1, 2, 3], [1, 1, 0], [2, 4], [1, 1])
    assert r["observed_a"] == 2 and r["observed_b"] == 2
    assert r["expected_a"] == pytest.approx(1.6) and r["expected_b"] == pytest.approx(2.4)
    v = 0.24 + 1 / 3
    assert r["variance"] == pytest.approx(v)
    assert r["chi2"] == pytest.approx(0.4**2 / v)
    assert r["log_hr"] == pytest.approx(0.4 / v) and r["hr"] == pytest.approx(math.exp(0.4 / v))
    assert r["hr_low"] == pytest.approx(math.exp(0.4 / v - 1.959963984540054 / math.sqrt(v)))
    assert r["hr_high"] == pytest.approx(math.exp(0.4 / v + 1.959963984540054 / math.sqrt(v)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_logrank_against_scipy(seed):
    rng = np.random.default_rng(seed)
    ta, ea = _sample(rng, 25)
    tb, eb = _sample(rng, 30)
    tb = tb + rng.integers(0, 3, 30)  # b collapses a little later
    r = hazard.logrank(ta, ea, tb, eb)
    ref = stats.logrank(x=_censored(ta, ea), y=_censored(tb, eb))
    # scipy's statistic is the signed z = (O_a - E_a) / sqrt(V): the same sign as log_hr.
    assert r["chi2"] == pytest.approx(ref.statistic**2, rel=1e-10)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert math.copysign(1, r["log_hr"]) == math.copysign(1, ref.statistic)
    assert r["observed_a"] == ea.sum() and r["observed_b"] == eb.sum()


def test_logrank_symmetric_and_degenerate():
    rng = np.random.default_rng(4)
    ta, ea = _sample(rng, 20)
    tb, eb = _sample(rng, 15)
    ab, ba = hazard.logrank(ta, ea, tb, eb), hazard.logrank(tb, eb, ta, ea)
    assert ab["hr"] == pytest.approx(1 / ba["hr"], rel=1e-12)
    assert ab["hr_low"] == pytest.approx(1 / ba["hr_high"], rel=1e-12)
    assert ab["chi2"] == pytest.approx(ba["chi2"]) and ab["p"] == pytest.approx(ba["p"])
    assert ab["observed_a"] == ba["observed_b"] and ab["expected_a"] == pytest.approx(ba["expected_b"])
    # No events: nothing to test.
    none = hazard.logrank([5, 6], [0, 0], [7], [0])
    assert none["chi2"] == 0 and none["p"] == 1
    assert all(math.isnan(none[k]) for k in ("log_hr", "hr", "hr_low", "hr_high"))
    with pytest.raises(ValueError, match="events_b"):
        hazard.logrank([1], [1], [1, 2], [1])


def test_schoenfeld_and_inverses():
    assert math.isclose(hazard.schoenfeld_events(2), 65.35, rel_tol=1e-3)
    # A hazard ratio below 1 needs as many events as its reciprocal; an unequal split more.
    assert hazard.schoenfeld_events(0.5) == pytest.approx(hazard.schoenfeld_events(2))
    assert hazard.schoenfeld_events(2, share=0.3) > hazard.schoenfeld_events(2)
    for hr in (1.5, 2, 3):
        assert hazard.detectable_hr(hazard.schoenfeld_events(hr)) == pytest.approx(hr, rel=1e-12)
        assert hazard.detectable_hr(hazard.schoenfeld_events(hr, 0.01, 0.9, 0.4), 0.01, 0.9, 0.4) == pytest.approx(hr)
    assert hazard.runs_needed(2, 0.5) == 131
    assert hazard.runs_needed(2, 1.0) == 66


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: hazard.schoenfeld_events(1), "hr"),
        (lambda: hazard.schoenfeld_events(-2), "hr"),
        (lambda: hazard.schoenfeld_events(2, alpha=0), "alpha"),
        (lambda: hazard.schoenfeld_events(2, power=1), "power"),
        (lambda: hazard.schoenfeld_events(2, share=1), "share"),
        (lambda: hazard.detectable_hr(0), "events"),
        (lambda: hazard.detectable_hr(50, alpha=1.5), "alpha"),
        (lambda: hazard.runs_needed(2, 0), "event_prob"),
        (lambda: hazard.runs_needed(2, 1.2), "event_prob"),
        (lambda: hazard.runs_needed(1, 0.5), "hr"),
        (lambda: hazard.runs_needed(0, 0.5), "hr"),
        (lambda: hazard.first_sustained([True], 0), "patience"),
        (lambda: hazard.first_sustained([[True]], 1), "flags"),
    ],
)
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_first_sustained():
    F, T = False, True
    assert hazard.first_sustained([F, T, T, F, T, T, T, F], 3) == 4
    assert hazard.first_sustained([T, T, T], 3) == 0
    assert hazard.first_sustained([F, F, T, T], 2) == 2  # a run of exactly patience at the end
    assert hazard.first_sustained([F, T, F, T, T], 3) is None  # the run at the end is too short
    assert hazard.first_sustained([T, T, F, T, T, T, T], 1) == 0
    assert hazard.first_sustained([], 1) is None
    assert hazard.first_sustained(np.array([0, 1, 1, 1]), 2) == 1
