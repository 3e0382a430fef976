"""Rollout correction (docs/objectives.md, "Rollout correction"): the weight
pi_old / pi_sampler of every mode against an independent float64 NumPy reference, and
the ``weight=`` of every objective.

The reference works in ratio space (np.exp of the log-ratio, overflow to inf allowed)
where the library works in log space, so the two agree only if the library's log-space
truncation and masks are exact. Everything runs in float64 (``jax.enable_x64``) unless a
test says float32.
"""

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import objectives as O
from gspo_jax.metrics import compute_all, reduce_all
from gspo_jax.objectives.correction import MODES, RolloutCorrection, rollout_correction

N, T = 6, 7
LENGTHS = (7, 4, 0, 2, 7, 1)  # row 2 is empty
HOLE = (4, 3)
SETTINGS = [  # (cap, c_low, c_high): bounds on both sides of 1, asymmetric and wide
    (2.0, 2.0, 2.0),
    (1.3, 1.5, 1.2),
    (1.0, 1.0, 1.0),  # C = 1 truncates every r > 1; the mask keeps only r = 1 exactly
]
SEQ_LEVEL = ("gspo", "gmpo", "rspo")


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def make_mask():
    mask = (np.arange(T)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float64)
    mask[HOLE] = 0.0
    return mask


ROW_SHIFT = np.array([1.2, -1.2, 0.0, 0.0, 0.1, -0.3])[:, None]  # sequence ratios on both sides


def make_batch(seed):
    """old_logp and sampler_logp; log-ratios ROW_SHIFT + U(-0.8, 0.8) on valid tokens,
    garbage (NaN, +-inf, huge) on padding."""
    rng = np.random.default_rng(seed)
    mask = make_mask()
    valid = mask > 0
    sampler = rng.uniform(-4.0, -0.1, size=(N, T))
    old = sampler + ROW_SHIFT + rng.uniform(-0.8, 0.8, size=(N, T))
    garbage = rng.choice([np.nan, np.inf, -np.inf, 1e30], size=(N, T))
    return np.where(valid, old, garbage), np.where(valid, sampler, garbage[::-1]), mask


# ------------------------------------------------------------------------------------
# The float64 NumPy reference (docs/objectives.md, "Rollout correction")
# ------------------------------------------------------------------------------------


def reference(old, sampler, mask, mode, cap=2.0, c_low=2.0, c_high=2.0, seq_ratio="geometric"):
    """(weight [N,T], metrics) in float64, in ratio space."""
    valid = mask > 0
    n = valid.sum(1)
    with np.errstate(invalid="ignore"):  # inf - inf on padding
        log_r = np.where(valid, old - sampler, 0.0)
    if mode == "seq_mask":  # as verl's sequence rejection: each token's log r clamped at +-20
        log_r = np.clip(log_r, -20.0, 20.0)
    with np.errstate(over="ignore"):
        if mode.startswith("seq_"):
            total = log_r.sum(1)
            log_rho = total / np.maximum(n, 1) if seq_ratio == "geometric" else total
            ratio, units = np.exp(log_rho), n > 0  # one ratio per sequence
        else:
            ratio, units = np.exp(log_r), valid
    truncated = masked = np.zeros(ratio.shape, bool)
    if mode == "none":
        w = np.ones_like(ratio)
    elif mode.endswith("tis"):
        w, truncated = np.minimum(ratio, cap), ratio > cap
    else:
        keep = (ratio >= 1.0 / c_low) & (ratio <= c_high)
        w, masked = keep.astype(np.float64), ~keep
    weight = np.where(valid, w[:, None] if mode.startswith("seq_") else w, 0.0)
    count = units.sum()
    share = lambda x: np.where(units, x, 0).sum() / count if count else 0.0  # noqa: E731
    metrics = {
        "rc_weight_mean": share(w),
        "rc_weight_max": w[units].max() if count else 0.0,
        "rc_truncated_frac": share(truncated),
        "rc_masked_frac": share(masked),
    }
    return weight, metrics


