"""Every registered objective against an independent float64 NumPy reference.

The reference below is written from the specification, docs/objectives.md (sections
"Conventions", "Aggregation", "KL to a reference policy", "Clipping", "Objectives",
"Diagnostics"), not from the implementation. Two kinds of tests:

A. Reference: loss value and d loss / d logp of ``O.get(name)`` in float64 against
   the NumPy loss and its finite-difference gradient, at rtol 1e-6, on random
   masked batches (an empty row, a hole in a mask, padding holding garbage values,
   NaN advantages where they meet no valid token, advantages of both signs,
   per-sequence and per-token), for every aggregation mode, every KL estimator,
   dual clip, CISPO without a lower bound, RSPO's router shift, the +-20 clamp,
   micro-batches with a shared normalizer. Metrics are compared too.
B. Learning direction: one gradient-descent step on logp (the log-probs taken as
   free parameters) raises the log-probability of every positive-advantage token
   and lowers that of every negative-advantage one, with the step size the
   spec's gradient formulas give (so a 10x scale error fails as well as a sign
   error). The checkers are themselves tested to reject a sign-flipped or
   rescaled objective.

Tolerances. Everything runs in float64 (``jax.enable_x64``):

* values: rtol 1e-6, atol 1e-12. A float64 evaluation of these ~60-term sums
  agrees with NumPy to ~1e-15; 1e-6 leaves room for any summation order but
  not for a float32 computation when the loss is a difference of O(1) terms.
* gradients: rtol 1e-6, atol 1e-9 * max(1, |loss|). The reference gradient is the
  fourth-order central difference (f(x-2h) - 8f(x-h) + 8f(x+h) - f(x+2h)) / 12h,
  h = 1e-5: truncation ~h^4 = 1e-20, rounding ~1.5 * 2.2e-16 * |f| / h
  ~ 3e-11 |f|, far below both bounds. Inputs keep every ratio at least 1e-3
  (log-ratio 1e-3 for the log-space clips of GMPO/RSPO; GSPO's default bounds are
  only 7e-4 apart, so there the sequence ratio keeps >= 2.5e-4 away) from a clip
  boundary, so the +-2h stencil never straddles a kink. Tokens where the clip
  binds have a locally constant loss, for which the stencil is exactly 0.
* metrics are documented as f32 scalars: rtol 1e-6, atol 1e-7 (a final rounding
  to f32 costs 6e-8 relative).
"""

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import objectives as O

LOG_RATIO_CLIP = 20.0  # docs/objectives.md, "Conventions": delta = clip(logp - old_logp, -20, 20)
VALUE_RTOL, VALUE_ATOL = 1e-6, 1e-12
GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-9
METRIC_RTOL, METRIC_ATOL = 1e-6, 1e-7
FD_STEP = 1e-5
KINK_MARGIN = 1e-3

CLIPPED = ("ppo", "grpo", "dr_grpo", "dapo")  # the token-level clipped surrogate
SEQUENCE_LEVEL = ("gspo", "gmpo", "rspo")
TOKEN_LEVEL = CLIPPED + ("gspo_token", "cispo", "sapo")  # accept agg and A[N,T]
ALL = TOKEN_LEVEL + SEQUENCE_LEVEL

# Defaults the spec fixes (docs/objectives.md, "Objectives"); kl_estimator (k3) and
# norm_len (None) come from ``defaults``.
SPEC_DEFAULTS = {
    "ppo": dict(eps_low=0.2, eps_high=0.2, dual_clip=None, agg="token-mean", kl_coef=0.0),
    "grpo": dict(eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean", kl_coef=0.04,
                 kl_estimator="k3"),
    "dr_grpo": dict(agg="seq-mean-token-sum-norm", kl_coef=0.0),
    "dapo": dict(eps_low=0.2, eps_high=0.28, agg="token-mean", kl_coef=0.0),
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
    "gspo_token": dict(eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"),
    "cispo": dict(eps_low=None, eps_high=0.28, agg="token-mean"),
    "gmpo": dict(eps_low=0.4, eps_high=0.4),
    "rspo": dict(eps_low=0.4, eps_high=0.4),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05, agg="seq-mean-token-mean"),
}

# The batch: N = 7 sequences, T = 8 positions. Row 2 is empty, row 4 has a hole,
# no row fills T (so norm_len=None, "T, the padded length", is distinguishable
# from the longest response).
N, T = 7, 8
LENGTHS = (7, 5, 0, 3, 6, 1, 4)
HOLE = (4, 2)
SEQ_ADV = np.array([1.3, -0.7, np.nan, -1.6, 0.45, -0.25, 0.8])  # row 2 is empty: its A is ignored


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def make_mask():
    mask = (np.arange(T)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float64)
    mask[HOLE] = 0.0
    return mask


# ------------------------------------------------------------------------------------
# The float64 NumPy reference (docs/objectives.md)
# ------------------------------------------------------------------------------------


def _sigmoid(x):
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def _kl_per_token(logp, ref, estimator):
    """docs/objectives.md, "KL to a reference policy": d = ref_logp - logp."""
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return np.exp(d) - d - 1.0
    raise AssertionError(estimator)


def reference_loss(name, hp, logp, old, adv, mask, ref=None, gamma=None, logp_sg=None,
                   normalizer=None):
    """L = -J of objective ``name`` in float64, from docs/objectives.md.

    ``logp_sg`` is the value seen through stop-gradient (GSPO-token's sg(delta_bar) and
    sg(delta_t), CISPO's sg(clipped weight)); it defaults to ``logp``. Differentiating
    with respect to ``logp`` alone while holding ``logp_sg`` fixed is exactly what
    ``jax.lax.stop_gradient`` means. ``normalizer`` = (num_tokens, num_seqs) replaces
    the batch's own denominators ("Aggregation modes": those of the mini-batch).
    """
    logp_sg = logp if logp_sg is None else logp_sg
    valid = mask > 0
    n = mask.sum(1)
    if normalizer is None:
        num_tokens, num_seqs = mask.sum(), float((n > 0).sum())
    else:
        num_tokens, num_seqs = normalizer
    safe_n = np.maximum(n, 1.0)

    def log_ratio(lp):  # masked positions are 0 before any sum
        return np.where(valid, np.clip(lp - old, -LOG_RATIO_CLIP, LOG_RATIO_CLIP), 0.0)

    delta, delta_sg = log_ratio(logp), log_ratio(logp_sg)
    adv_tok = adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], mask.shape)
    adv_tok = np.where(valid, adv_tok, 0.0)

    def agg(per_token, mode):
        per_token = np.where(valid, per_token, 0.0)
        if num_tokens == 0:
            return 0.0
        if mode == "token-mean":
            return per_token.sum() / num_tokens
        if mode == "seq-mean-token-mean":
            return (per_token.sum(1) / safe_n).sum() / num_seqs
        if mode == "seq-mean-token-sum":
            return per_token.sum() / num_seqs
        if mode == "seq-mean-token-sum-norm":
            # "L_norm a constant (the max response length)": norm_len, or with
            # norm_len=None the padded length T (a constant, not max_i n_i).
            norm_len = mask.shape[1] if hp["norm_len"] is None else hp["norm_len"]
            return per_token.sum() / (num_seqs * norm_len)
        raise AssertionError(mode)

    def seq_mean(per_seq):
        if num_tokens == 0:
            return 0.0
        return np.where(n > 0, per_seq, 0.0).sum() / num_seqs

    el, eh = hp.get("eps_low"), hp.get("eps_high")
    if name in CLIPPED:
        r = np.exp(delta)
        loss_t = np.maximum(-adv_tok * r, -adv_tok * np.clip(r, 1 - el, 1 + eh))
        if hp["dual_clip"] is not None:
            loss_t = np.where(adv_tok < 0, np.minimum(loss_t, -adv_tok * hp["dual_clip"]), loss_t)
        loss = agg(loss_t, hp["agg"])
    elif name == "gspo_token":
        # log s_hat = sg(mean delta) + delta_t - sg(delta_t) ("GSPO-token": the path
        # goes through the clamped delta_t, not logp_t - sg(logp_t) as in the paper
        # and the brief; they differ only beyond the +-20 clamp, see "Deviations").
        mean_delta_sg = delta_sg.sum(1) / safe_n
        s_hat = np.exp(mean_delta_sg[:, None] + delta - delta_sg)
        loss_t = np.maximum(-adv_tok * s_hat, -adv_tok * np.clip(s_hat, 1 - el, 1 + eh))
        loss = agg(loss_t, hp["agg"])
    elif name == "cispo":
        lower = -np.inf if el is None else 1 - el
        weight = np.clip(np.exp(delta_sg), lower, 1 + eh)  # sg(clip(r))
        loss = agg(-weight * adv_tok * logp, hp["agg"])
    elif name == "sapo":
        tau = np.where(adv_tok > 0, hp["tau_pos"], hp["tau_neg"])
        gate = (4.0 / tau) * _sigmoid(tau * (np.exp(delta) - 1.0))
        loss = agg(-adv_tok * gate, hp["agg"])
    elif name == "gspo":
        s = np.exp(delta.sum(1) / safe_n)
        loss = seq_mean(np.maximum(-adv * s, -adv * np.clip(s, 1 - el, 1 + eh)))
    elif name in ("gmpo", "rspo"):
        pos = (adv >= 0)[:, None]
        delta_star = np.where(valid, np.where(pos, np.minimum(delta, eh), np.maximum(delta, -el)), 0.0)
        g = np.exp(delta_star.sum(1) / safe_n)
        if name == "rspo":
            # gamma outside the sgn(A) power (docs/objectives.md, "RSPO"), floored at
            # gamma_min; gamma may be 0 on padding.
            gamma = np.maximum(hp["gamma_min"], gamma)
            log_gamma = np.where(valid, np.log(np.where(valid, gamma, 1.0)), 0.0)
            g = g * np.exp(log_gamma.sum(1) / safe_n)
        loss = seq_mean(-adv * g)
    else:
        raise AssertionError(name)

    if hp["kl_coef"] > 0:  # d = ref - logp is not clamped
        kl_agg = "seq-mean-token-mean" if name in SEQUENCE_LEVEL else hp["agg"]
        loss = loss + hp["kl_coef"] * agg(_kl_per_token(logp, ref, hp["kl_estimator"]), kl_agg)
    return float(loss)