def run(old, sampler, mask, **rc):
    weight, metrics = rollout_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
                                         RolloutCorrection(**rc))
    return np.asarray(weight), {k: float(v) for k, v in compute_all(metrics).items()}


def check(old, sampler, mask, **rc):
    weight, metrics = run(old, sampler, mask, **rc)
    want_w, want_m = reference(old, sampler, mask, **rc)
    assert np.isfinite(weight).all()
    np.testing.assert_allclose(weight, want_w, rtol=1e-12, atol=0, err_msg=f"{rc}: weight")
    assert set(metrics) == set(want_m)
    for key, value in want_m.items():  # metrics are f32 numbers
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, atol=1e-7, err_msg=f"{rc}: {key}")
    return weight, metrics


# ------------------------------------------------------------------------------------
# The weight of every mode
# ------------------------------------------------------------------------------------

CASES = [dict(mode="none")]
CASES += [dict(mode=m, cap=c, c_low=lo, c_high=hi, seq_ratio=s)
          for m in MODES[1:] for c, lo, hi in SETTINGS for s in ("geometric", "product")
          if m.startswith("seq_") or s == "geometric"]


@pytest.mark.parametrize("rc", CASES, ids=["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_matches_reference(rc):
    old, sampler, mask = make_batch(zlib_seed(rc))
    weight, metrics = check(old, sampler, mask, **rc)
    assert np.all(weight[mask == 0] == 0.0)  # padding (and the empty row 2) weigh 0
    # The batch exercises the mode: some tokens (sequences) are truncated / masked,
    # except where C = 1 meets nothing above it or the mask keeps r = 1 alone.
    if rc["mode"].endswith("tis"):
        assert 0 < metrics["rc_truncated_frac"] < 1 and metrics["rc_masked_frac"] == 0
    elif rc["mode"].endswith("mask"):
        assert metrics["rc_masked_frac"] > 0 and metrics["rc_truncated_frac"] == 0
        if rc["c_low"] > 1:
            assert metrics["rc_masked_frac"] < 1
    else:
        assert metrics == {"rc_weight_mean": 1.0, "rc_weight_max": 1.0, "rc_truncated_frac": 0.0,
                           "rc_masked_frac": 0.0}


def zlib_seed(rc):
    return zlib.crc32(repr(sorted(rc.items())).encode())


def test_hand_values():
    """One row, log-ratios ln 3, ln 0.25, 0 (and padding): every mode by hand."""
    old = np.log([[3.0, 0.25, 1.0, 1.0]])
    sampler = np.zeros((1, 4))
    mask = np.array([[1.0, 1.0, 1.0, 0.0]])
    w = lambda **rc: run(old, sampler, mask, **rc)[0][0]  # noqa: E731
    np.testing.assert_allclose(w(mode="none"), [1, 1, 1, 0])
    np.testing.assert_allclose(w(mode="token_tis"), [2, 0.25, 1, 0], rtol=1e-12)
    np.testing.assert_allclose(w(mode="token_mask"), [0, 0, 1, 0])  # 3 > 2, 0.25 < 1/2
    np.testing.assert_allclose(w(mode="token_mask", c_low=4.0, c_high=3.0), [1, 1, 1, 0])
    # Geometric mean (3 * 0.25 * 1)^(1/3) = 0.9086; product 0.75.
    g = 0.75 ** (1 / 3)
    np.testing.assert_allclose(w(mode="seq_tis"), [g, g, g, 0], rtol=1e-12)
    np.testing.assert_allclose(w(mode="seq_tis", seq_ratio="product"), [0.75] * 3 + [0], rtol=1e-12)
    np.testing.assert_allclose(w(mode="seq_mask", c_low=1.05), [0, 0, 0, 0])  # 0.9086 < 1/1.05
    np.testing.assert_allclose(w(mode="seq_mask", c_low=1.2), [1, 1, 1, 0])
    _, m = run(old, sampler, mask, mode="token_tis")
    assert m["rc_truncated_frac"] == pytest.approx(1 / 3) and m["rc_weight_max"] == 2.0
    np.testing.assert_allclose(m["rc_weight_mean"], (2 + 0.25 + 1) / 3, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_ties_are_kept(mode):
    """A ratio exactly on a bound is neither truncated nor masked (r <= C, and the mask
    interval is closed)."""
    old = np.log([[2.0, 0.5]])
    sampler = np.zeros((1, 2))
    _, m = run(old, sampler, np.ones((1, 2)), mode=mode, seq_ratio="product")
    assert m["rc_truncated_frac"] == 0.0
    if mode == "token_mask":
        assert m["rc_masked_frac"] == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq_ratio", ["geometric", "product"])
def test_extreme_log_ratios_stay_finite(mode, seq_ratio, dtype):
    """A product over a long row (sum of log-ratios +-2000), single tokens at +-300 (exp
    overflows float32 at 88 and float64 at 709), and an empty row: finite weights and
    metrics, equal to the reference."""
    t = 400
    mask = np.ones((5, t))
    mask[4] = 0.0  # empty row
    log_r = np.zeros((5, t))
    log_r[0], log_r[1] = 5.0, -5.0
    log_r[2, 0], log_r[3, 0] = 300.0, -300.0
    sampler = np.full((5, t), -2.0)
    old = sampler + log_r
    old[4] = np.nan  # an empty row may hold anything
    weight, metrics = rollout_correction(jnp.asarray(old, dtype), jnp.asarray(sampler, dtype),
                                         jnp.asarray(mask), RolloutCorrection(mode=mode,
                                                                              seq_ratio=seq_ratio))
    assert weight.dtype == dtype
    weight = np.asarray(weight, np.float64)
    metrics = {k: float(v) for k, v in compute_all(metrics).items()}
    assert np.isfinite(weight).all() and all(np.isfinite(v) for v in metrics.values())
    assert np.all(weight[4] == 0.0)
    want_w, want_m = reference(old, sampler, mask, mode, seq_ratio=seq_ratio)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(weight, want_w, rtol=rtol, atol=1e-30)
    for key, value in want_m.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    if mode == "seq_tis" and seq_ratio == "product":
        np.testing.assert_allclose(weight[0], 2.0)  # e^2000 truncated to C exactly
        assert np.all(weight[1] == 0.0)  # e^-2000 underflows to 0, not NaN


# Rows of log r (NaN: padding) with tokens beyond +-20, where the clamp decides.
CLAMP_ROWS = [
    [30.0, -19.5, 0.0, 0.0],  # clamped sum 0.5 (kept); unclamped 10.5 (masked)
    [-30.0, 19.8, 0.0, np.nan],  # clamped -0.2; unclamped -10.2
    [0.3, -0.1, 0.2, np.nan],  # nothing beyond 20: the clamp changes nothing
    [np.nan] * 4,  # empty row
    [30.0, -25.0, 0.0, 0.0],  # clamped 0 (kept); unclamped 5: verl's seq IS weight is C
    [-np.inf, 19.9, 0.0, np.nan],  # old_logp = -inf: clamped -0.1 (kept); unclamped -inf
    [25.0, 25.0, np.nan, np.nan],  # clamped 40: masked either way
]


def verl_sequence_reference(log_r, mask, c_low, c_high, cap, seq_ratio):
    """verl 0.9.1's sequence options (rollout_corr_helper.py), in NumPy: the rejection keep
    mask of ``seq_mean_k1`` / ``seq_sum_k1`` with threshold "<1/c_high>_<c_low>" (token
    log r clamped at +-SAFETY_BOUND = 20, then k1 = -log r summed or averaged over
    n + 1e-8), and the IS weight of ``rollout_is: sequence`` (the unclamped sum, clamped at
    +-20 only before exp, then truncated at C)."""
    valid = mask > 0
    k1 = -np.clip(np.where(valid, log_r, 0.0), -20.0, 20.0)
    stat = k1.sum(1)
    if seq_ratio == "geometric":
        stat = stat / (valid.sum(1) + 1e-8)
    keep = (stat >= np.log(1.0 / c_high)) & (stat <= np.log(c_low))
    with np.errstate(invalid="ignore"):
        log_rho = np.where(valid, log_r, 0.0).sum(1)
    is_weight = np.minimum(np.exp(np.clip(log_rho, -20.0, 20.0)), cap)
    return np.where(valid, keep[:, None], 0.0), np.where(valid, is_weight[:, None], 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seq_ratio", ["geometric", "product"])
def test_sequence_statistics_clamp_token_log_ratios_as_verl(seq_ratio, dtype):
    """seq_mask clamps each token's log r at +-20 before the sum or mean, as verl's
    sequence rejection does, so a token at +-30 moves the statistic by at most 20; seq_tis
    sums the unclamped log r, as verl's sequence IS weight does. Both against a NumPy
    transcription of verl's code, and the other choice gives a different answer."""
    log_r = np.array(CLAMP_ROWS)
    mask = (~np.isnan(log_r)).astype(np.float64)
    sampler = np.full(log_r.shape, -3.0)
    old = np.where(mask > 0, sampler + np.nan_to_num(log_r, nan=0.0, neginf=-np.inf), 7.0)
    c_low, c_high, cap = 2.0, 2.0, 2.0
    want_mask, want_is = verl_sequence_reference(np.where(mask > 0, old - sampler, 0.0), mask,
                                                 c_low, c_high, cap, seq_ratio)

    def weight(mode):
        w, m = rollout_correction(jnp.asarray(old, dtype), jnp.asarray(sampler, dtype),
                                  jnp.asarray(mask), RolloutCorrection(mode=mode, cap=cap, c_low=c_low,
                                                                       c_high=c_high, seq_ratio=seq_ratio))
        return np.asarray(w, np.float64), {k: float(v) for k, v in compute_all(m).items()}

    got_mask, metrics = weight("seq_mask")
    np.testing.assert_array_equal(got_mask, want_mask)
    np.testing.assert_array_equal(got_mask[:, 0], [1, 1, 1, 0, 1, 1, 0])  # by hand
    assert metrics["rc_masked_frac"] == pytest.approx(1 / 6)  # one of six non-empty rows
    # Unclamped, rows 0, 1, 4 and 5 would be masked: the test can tell the two apart.
    n = mask.sum(1)
    log_rho = np.where(mask > 0, old - sampler, 0.0).sum(1)
    log_rho = log_rho / np.maximum(n, 1) if seq_ratio == "geometric" else log_rho
    unclamped_keep = (log_rho >= -np.log(c_low)) & (log_rho <= np.log(c_high)) & (n > 0)
    np.testing.assert_array_equal(unclamped_keep, [0, 0, 1, 0, 0, 0, 0])

    if seq_ratio == "product":  # verl's sequence IS weight (it has no geometric one)
        got_is, _ = weight("seq_tis")
        # verl floors its weight at e^-20 (row 5); here it is exactly 0 ("Overflow").
        np.testing.assert_allclose(got_is, want_is, rtol=1e-6, atol=np.exp(-20.0))
        assert got_is[4, 0] == cap and got_is[5, 0] == 0.0
        clamped_sum = np.clip(np.where(mask > 0, old - sampler, 0.0), -20, 20).sum(1)
        assert np.exp(clamped_sum[4]) == 1.0  # clamping the tokens would give 1, not C


def test_empty_batch():
    old, sampler, mask = make_batch(0)
    for mode in MODES:
        weight, metrics = run(old, sampler, np.zeros_like(mask), mode=mode)
        assert np.all(weight == 0.0)
        assert metrics == {"rc_weight_mean": 0.0, "rc_weight_max": 0.0, "rc_truncated_frac": 0.0,
                           "rc_masked_frac": 0.0}


@pytest.mark.parametrize("mode", MODES)
def test_metrics_merge_across_micro_batches(mode):
    old, sampler, mask = make_batch(1)
    rc = RolloutCorrection(mode=mode, cap=1.3, c_low=1.5, c_high=1.2)
    parts = [slice(0, 2), slice(2, 4), slice(4, N)]
    per = [rollout_correction(jnp.asarray(old[s]), jnp.asarray(sampler[s]), jnp.asarray(mask[s]), rc)
           for s in parts]
    whole_w, whole_m = rollout_correction(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), rc)
    np.testing.assert_array_equal(np.concatenate([np.asarray(w) for w, _ in per]), whole_w)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[m for _, m in per])
    merged, whole = compute_all(reduce_all(stacked)), compute_all(whole_m)
    chex.assert_trees_all_close(merged, whole, rtol=1e-6)


def test_weight_is_a_constant():
    old, sampler, mask = make_batch(2)
    rc = RolloutCorrection(mode="token_tis")
    g = jax.grad(lambda o, s: rollout_correction(o, s, jnp.asarray(mask), rc)[0].sum(),
                 argnums=(0, 1))(jnp.asarray(np.nan_to_num(old)), jnp.asarray(np.nan_to_num(sampler)))
    assert all(np.all(np.asarray(x) == 0.0) for x in g)


def test_jit_equals_eager():
    old, sampler, mask = make_batch(3)
    rc = RolloutCorrection(mode="seq_mask", c_low=1.2, c_high=1.1, seq_ratio="geometric")
    args = tuple(jnp.asarray(x) for x in (old, sampler, mask))
    eager = rollout_correction(*args, rc)
    jitted = jax.jit(lambda *a: rollout_correction(*a, rc))(*args)
    chex.assert_trees_all_equal(eager, jitted)


# ------------------------------------------------------------------------------------
# The weight in the objectives
# ------------------------------------------------------------------------------------


def objective_batch(seed, name):
    """logp (= old + delta, |delta| <= 0.6), old, advantages, mask, kwargs for ``name``."""
    rng = np.random.default_rng(seed)
    old, _, mask = make_batch(seed)
    old = np.where(mask > 0, old, rng.uniform(-3, -0.1, size=(N, T)))
    logp = old + np.where(mask > 0, rng.uniform(-0.6, 0.6, size=(N, T)), 0.0)
    adv = rng.choice([-1.0, 1.0], size=N) * rng.uniform(0.2, 1.5, size=N)
    kw = {}
    if name == "rspo":
        kw["router_shift"] = jnp.asarray(rng.uniform(0.5, 1.0, size=(N, T)))
    if name == "grpo":  # its default KL term: with a reference, so the term is built
        kw["ref_logp"] = jnp.asarray(logp + rng.uniform(-0.3, 0.3, size=(N, T)))
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), kw


def value_and_grad(name, logp, old, adv, mask, **kw):
    fn = O.get(name)
    (loss, metrics), grad = jax.value_and_grad(lambda x: fn(x, old, adv, mask, **kw),
                                               has_aux=True)(logp)
    return float(loss), np.asarray(grad), metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", O.names())
def test_identical_log_probs_change_nothing(name, mode):
    """old_logp == sampler_logp: every mode gives weight 1 on valid tokens, and each
    objective's loss, gradient and metrics are those without a weight."""
    logp, old, adv, mask, kw = objective_batch(4, name)
    weight, metrics = rollout_correction(old, old, mask, RolloutCorrection(mode=mode))
    weight = np.asarray(weight)
    assert np.all(weight[np.asarray(mask) > 0] == 1.0) and np.all(weight[np.asarray(mask) == 0] == 0)
    metrics = compute_all(metrics)
    assert float(metrics["rc_truncated_frac"]) == 0 and float(metrics["rc_masked_frac"]) == 0
    base_loss, base_grad, base_m = value_and_grad(name, logp, old, adv, mask, **kw)
    loss, grad, m = value_and_grad(name, logp, old, adv, mask, weight=jnp.asarray(weight), **kw)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(grad, base_grad, rtol=1e-13, atol=1e-15)
    chex.assert_trees_all_equal(m, base_m)


def _clipped_loss_numpy(logp, old, adv, mask, weight, ref, eps, beta):
    """PPO's l_t = max(-A r, -A clip(r)) times w_t, seq-mean-token-mean (GRPO), plus the
    unweighted k3 KL term with the same aggregation."""
    valid = mask > 0
    r = np.exp(np.where(valid, logp - old, 0.0))
    a = adv[:, None]
    l_t = np.maximum(-a * r, -a * np.clip(r, 1 - eps, 1 + eps))
    d = ref - logp
    k3 = np.exp(d) - d - 1
    n = valid.sum(1)
    nseq = (n > 0).sum()

    def agg(x):
        return (np.where(valid, x, 0.0).sum(1) / np.maximum(n, 1)).sum() / nseq

    return agg(weight * l_t) + beta * agg(k3)


def _gspo_loss_numpy(logp, old, adv, mask, weight, eps):
    """GSPO's l_i times the mean of w over the sequence's valid tokens, over sequences."""
    valid = mask > 0
    n = valid.sum(1)
    s = np.exp(np.where(valid, logp - old, 0.0).sum(1) / np.maximum(n, 1))
    l_i = np.maximum(-adv * s, -adv * np.clip(s, 1 - eps, 1 + eps))
    w_bar = np.where(valid, weight, 0.0).sum(1) / np.maximum(n, 1)
    return np.where(n > 0, w_bar * l_i, 0.0).sum() / (n > 0).sum()


def _fd_grad(f, x, h=1e-5):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (f(x - 2 * e) - 8 * f(x - e) + 8 * f(x + e) - f(x + 2 * e)) / (12 * h)
    return g


def _away_from_kinks(delta, kinks, margin=1e-3):
    return all(np.all(np.abs(delta - k) > margin) for k in kinks)


@pytest.mark.parametrize("mode", ["token_tis", "token_mask", "seq_tis", "seq_mask"])
def test_weighted_token_level_objective_matches_reference(mode):
    """GRPO (seq-mean-token-mean, k3 KL) with a rollout-correction weight: the weight
    multiplies l_t before aggregation, the denominators (n_i, N_seq) keep masked tokens,
    the KL term is not weighted."""
    logp, old, adv, mask, kw = objective_batch(5, "grpo")
    sampler = old + jnp.asarray(np.random.default_rng(6).uniform(-1.0, 1.0, size=(N, T)))
    weight, _ = rollout_correction(old, sampler, mask, RolloutCorrection(mode=mode, cap=1.5,
                                                                          c_low=1.6, c_high=1.4))
    np_args = [np.asarray(x) for x in (logp, old, adv, mask, weight, kw["ref_logp"])]
    assert 0 < np.asarray(weight)[np.asarray(mask) > 0].mean() < 1.2  # not all ones
    delta = np.where(np_args[3] > 0, np_args[0] - np_args[1], 0.0)
    assert _away_from_kinks(np.exp(delta), [0.8, 1.2])
    loss, grad, _ = value_and_grad("grpo", logp, old, adv, mask, weight=weight, **kw)
    want = _clipped_loss_numpy(*np_args, eps=0.2, beta=0.04)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    f = lambda lp: _clipped_loss_numpy(lp, *np_args[1:], eps=0.2, beta=0.04)  # noqa: E731
    np.testing.assert_allclose(grad, _fd_grad(f, np_args[0]), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", ["token_tis", "token_mask", "seq_tis", "seq_mask"])
def test_weighted_sequence_level_objective_matches_reference(mode):
    """GSPO with a weight: l_i times the mean of w over sequence i's valid tokens."""
    logp, old, adv, mask, kw = objective_batch(7, "gspo")
    sampler = old + jnp.asarray(np.random.default_rng(8).uniform(-1.0, 1.0, size=(N, T)))
    weight, _ = rollout_correction(old, sampler, mask, RolloutCorrection(mode=mode, cap=1.5,
                                                                          c_low=1.6, c_high=1.4))
    eps = 0.05
    np_args = [np.asarray(x) for x in (logp, old, adv, mask, weight)]
    loss, grad, _ = value_and_grad("gspo", logp, old, adv, mask, weight=weight, eps_low=eps,
                                   eps_high=eps)
    want = _gspo_loss_numpy(*np_args, eps=eps)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    f = lambda lp: _gspo_loss_numpy(lp, *np_args[1:], eps=eps)  # noqa: E731
    np.testing.assert_allclose(grad, _fd_grad(f, np_args[0]), rtol=1e-6, atol=1e-9)


def test_masked_token_stays_in_the_denominator():
    """DAPO (token-mean) on 5 tokens, the first weighted 0: the loss is the other four
    tokens' sum over 5, not over 4 (verl's rejection would divide by 4)."""
    old = np.full((2, 3), -1.0)
    logp = old + np.log([[1.1, 0.9, 1.0], [1.05, 0.95, 1.0]])
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = np.array([1.0, -1.0])
    weight = np.where(mask > 0, 1.0, 0.0)
    weight[0, 0] = 0.0
    loss, grad, _ = value_and_grad("dapo", *(jnp.asarray(x) for x in (logp, old, adv, mask)),
                                   weight=jnp.asarray(weight))
    np.testing.assert_allclose(loss, (-0.9 - 1.0 + 1.05 + 0.95) / 5, rtol=1e-12)
    assert grad[0, 0] == 0.0
    np.testing.assert_allclose(grad[0, 1], -0.9 / 5, rtol=1e-12)


@pytest.mark.parametrize("name", O.names())
def test_weight_is_a_constant_in_every_objective(name):
    """A weight computed from logp itself is still a constant: the gradient is that of
    the same weight passed as a fixed array."""
    logp, old, adv, mask, kw = objective_batch(9, name)
    fn = O.get(name)
    make_w = lambda lp: jnp.exp(-jnp.abs(lp - old))  # noqa: E731
    g_traced = jax.grad(lambda lp: fn(lp, old, adv, mask, weight=make_w(lp), **kw)[0])(logp)
    fixed = make_w(logp)
    g_fixed = jax.grad(lambda lp: fn(lp, old, adv, mask, weight=fixed, **kw)[0])(logp)
    np.testing.assert_allclose(g_traced, g_fixed, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", O.names())
def test_weight_on_padding_is_ignored(name):
    """Whatever the weight holds where mask = 0 (NaN, inf), loss and gradient are those of
    a weight that is 0 there."""
    logp, old, adv, mask, kw = objective_batch(10, name)
    w = np.random.default_rng(11).uniform(0.2, 2.0, size=(N, T))
    clean = jnp.asarray(np.where(np.asarray(mask) > 0, w, 0.0))
    dirty = jnp.asarray(np.where(np.asarray(mask) > 0, w, np.nan))
    l1, g1, _ = value_and_grad(name, logp, old, adv, mask, weight=clean, **kw)
    l2, g2, _ = value_and_grad(name, logp, old, adv, mask, weight=dirty, **kw)
    assert np.isfinite(l2) and np.isfinite(g2).all()
    assert l1 == l2
    np.testing.assert_array_equal(g1, g2)


@pytest.mark.parametrize("name", O.names())
def test_weighted_micro_batches_sum_to_whole(name):
    logp, old, adv, mask, kw = objective_batch(12, name)
    weight = jnp.asarray(np.random.default_rng(13).uniform(0.0, 2.0, size=(N, T)))
    fn = O.get(name)
    norm = O.normalizer(mask)

    def loss(lp, rows=slice(None), normalizer=None):
        part = {k: v[rows] for k, v in kw.items()}
        return fn(lp[rows], old[rows], adv[rows], mask[rows], weight=weight[rows],
                  normalizer=normalizer, **part)[0]

    split = lambda lp: loss(lp, slice(0, 3), norm) + loss(lp, slice(3, N), norm)  # noqa: E731
    # Both sides and their gradients in one compiled program (only for speed: op by op,
    # each micro-batch shape compiles every primitive anew).
    both = jax.jit(lambda lp: (split(lp), loss(lp), jax.grad(split)(lp), jax.grad(loss)(lp)))
    split_loss, whole_loss, split_grad, whole_grad = both(logp)
    np.testing.assert_allclose(split_loss, whole_loss, rtol=1e-12)
    np.testing.assert_allclose(split_grad, whole_grad, rtol=1e-12, atol=1e-15)


def test_apply_and_call_accept_weight():
    logp, old, adv, mask, _ = objective_batch(14, "dapo")
    weight = jnp.full((N, T), 0.5)
    fn = O.get("dapo")
    loss_call, _ = fn(logp, old, adv, mask, weight=weight)
    loss_apply, metrics = fn.apply(logp, old, adv, mask, weight=weight)
    base, _ = fn(logp, old, adv, mask)
    np.testing.assert_allclose(loss_call, 0.5 * base, rtol=1e-13)
    assert float(loss_apply) == float(loss_call)
    assert "clip_frac" in compute_all(metrics)


# ------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,field", [
    ({"mode": "tis"}, "mode"),
    ({"mode": None}, "mode"),
    ({"cap": 0.5}, "cap"),
    ({"cap": float("inf")}, "cap"),
    ({"cap": jnp.array(2.0)}, "cap"),  # must be static
    ({"c_low": 0.9}, "c_low"),
    ({"c_high": float("nan")}, "c_high"),
    ({"c_high": "2"}, "c_high"),
    ({"seq_ratio": "mean"}, "seq_ratio"),
])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"rollout_correction: {field}"):
        RolloutCorrection(**kw)