def reference_metrics(name, hp, logp, old, adv, mask, gamma=None, ref=None):
    """Metrics as defined in docs/objectives.md, "Diagnostics" (valid tokens only).

    Clip fractions count where the clip *binds*, i.e. removes the token's gradient:
    A > 0 and the ratio above 1+eps_high (high), A < 0 and below 1-eps_low (low), and
    PPO's dual clip; GMPO/RSPO in log space; a token with A = 0 never counts. GSPO's
    token-level fractions count the tokens of clipped sequences. clip_frac is the share
    of tokens clipped on any side; 0 for CISPO (its capped IS weight keeps the gradient:
    is_weight_clip_frac_low/high, A != 0) and SAPO.
    """
    valid = mask > 0
    n = mask.sum(1)
    seqs = n > 0
    ntok, nseq = mask.sum(), float(seqs.sum())
    safe_n = np.maximum(n, 1.0)
    delta = np.where(valid, np.clip(logp - old, -LOG_RATIO_CLIP, LOG_RATIO_CLIP), 0.0)
    r = np.exp(delta)
    adv_tok = adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], mask.shape)
    tok_mean = lambda x: np.where(valid, x, 0.0).sum() / ntok  # noqa: E731
    seq_mean = lambda x: np.where(seqs, x, 0.0).sum() / nseq  # noqa: E731
    frac = lambda b: tok_mean(b.astype(np.float64))  # noqa: E731
    mean_delta = delta.sum(1) / safe_n
    m = {
        "num_tokens": ntok,
        "num_seqs": nseq,
        "ppo_kl": tok_mean(-delta),
        "logratio_std": math.sqrt(tok_mean(delta ** 2) - tok_mean(delta) ** 2),  # ddof 0
        "logratio_abs_max": np.abs(delta).max(),
        # mean over sequences of the within-sequence variance of delta (ddof 0)
        "logratio_seq_var": seq_mean(np.where(valid, (delta - mean_delta[:, None]) ** 2, 0.0).sum(1) / safe_n),
        "frac_ratio_gt_2": frac(np.abs(delta) > math.log(2.0)),  # F(2)
    }
    if hp["kl_coef"] > 0:
        m["kl"] = tok_mean(_kl_per_token(logp, ref, hp["kl_estimator"]))  # without beta
    el, eh = hp.get("eps_low"), hp.get("eps_high")
    if name in CLIPPED:
        high, low = (adv_tok > 0) & (r > 1 + eh), (adv_tok < 0) & (r < 1 - el)
        c = hp["dual_clip"]
        dual = np.zeros_like(high) if c is None else (adv_tok < 0) & (r > c)
        m["clip_frac_high"], m["clip_frac_low"], m["dual_clip_frac"] = frac(high), frac(low), frac(dual)
        m["clip_frac"] = frac(high | low | dual)
    elif name in ("gspo", "gspo_token"):
        s = np.exp(mean_delta)
        m["seq_ratio_mean"] = seq_mean(s)
        if name == "gspo":
            high = seqs & (adv > 0) & (s > 1 + eh)
            low = seqs & (adv < 0) & (s < 1 - el)
            m["seq_clip_frac_high"] = high.sum() / nseq
            m["seq_clip_frac_low"] = low.sum() / nseq
            m["seq_clip_frac"] = (high | low).sum() / nseq
            m["clip_frac_high"] = (high * n).sum() / ntok
            m["clip_frac_low"] = (low * n).sum() / ntok
            m["clip_frac"] = ((high | low) * n).sum() / ntok
        else:
            high = (adv_tok > 0) & (s[:, None] > 1 + eh)
            low = (adv_tok < 0) & (s[:, None] < 1 - el)
            m["clip_frac_high"], m["clip_frac_low"] = frac(high), frac(low)
            m["clip_frac"] = frac(high | low)
    elif name == "cispo":
        lower = -np.inf if el is None else 1 - el
        w = np.clip(r, lower, 1 + eh)
        m["is_weight_mean"] = tok_mean(w)
        m["is_weight_max"] = w[valid].max()
        m["is_weight_clip_frac_high"] = frac((adv_tok != 0) & (r > 1 + eh))
        m["is_weight_clip_frac_low"] = frac((adv_tok != 0) & (r < lower))
        m["clip_frac"] = 0.0
    elif name == "sapo":
        tau = np.where(adv_tok > 0, hp["tau_pos"], hp["tau_neg"])
        p = _sigmoid(tau * (r - 1.0))
        gate = 4 * p * (1 - p)
        m["sapo_gate_mean"] = tok_mean(gate)
        m["sapo_gate_min"] = gate[valid].min()
        m["clip_frac"] = 0.0
    elif name in ("gmpo", "rspo"):
        pos = (adv >= 0)[:, None]  # the loss's branch; A = 0 is never counted as clipped
        high, low = (adv > 0)[:, None] & (delta > eh), (adv < 0)[:, None] & (delta < -el)
        m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"] = frac(high), frac(low), frac(high | low)
        delta_star = np.where(pos, np.minimum(delta, eh), np.maximum(delta, -el))
        g = np.exp(np.where(valid, delta_star, 0.0).sum(1) / safe_n)
        if name == "rspo":
            gamma = np.maximum(hp["gamma_min"], gamma)
            g = g * np.exp(np.where(valid, np.log(np.where(valid, gamma, 1.0)), 0.0).sum(1) / safe_n)
            m["gamma_mean"] = tok_mean(gamma)
            m["gamma_min"] = gamma[valid].min()
        m["seq_ratio_mean"] = seq_mean(g)
    return m


def fd_grad(f, x, h=FD_STEP):
    """Fourth-order central differences of the scalar f at x."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (f(x - 2 * e) - 8 * f(x - e) + 8 * f(x + e) - f(x + 2 * e)) / (12 * h)
    return g


def reference_grad(name, hp, batch, normalizer=None):
    """d loss / d logp with every stop-gradient input held at the base point."""
    b = batch
    f = lambda lp: reference_loss(name, hp, lp, b.old, b.adv, b.mask, b.ref, b.gamma,  # noqa: E731
                                  logp_sg=b.logp, normalizer=normalizer)
    return fd_grad(f, b.logp)


# ------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    logp: np.ndarray
    old: np.ndarray
    adv: np.ndarray
    mask: np.ndarray
    ref: np.ndarray | None = None
    gamma: np.ndarray | None = None


def _kinks(name, hp):
    """Clip boundaries of one token's loss: (ratio-space, log-space)."""
    if name in CLIPPED:
        ratio = [1 - hp["eps_low"], 1 + hp["eps_high"]]
        if hp.get("dual_clip") is not None:
            ratio.append(hp["dual_clip"])
        return ratio, []
    if name == "cispo":
        return [1 + hp["eps_high"]] + ([] if hp["eps_low"] is None else [1 - hp["eps_low"]]), []
    if name in ("gmpo", "rspo"):
        return [], [hp["eps_high"], -hp["eps_low"]]
    return [], []


def _signed(rng, shape, lo=0.1, hi=1.5):
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(lo, hi, size=shape)


def make_batch(name, hp, adv_kind, seed, with_ref=False):
    """Random batch; ratios away from clip kinks, with clipping on both sides.

    Token-level objectives and GMPO/RSPO: i.i.d. log-ratios in [-0.9, 0.9], redrawn
    within KINK_MARGIN of a boundary, plus forced tokens (r = e^0.55 at A > 0,
    e^-0.55 at A < 0, e^0.8 at A < 0 for the dual clip and F(2)). GSPO and
    GSPO-token: per-row targets for the sequence ratio s_i (clipped high at A > 0,
    clipped low at A < 0, outside the range on the side that does not bind, and
    inside), plus zero-mean token noise.
    """
    rng = np.random.default_rng(seed)
    mask = make_mask()
    valid = mask > 0
    old = rng.uniform(-3.0, -0.1, size=(N, T))
    if adv_kind == "token":
        # NaN / inf where A meets no valid token: ignored ("Conventions").
        adv = np.where(valid, _signed(rng, (N, T)), rng.choice([np.nan, np.inf, 7.0], size=(N, T)))
        adv_tok = adv
    else:
        adv = SEQ_ADV.copy()
        adv_tok = np.broadcast_to(adv[:, None], (N, T))
    if name in ("gspo", "gspo_token"):
        el, eh = hp["eps_low"], hp["eps_high"]
        inside = min(el, eh) / 6
        outside = max(2e-3, eh / 2)
        s_target = np.array([1 + eh + outside, 1 - el - outside, 1.0, 1 + eh + outside,
                             1 + inside, 1 - inside, 1 - el - outside])
        noise = np.where(valid, rng.uniform(-0.3, 0.3, size=(N, T)), 0.0)
        noise -= np.where(valid, noise.sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1), 0.0)
        delta = np.log(s_target)[:, None] + noise
    else:
        ratio_kinks, log_kinks = _kinks(name, hp)

        def near_kink(d):
            bad = np.zeros(d.shape, bool)
            for k in ratio_kinks:
                bad |= np.abs(np.exp(d) - k) <= KINK_MARGIN
            for k in log_kinks:
                bad |= np.abs(d - k) <= KINK_MARGIN
            return bad

        delta = rng.uniform(-0.9, 0.9, size=(N, T))
        while near_kink(delta).any():
            delta = np.where(near_kink(delta), rng.uniform(-0.9, 0.9, size=(N, T)), delta)
        pos = np.argwhere(valid & (adv_tok > 0))
        neg = np.argwhere(valid & (adv_tok < 0))
        delta[tuple(pos[0])] = 0.55
        delta[tuple(neg[0])] = -0.55
        delta[tuple(neg[1])] = 0.8
        assert not near_kink(delta).any()
    # Padding holds garbage (the spec masks it before any sum).
    delta = np.where(valid, delta, rng.uniform(-30.0, 30.0, size=(N, T)))
    logp = old + delta
    ref = None
    if with_ref:
        ref = logp + np.where(valid, rng.uniform(-0.5, 0.5, size=(N, T)), rng.uniform(-30, 30, size=(N, T)))
    gamma = None
    if name == "rspo":
        gamma = rng.uniform(0.5, 1.0, size=(N, T))
        gamma[0, 1] = 1.0
        gamma = np.where(valid, gamma, rng.choice([0.0, 0.7], size=(N, T)))  # >= 0 on padding
    return Batch(logp, old, adv, mask, ref, gamma)