def test_bad_inputs_name_the_argument():
    z = jnp.zeros((3, 4))
    rc = RolloutCorrection(mode="token_tis")
    with pytest.raises(ValueError, match="sampler_logp"):
        rollout_correction(z, jnp.zeros((3, 5)), z, rc)
    with pytest.raises(ValueError, match="mask"):
        rollout_correction(z, z, jnp.zeros((4, 3)), rc)
    with pytest.raises(ValueError, match="old_logp"):
        rollout_correction(jnp.zeros(4), jnp.zeros(4), jnp.zeros(4), rc)
    with pytest.raises(ValueError, match="old_logp"):
        rollout_correction(jnp.zeros((3, 4), jnp.int32), z, z, rc)
    with pytest.raises(ValueError, match="rc"):
        rollout_correction(z, z, z, {"mode": "token_tis"})


@pytest.mark.parametrize("name", O.names())
def test_objective_weight_is_checked(name):
    logp, old, adv, mask, kw = objective_batch(15, name)
    fn = O.get(name)
    with pytest.raises(ValueError, match="weight"):
        fn(logp, old, adv, mask, weight=jnp.ones((N, T + 1)), **kw)
    with pytest.raises(ValueError, match="weight"):
        fn(logp, old, adv, mask, weight=jnp.ones((N, T), jnp.int32), **kw)
    with pytest.raises(ValueError, match="weight"):  # fires under jit too (static shapes)
        jax.jit(lambda w: fn(logp, old, adv, mask, weight=w, **kw)[0])(jnp.ones(N))


def test_config_defaults_are_valid():
    rc = RolloutCorrection()
    assert (rc.mode, rc.cap, rc.c_low, rc.c_high, rc.seq_ratio) == ("none", 2.0, 2.0, 2.0, "geometric")