def assert_clipping_exercised(name, hp, batch):
    """The batch has tokens (sequences) where each relevant clip binds."""
    m = reference_metrics(name, hp, batch.logp, batch.old, batch.adv, batch.mask, batch.gamma, batch.ref)
    if name == "sapo":
        return
    prefix = "is_weight_" if name == "cispo" else ""
    assert m[prefix + "clip_frac_high"] > 0, m
    if not (name == "cispo" and hp["eps_low"] is None):
        assert m[prefix + "clip_frac_low"] > 0, m
    if name in CLIPPED and hp["dual_clip"] is not None:
        assert m["dual_clip_frac"] > 0, m


# ------------------------------------------------------------------------------------
# Calling the library
# ------------------------------------------------------------------------------------


def call_library(fn, batch, overrides, normalizer=None, compiled=False):
    """(loss, metrics, d loss / d logp) of ``fn`` on float64 arrays; ``compiled``: as one
    ``jax.jit`` program instead of op by op (only for speed, at shapes no other test
    uses, where op by op every primitive compiles anew)."""
    kw = dict(overrides)
    if batch.ref is not None:
        kw["ref_logp"] = jnp.asarray(batch.ref)
    if batch.gamma is not None:
        kw["router_shift"] = jnp.asarray(batch.gamma)
    if normalizer is not None:
        kw["normalizer"] = normalizer
    old, adv, mask = (jnp.asarray(x) for x in (batch.old, batch.adv, batch.mask))

    def f(lp):
        return fn(lp, old, adv, mask, **kw)

    value_and_grad = jax.value_and_grad(f, has_aux=True)
    if compiled:
        value_and_grad = jax.jit(value_and_grad)
    (loss, metrics), grad = value_and_grad(jnp.asarray(batch.logp))
    return loss, metrics, grad


def full_hp(name, overrides):
    hp = dict(O.get(name).defaults)
    hp.update(SPEC_DEFAULTS.get(name, {}))
    hp.update(overrides)
    return hp


def check_against_reference(fn, name, overrides, batch, compare_metrics=True):
    """Raises AssertionError unless fn matches the float64 reference; returns the metrics."""
    hp = full_hp(name, overrides)
    loss, metrics, grad = call_library(fn, batch, overrides)
    want = reference_loss(name, hp, batch.logp, batch.old, batch.adv, batch.mask, batch.ref, batch.gamma)
    np.testing.assert_allclose(float(loss), want, rtol=VALUE_RTOL, atol=VALUE_ATOL,
                               err_msg=f"{name} {overrides}: loss")
    want_grad = reference_grad(name, hp, batch)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL,
                               atol=GRAD_ATOL * max(1.0, abs(want)),
                               err_msg=f"{name} {overrides}: d loss / d logp")
    if compare_metrics:
        want_m = reference_metrics(name, hp, batch.logp, batch.old, batch.adv, batch.mask, batch.gamma,
                                   batch.ref)
        for key, value in want_m.items():
            assert key in metrics, f"{name}: metric {key} missing"
            np.testing.assert_allclose(float(metrics[key]), value, rtol=METRIC_RTOL, atol=METRIC_ATOL,
                                       err_msg=f"{name} {overrides}: metric {key}")
    return metrics


# ------------------------------------------------------------------------------------
# A. Reference cases
# ------------------------------------------------------------------------------------

AGG_CASES = [(mode, None) for mode in O.AGG_MODES] + [("seq-mean-token-sum-norm", 5)]


def _cases():
    """(name, adv_kind, overrides, with_ref)."""
    cases = []
    for name in TOKEN_LEVEL:
        for agg, norm_len in AGG_CASES:
            cases.append((name, "seq", dict(agg=agg, norm_len=norm_len, kl_coef=0.0), False))
            cases.append((name, "token", dict(agg=agg, norm_len=norm_len, kl_coef=0.05,
                                              kl_estimator="k3"), True))
    cases += [
        ("ppo", "token", dict(dual_clip=1.6, kl_coef=0.0), False),
        ("ppo", "seq", dict(dual_clip=1.6, agg="seq-mean-token-mean", kl_coef=0.1,
                            kl_estimator="k1"), True),
        ("ppo", "token", dict(eps_low=0.1, eps_high=0.3, kl_coef=0.1, kl_estimator="k2"), True),
        ("grpo", "seq", dict(kl_coef=0.04, kl_estimator="k1"), True),
        ("grpo", "token", dict(kl_coef=0.3, kl_estimator="k2"), True),
        ("dapo", "seq", dict(kl_coef=0.2, kl_estimator="k2"), True),
        ("cispo", "token", dict(eps_low=0.2, kl_coef=0.0), False),
        ("cispo", "seq", dict(eps_low=0.2, eps_high=0.5, kl_coef=0.05, kl_estimator="k1"), True),
        ("sapo", "token", dict(tau_pos=0.5, tau_neg=2.0, kl_coef=0.0), False),
        ("gspo_token", "token", dict(eps_low=0.1, eps_high=0.15, kl_coef=0.0), False),
        ("gspo_token", "seq", dict(eps_low=0.1, eps_high=0.15, kl_coef=0.05, kl_estimator="k2"), True),
        ("gspo", "seq", dict(kl_coef=0.0), False),
        ("gspo", "seq", dict(kl_coef=0.05, kl_estimator="k3"), True),
        ("gspo", "seq", dict(eps_low=0.1, eps_high=0.15, kl_coef=0.05, kl_estimator="k1"), True),
        ("gspo", "seq", dict(eps_low=0.1, eps_high=0.15, kl_coef=0.2, kl_estimator="k2"), True),
        ("gmpo", "seq", dict(kl_coef=0.0), False),
        ("gmpo", "seq", dict(kl_coef=0.05, kl_estimator="k3"), True),
        ("gmpo", "seq", dict(eps_low=0.2, eps_high=0.3, kl_coef=0.1, kl_estimator="k2"), True),
        ("rspo", "seq", dict(kl_coef=0.0), False),
        ("rspo", "seq", dict(kl_coef=0.05, kl_estimator="k3"), True),
        ("rspo", "seq", dict(eps_low=0.2, eps_high=0.3, kl_coef=0.1, kl_estimator="k1"), True),
        ("rspo", "seq", dict(gamma_min=0.8), False),  # the floor binds on some tokens
    ]
    return cases


CASES = _cases()


def _case_id(case):
    name, adv_kind, overrides, _ = case
    return "-".join([name, "A" + adv_kind] + [f"{k}={v}" for k, v in overrides.items()])


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def test_every_objective_and_mode_is_covered():
    assert set(O.names()) == set(ALL)
    assert set(O.AGG_MODES) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                "seq-mean-token-sum-norm"}
    for name in ALL:
        kls = {c[2].get("kl_estimator") for c in CASES if c[0] == name and c[2].get("kl_coef", 0) > 0}
        assert "k3" in kls, name
    assert {c[2].get("kl_estimator") for c in CASES if c[2].get("kl_coef", 0) > 0} >= {"k1", "k2", "k3"}


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(case):
    name, adv_kind, overrides, with_ref = case
    hp = full_hp(name, overrides)
    batch = make_batch(name, hp, adv_kind, _seed(case), with_ref=with_ref)
    assert_clipping_exercised(name, hp, batch)
    check_against_reference(O.get(name), name, overrides, batch)


@pytest.mark.parametrize("name", ALL)
def test_defaults_match_reference(name):
    """Called with no hyperparameters, each objective is the spec's default."""
    hp = full_hp(name, {})
    batch = make_batch(name, hp, "seq", _seed("defaults", name), with_ref=hp["kl_coef"] > 0)
    check_against_reference(O.get(name), name, {}, batch)


@pytest.mark.parametrize("name", ALL)
def test_extreme_log_ratios_are_clipped_at_20(name):
    """|logp - old_logp| = 25 on valid tokens: delta is clipped to +-20 (docs/objectives.md, "Inputs")."""
    overrides = dict(kl_coef=0.0)
    hp = full_hp(name, overrides)
    batch = make_batch(name, hp, "seq", _seed("extreme", name))
    batch.logp[0, 2] = batch.old[0, 2] + 25.0  # A > 0
    batch.logp[1, 1] = batch.old[1, 1] - 25.0  # A < 0
    if name in SEQUENCE_LEVEL + ("gspo_token",):
        # A < 0 and a ratio above every bound, so nothing binds: s_i, g_i, S_i take
        # delta = 20, the token itself gets no gradient (GSPO-token: path delta_t).
        batch.logp[3, 0] = batch.old[3, 0] + 25.0
    metrics = check_against_reference(O.get(name), name, overrides, batch)
    np.testing.assert_allclose(float(metrics["logratio_abs_max"]), LOG_RATIO_CLIP, rtol=METRIC_RTOL)


@pytest.mark.parametrize("name", ALL)
def test_micro_batches_with_the_mini_batch_normalizer(name):
    """Rows split in two, each with the whole batch's denominators: the losses and
    gradients add up to the reference of the whole batch ("Aggregation modes")."""
    adv_kind = "seq" if name in SEQUENCE_LEVEL else "token"
    overrides = dict(kl_coef=0.05, kl_estimator="k3")
    hp = full_hp(name, overrides)
    batch = make_batch(name, hp, adv_kind, _seed("micro", name), with_ref=True)
    norm = O.normalizer(jnp.asarray(batch.mask))
    np.testing.assert_allclose([float(norm.num_tokens), float(norm.num_seqs)],
                               [batch.mask.sum(), (batch.mask.sum(1) > 0).sum()], rtol=0)
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, N)):
        part = Batch(*(None if x is None else x[rows] for x in dataclasses.astuple(batch)))
        loss, _, grad = call_library(O.get(name), part, overrides, normalizer=norm, compiled=True)
        total += float(loss)
        grads.append(np.asarray(grad))
    want = reference_loss(name, hp, batch.logp, batch.old, batch.adv, batch.mask, batch.ref, batch.gamma)
    np.testing.assert_allclose(total, want, rtol=VALUE_RTOL, atol=VALUE_ATOL)
    np.testing.assert_allclose(np.concatenate(grads), reference_grad(name, hp, batch),
                               rtol=GRAD_RTOL, atol=GRAD_ATOL * max(1.0, abs(want)))


@pytest.mark.parametrize("name", ALL)
def test_all_masked_batch_gives_exactly_zero(name):
    overrides = dict(kl_coef=0.05, kl_estimator="k3")
    batch = make_batch(name, full_hp(name, overrides), "seq", _seed("empty", name), with_ref=True)
    batch.mask[:] = 0.0
    loss, metrics, grad = call_library(O.get(name), batch, overrides)
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    # "Diagnostics": an empty batch gives 0 for means and counts, max 0, min 1.
    for key, value in metrics.items():
        want = 1.0 if key in ("sapo_gate_min", "gamma_min") else 0.0
        assert float(value) == want, (key, float(value))


@pytest.mark.parametrize("name", ALL)
def test_computes_in_float64(name):
    """float64 in, float64 out, and float64 inside: a loss that is a difference of
    two O(1) terms 2e-8 apart (logp - old_logp = +-1e-8, below float32 resolution
    of logp ~ -1.3) must come out right to 1e-6 relative."""
    mask = np.ones((2, 3))
    old = np.full((2, 3), -1.3)
    logp = old + np.array([[1e-8], [-1e-8]])
    adv = np.array([1.0, -1.0])
    overrides = dict(kl_coef=0.0)
    if name == "sapo":
        overrides.update(tau_pos=1.0, tau_neg=1.0)  # equal gates, so the two rows cancel
    gamma = np.ones((2, 3)) if name == "rspo" else None
    batch = Batch(logp, old, adv, mask, None, gamma)
    loss, _, grad = call_library(O.get(name), batch, overrides, compiled=True)
    assert loss.dtype == jnp.float64, f"{name}: loss is {loss.dtype} for float64 inputs"
    assert grad.dtype == jnp.float64, f"{name}: gradient is {grad.dtype} for float64 inputs"
    want = reference_loss(name, full_hp(name, overrides), logp, old, adv, mask, gamma=gamma)
    assert abs(want) > 1e-9  # the cancellation leaves something to get right
    np.testing.assert_allclose(float(loss), want, rtol=VALUE_RTOL, atol=0,
                               err_msg=f"{name}: not computed in float64")


# ------------------------------------------------------------------------------------
# B. Learning direction
# ------------------------------------------------------------------------------------

LR = 0.1


def direction_batch(name, point):
    """On-policy (logp == old_logp) or slightly off-policy (|delta| < 0.05, sequence
    means within 1e-4, inside every clip range including GSPO's default one)."""
    rng = np.random.default_rng(_seed("direction", name, point))
    mask = make_mask()
    valid = mask > 0
    old = rng.uniform(-3.0, -0.1, size=(N, T))
    adv = SEQ_ADV.copy() if name in SEQUENCE_LEVEL else _signed(rng, (N, T))
    delta = np.zeros((N, T))
    if point == "off":
        noise = np.where(valid, rng.uniform(-0.04, 0.04, size=(N, T)), 0.0)
        noise -= np.where(valid, noise.sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1), 0.0)
        delta = rng.uniform(-1e-4, 1e-4, size=(N, 1)) + noise
    gamma = None
    if name == "rspo":
        gamma = np.where(valid, rng.uniform(0.6, 1.0, size=(N, T)), 0.0)
        gamma[0] = np.where(valid[0], 1.0, 0.0)  # gamma = 1 on one row
    return Batch(old + np.where(valid, delta, 0.0), old, adv, mask, None, gamma)


def analytic_grad(name, batch):
    """d loss / d logp from the gradient formulas of docs/objectives.md, where no clip binds.

    Per-token objectives: -A * w_t * (aggregation weight), with w_t = r (clipped
    surrogate, "elsewhere it is -A r grad logp"), the clipped IS weight = r (CISPO),
    4 p (1 - p) r (SAPO), s_i (GSPO-token). Sequence-level: -A_i * X_i / (n_i * num_seqs)
    with X_i = s_i (GSPO), g_i (GMPO), S_i (RSPO). At r = 1 every w is 1.
    """
    hp = full_hp(name, {})
    b = batch
    valid = b.mask > 0
    n = b.mask.sum(1)
    ntok, nseq = b.mask.sum(), (n > 0).sum()
    safe_n = np.maximum(n, 1.0)[:, None]
    delta = np.where(valid, b.logp - b.old, 0.0)
    r = np.exp(delta)
    if name in SEQUENCE_LEVEL:
        x = np.exp(delta.sum(1, keepdims=True) / safe_n)  # no clip binds: delta* = delta
        if name == "rspo":
            log_gamma = np.where(valid, np.log(np.where(valid, b.gamma, 1.0)), 0.0)
            x = x * np.exp(log_gamma.sum(1, keepdims=True) / safe_n)
        return np.where(valid, -b.adv[:, None] * x / (safe_n * nseq), 0.0)
    if name in CLIPPED or name == "cispo":
        w = r
    elif name == "sapo":
        tau = np.where(b.adv > 0, hp["tau_pos"], hp["tau_neg"])
        p = _sigmoid(tau * (r - 1.0))
        w = 4 * p * (1 - p) * r
    elif name == "gspo_token":
        w = np.broadcast_to(np.exp(delta.sum(1, keepdims=True) / safe_n), delta.shape)
    agg = hp["agg"]
    if agg == "token-mean":
        weight = 1.0 / ntok
    elif agg == "seq-mean-token-mean":
        weight = 1.0 / (safe_n * nseq)
    elif agg == "seq-mean-token-sum":
        weight = 1.0 / nseq
    else:
        weight = 1.0 / (nseq * (T if hp["norm_len"] is None else hp["norm_len"]))
    return np.where(valid, -b.adv * w * weight, 0.0)


def check_learning_direction(fn, name, point):
    """One descent step logp <- logp - LR * grad; raises AssertionError unless it moves
    every valid token in the direction of its advantage by the spec's amount."""
    batch = direction_batch(name, point)
    valid = batch.mask > 0
    overrides = dict(kl_coef=0.0)
    loss, _, grad = call_library(fn, batch, overrides)
    grad = np.asarray(grad)
    step = -LR * grad
    adv_tok = np.broadcast_to(batch.adv[:, None], grad.shape) if batch.adv.ndim == 1 else batch.adv
    assert np.all(step[~valid] == 0.0), f"{name}: padding moved"
    assert np.all(np.sign(step[valid]) == np.sign(adv_tok[valid])), (
        f"{name} ({point}): a step does not raise logp where A > 0 / lower it where A < 0:\n"
        f"step={step}\nA={adv_tok}")
    np.testing.assert_allclose(grad, analytic_grad(name, batch), rtol=1e-6, atol=0,
                               err_msg=f"{name} ({point}): gradient size differs from the spec's")
    # And the step lowers the loss. Not for CISPO: its loss -sg(w) A logp is a
    # REINFORCE surrogate whose value depends on logp itself (not only on the
    # ratio) and whose weight w is re-evaluated at the new point, so its value need
    # not fall; the sign and size checks above are its learning-direction test.
    if name != "cispo":
        kw = dict(overrides) if batch.gamma is None else dict(overrides, router_shift=jnp.asarray(batch.gamma))
        new_loss, _ = fn(jnp.asarray(batch.logp + step), jnp.asarray(batch.old), jnp.asarray(batch.adv),
                         jnp.asarray(batch.mask), **kw)
        assert float(new_loss) < float(loss), f"{name}: the step did not lower the loss"


@pytest.mark.parametrize("point", ["on", "off"])
@pytest.mark.parametrize("name", ALL)
def test_learning_direction(name, point):
    check_learning_direction(O.get(name), name, point)


def _broken(fn, transform):
    def wrapped(*args, **kwargs):
        loss, metrics = fn(*args, **kwargs)
        return transform(loss), metrics
    return wrapped


BREAKAGES = {"sign_flip": lambda loss: -loss, "scale_10x": lambda loss: 10.0 * loss}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
@pytest.mark.parametrize("name", ALL)
def test_direction_check_rejects_a_broken_objective(name, breakage):
    with pytest.raises(AssertionError):
        check_learning_direction(_broken(O.get(name), BREAKAGES[breakage]), name, "on")


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
@pytest.mark.parametrize("name", ALL)
def test_reference_check_rejects_a_broken_objective(name, breakage):
    overrides = dict(kl_coef=0.0)
    hp = full_hp(name, overrides)
    batch = make_batch(name, hp, "seq", _seed("broken", name))
    with pytest.raises(AssertionError):
        check_against_reference(_broken(O.get(name), BREAKAGES[breakage]), name, overrides, batch,
                                compare_metrics=False)
