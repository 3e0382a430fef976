"""Tests of gspo_jax.objectives: hand-computed values, gradient facts, robustness.

Expected values are written out from objectives.md with literal numbers (numpy only
for log / exp / sqrt); no expectation is drawn from a JAX RNG.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from gspo_jax import objectives as O
from gspo_jax.metrics import compute_all, reduce_all

OLD = -1.0  # old_logp on every position; logp = OLD + log r

# The hand batch: three sequences, T = 4.
#   seq0: r = [1.5, 0.5, 1.1, pad],  A = +1
#   seq1: r = [0.7, 1.3, pad, pad],  A = -2
#   seq2: all padding,               A = +5 (must contribute nothing anywhere)
RATIOS = np.array([[1.5, 0.5, 1.1, 1.0], [0.7, 1.3, 1.0, 1.0], [3.0, 0.2, 1.0, 1.0]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
ADV = np.array([1.0, -2.0, 5.0], np.float32)
GAMMA = np.array([[0.5, 1.0, 0.8, 0.1], [1.0, 0.6, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]], np.float32)


def hand_batch():
    old = np.full(RATIOS.shape, OLD, np.float32)
    logp = (old + np.log(RATIOS)).astype(np.float32)
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ADV), jnp.asarray(MASK)


def extra_kwargs(name, shape, gamma=None):
    if name == "rspo":
        return {"router_shift": jnp.asarray(GAMMA if gamma is None else gamma)}
    if name == "grpo":
        return {"kl_coef": 0.0}
    return {}


def loss_fn(name, old, adv, mask, **kw):
    fn = O.get(name)
    return lambda lp: fn(lp, old, adv, mask, **kw)[0]


def grad_of(name, logp, old, adv, mask, **kw):
    return np.asarray(jax.grad(loss_fn(name, old, adv, mask, **kw))(logp))


ARRAY_KWARGS = ("router_shift", "ref_logp", "normalizer", "weight")


@functools.cache
def _program(name, hp):
    fn = O.get(name)

    def run(lp, old, adv, mask, arrays):
        return jax.value_and_grad(lambda x: fn(x, old, adv, mask, **arrays, **dict(hp)),
                                  has_aux=True)(lp)

    return jax.jit(run)


def compiled(name, logp, old, adv, mask, **kw):
    """(loss, metrics, d loss / d logp) of objective ``name`` as one compiled program,
    reused for every call with the same hyperparameters and shapes. Only for speed, where
    a test evaluates an objective at shapes no other test uses, or many times: op by op,
    each new shape compiles every primitive anew (test_jit_equals_eager holds the two
    equal)."""
    arrays = {k: v for k, v in kw.items() if k in ARRAY_KWARGS}
    hp = tuple(sorted((k, v) for k, v in kw.items() if k not in ARRAY_KWARGS))
    (loss, metrics), g = _program(name, hp)(logp, old, adv, mask, arrays)
    return loss, metrics, np.asarray(g)


# ------------------------------------------------------------------------------------
# Registry and API
# ------------------------------------------------------------------------------------


def test_names():
    assert set(O.names()) == {"ppo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token",
                              "cispo", "gmpo", "rspo", "sapo"}


def test_defaults_match_design():
    assert O.get("grpo").defaults == {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
                                      "kl_coef": 0.04, "kl_estimator": "k3",
                                      "agg": "seq-mean-token-mean", "norm_len": None}
    assert O.get("dr_grpo").defaults["agg"] == "seq-mean-token-sum-norm"
    assert O.get("dr_grpo").defaults["kl_coef"] == 0.0
    d = O.get("dapo").defaults
    assert (d["eps_low"], d["eps_high"], d["agg"], d["kl_coef"]) == (0.2, 0.28, "token-mean", 0.0)
    d = O.get("gspo").defaults
    assert (d["eps_low"], d["eps_high"]) == (3e-4, 4e-4) and "agg" not in d
    assert O.get("cispo").defaults["eps_low"] is None
    assert O.get("cispo").defaults["agg"] == "token-mean"
    assert (O.get("gmpo").defaults["eps_low"], O.get("gmpo").defaults["eps_high"]) == (0.4, 0.4)
    d = O.get("sapo").defaults
    assert (d["tau_pos"], d["tau_neg"], d["agg"]) == (1.0, 1.05, "seq-mean-token-mean")
    assert O.get("gspo_token").defaults["agg"] == "seq-mean-token-mean"


# ------------------------------------------------------------------------------------
# Hand-computed values
# ------------------------------------------------------------------------------------

# PPO per-token losses of the hand batch, eps 0.2 / 0.2:
#   seq0 (A=+1): max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; -1.1   -> sum -2.8, n=3
#   seq1 (A=-2): max(1.4, 1.6) = 1.6;    max(2.6, 2.4) = 2.6           -> sum  4.2, n=2
PPO_EXPECTED = {
    "token-mean": (-2.8 + 4.2) / 5,
    "seq-mean-token-mean": (-2.8 / 3 + 4.2 / 2) / 2,
    "seq-mean-token-sum": (-2.8 + 4.2) / 2,
    "seq-mean-token-sum-norm": (-2.8 + 4.2) / (2 * 4),
}


@pytest.mark.parametrize("agg", O.AGG_MODES)
@pytest.mark.parametrize("name", ["ppo", "grpo", "dr_grpo"])
def test_clipped_surrogate_hand_values(name, agg):
    lp, old, adv, mask = hand_batch()
    loss, m = O.get(name)(lp, old, adv, mask, agg=agg, kl_coef=0.0)
    np.testing.assert_allclose(loss, PPO_EXPECTED[agg], rtol=1e-6)
    # One clipped-high token (seq0 r=1.5), one clipped-low (seq1 r=0.7), of 5.
    np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"]],
                               [0.2, 0.2, 0.4], rtol=1e-6)
    assert m["num_tokens"] == 5 and m["num_seqs"] == 2


def test_norm_len_is_the_constant_in_the_denominator():
    lp, old, adv, mask = hand_batch()
    loss, _ = O.get("dr_grpo")(lp, old, adv, mask, norm_len=10)
    np.testing.assert_allclose(loss, 1.4 / (2 * 10), rtol=1e-6)


def test_dapo_hand_value():
    # eps_high 0.28: seq0 r=1.5 clips to 1.28 -> -1.28; -0.5; -1.1; seq1 as PPO (4.2).
    lp, old, adv, mask = hand_batch()
    loss, m = O.get("dapo")(lp, old, adv, mask)
    np.testing.assert_allclose(loss, (-1.28 - 0.5 - 1.1 + 4.2) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 0.2, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 0.4, rtol=1e-6)  # and seq1's r = 0.7 < 0.8


def test_dual_clip_hand_value():
    # c = 1.25: seq1 r=1.3 with A=-2: min(2.6, 2*1.25) = 2.5 -> seq1 sum 4.1.
    lp, old, adv, mask = hand_batch()
    loss, m = O.get("ppo")(lp, old, adv, mask, dual_clip=1.25)
    np.testing.assert_allclose(loss, (-2.8 + 1.6 + 2.5) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["dual_clip_frac"], 0.2, rtol=1e-6)
    # Three of 5 tokens lose their gradient: r=1.5 (high), r=0.7 (low), r=1.3 (dual).
    np.testing.assert_allclose(m["clip_frac"], 0.6, rtol=1e-6)
    g = grad_of("ppo", lp, old, adv, mask, dual_clip=1.25)
    assert g[1, 1] == 0.0  # dual-clipped; a bug that ignores the dual clip gives 2*1.3/5


def test_grpo_kl_k3_hand_value():
    lp, old, adv, mask = hand_batch()
    ref = lp + 0.5  # d = ref - logp = 0.5 on every token -> k3 = e^0.5 - 1.5
    loss, m = O.get("grpo")(lp, old, adv, mask, ref_logp=ref)
    k3 = math.exp(0.5) - 1.5
    np.testing.assert_allclose(loss, PPO_EXPECTED["seq-mean-token-mean"] + 0.04 * k3, rtol=1e-6)
    np.testing.assert_allclose(m["kl"], k3, rtol=1e-6)


@pytest.mark.parametrize("name,agg", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean"),
                                      ("dr_grpo", "seq-mean-token-sum-norm"),
                                      ("gspo", "seq-mean-token-mean"), ("rspo", "seq-mean-token-mean"),
                                      ("sapo", "seq-mean-token-sum")])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_term_value_and_gradient_equal_the_plain_formula(name, agg, kind):
    """The KL part shares the policy term's gradient pass; it must add exactly
    kl_coef * agg(k(ref - logp)) and its autodiff gradient, for every estimator."""
    lp, old, adv, mask = hand_batch()
    ref = old + jnp.asarray(np.random.RandomState(3).normal(0, 0.4, lp.shape).astype(np.float32))
    coef = 0.3
    kw = dict(extra_kwargs(name, lp.shape), ref_logp=ref)
    if name not in ("gspo", "rspo"):
        kw["agg"] = agg
    kw.pop("kl_coef", None)
    fn = O.get(name)
    m = np.asarray(MASK)
    n = m.sum(1)
    seqs = max((n > 0).sum(), 1)
    weights = {"token-mean": np.full(3, 1 / m.sum()),
               "seq-mean-token-mean": 1 / np.maximum(n, 1) / seqs,
               "seq-mean-token-sum": np.full(3, 1 / seqs),
               "seq-mean-token-sum-norm": np.full(3, 1 / (seqs * lp.shape[1]))}[agg]

    def plain_kl(lp_):
        k = jnp.where(mask > 0, O.kl(lp_, ref, kind), 0.0)
        return jnp.sum(jnp.asarray(weights, jnp.float32) * jnp.sum(mask * k, axis=-1))

    def with_kl(lp_):
        return fn(lp_, old, adv, mask, kl_coef=coef, kl_estimator=kind, **kw)[0]

    def without(lp_):
        return fn(lp_, old, adv, mask, kl_coef=0.0, kl_estimator=kind, **kw)[0]

    np.testing.assert_allclose(with_kl(lp) - without(lp), coef * plain_kl(lp), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.grad(with_kl)(lp) - jax.grad(without)(lp),
                               coef * jax.grad(plain_kl)(lp), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind,expected", [("k1", [-0.5, 0.3]), ("k2", [0.125, 0.045]),
                                           ("k3", [math.exp(0.5) - 1.5, math.exp(-0.3) - 0.7])])
def test_kl_estimators(kind, expected):
    logp = jnp.array([-1.0, -2.0])
    ref = jnp.array([-0.5, -2.3])  # d = [0.5, -0.3]
    np.testing.assert_allclose(O.kl(logp, ref, kind), expected, rtol=1e-6)


def test_kl_gradient_k3():
    # d k3 / d logp = 1 - exp(d); a sign bug (d = logp - ref) would give 1 - exp(-d).
    g = jax.grad(lambda lp: O.kl(lp, jnp.array(0.5), "k3"))(jnp.array(0.0))
    np.testing.assert_allclose(g, 1 - math.exp(0.5), rtol=1e-6)


def gspo_hand():
    s0 = (1.5 * 0.5 * 1.1) ** (1 / 3)  # 0.9379...: A = +1 and s < 1: not clipped
    s1 = (0.7 * 1.3) ** (1 / 2)  # 0.9539...: A = -2 and s < 1 - 3e-4: clipped to 0.9997
    return s0, s1


def test_gspo_hand_value():
    lp, old, adv, mask = hand_batch()
    s0, s1 = gspo_hand()
    loss, m = O.get("gspo")(lp, old, adv, mask)
    np.testing.assert_allclose(loss, (-s0 + 2 * (1 - 3e-4)) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["seq_clip_frac"], m["seq_clip_frac_low"],
                                m["seq_clip_frac_high"]], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(m["clip_frac_low"], 2 / 5, rtol=1e-6)  # seq1's 2 tokens
    np.testing.assert_allclose([m["clip_frac"], m["clip_frac_high"]], [2 / 5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(m["seq_ratio_mean"], (s0 + s1) / 2, rtol=1e-6)


def test_gspo_token_hand_value():
    lp, old, adv, mask = hand_batch()
    s0, _ = gspo_hand()
    loss, m = O.get("gspo_token")(lp, old, adv, mask)
    # Per token -A s_i (or the clipped constant), seq-mean-token-mean.
    np.testing.assert_allclose(loss, (-s0 + 2 * (1 - 3e-4)) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["clip_frac_low"], m["clip_frac"]], [2 / 5, 2 / 5], rtol=1e-6)


def test_cispo_hand_value():
    lp, old, adv, mask = hand_batch()
    logp = OLD + np.log(RATIOS)
    # weight = min(r, 1.28), no lower bound.
    expected = -(1.28 * 1 * logp[0, 0] + 0.5 * 1 * logp[0, 1] + 1.1 * 1 * logp[0, 2]
                 + 0.7 * -2 * logp[1, 0] + 1.28 * -2 * logp[1, 1]) / 5
    loss, m = O.get("cispo")(lp, old, adv, mask)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_mean"], (1.28 + 0.5 + 1.1 + 0.7 + 1.28) / 5, rtol=1e-6)
    # The weight is capped on seq0's r=1.5 and seq1's r=1.3; no gradient is removed.
    np.testing.assert_allclose([m["is_weight_clip_frac_high"], m["is_weight_clip_frac_low"]],
                               [0.4, 0.0])
    assert float(m["clip_frac"]) == 0.0 and "clip_frac_high" not in m
    np.testing.assert_allclose(m["is_weight_max"], 1.28, rtol=1e-6)
    # With eps_low = 0.2, the weights of seq0's r = 0.5 and seq1's r = 0.7 become 0.8.
    loss2, m2 = O.get("cispo")(lp, old, adv, mask, eps_low=0.2)
    np.testing.assert_allclose(
        loss2, expected - ((0.8 - 0.5) * 1 * logp[0, 1] + (0.8 - 0.7) * -2 * logp[1, 0]) / 5,
        rtol=1e-6)
    np.testing.assert_allclose(m2["is_weight_clip_frac_low"], 0.4, rtol=1e-6)
    assert float(m2["clip_frac"]) == 0.0


def gmpo_hand():
    # seq0 (A >= 0): delta* = min(delta, 0.4): ln 1.5 = 0.405 -> 0.4; ln 0.5; ln 1.1.
    g0 = math.exp((0.4 + math.log(0.5) + math.log(1.1)) / 3)
    # seq1 (A < 0): delta* = max(delta, -0.4): ln 0.7 = -0.357 and ln 1.3 unclipped.
    g1 = math.sqrt(0.7 * 1.3)
    return g0, g1


def test_gmpo_hand_value():
    lp, old, adv, mask = hand_batch()
    g0, g1 = gmpo_hand()
    loss, m = O.get("gmpo")(lp, old, adv, mask)
    np.testing.assert_allclose(loss, (-1 * g0 + 2 * g1) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"]],
                               [0.2, 0.0, 0.2])


def test_rspo_hand_value():
    lp, old, adv, mask = hand_batch()
    g0, g1 = gmpo_hand()
    gm0 = (0.5 * 1.0 * 0.8) ** (1 / 3)
    gm1 = 0.6 ** 0.5
    loss, m = O.get("rspo")(lp, old, adv, mask, router_shift=jnp.asarray(GAMMA))
    # gamma outside the sgn(A) power: both signs are damped by the geometric mean.
    np.testing.assert_allclose(loss, (-g0 * gm0 + 2 * g1 * gm1) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["gamma_mean"], (0.5 + 1 + 0.8 + 1 + 0.6) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["gamma_min"], 0.5)  # padding's 0.1 / 0.2 ignored


def test_rspo_ignores_gamma_on_padding_even_zero():
    """gamma is read only on valid tokens: 0 or 1 on padding gives the same loss, metrics
    and gradient (no log 0 leaks in)."""
    lp, old, adv, mask = hand_batch()
    pad = np.asarray(MASK) == 0
    out = []
    for fill in (0.0, 1.0):
        gamma = jnp.asarray(np.where(pad, fill, GAMMA).astype(np.float32))
        loss, m = O.get("rspo")(lp, old, adv, mask, router_shift=gamma)
        out.append((loss, m["seq_ratio_mean"], grad_of("rspo", lp, old, adv, mask, router_shift=gamma)))
    for a, b in zip(*out):
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_hand_value():
    lp, old, adv, mask = hand_batch()
    f_pos = [4 * sigmoid(r - 1) for r in (1.5, 0.5, 1.1)]  # tau_pos = 1
    f_neg = [4 / 1.05 * sigmoid(1.05 * (r - 1)) for r in (0.7, 1.3)]  # tau_neg = 1.05
    expected = (-sum(f_pos) / 3 + 2 * sum(f_neg) / 2) / 2
    loss, m = O.get("sapo")(lp, old, adv, mask)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    gates = [4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1)))
             for t, r in ((1, 1.5), (1, 0.5), (1, 1.1), (1.05, 0.7), (1.05, 1.3))]
    np.testing.assert_allclose(m["sapo_gate_mean"], sum(gates) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["sapo_gate_min"], min(gates), rtol=1e-6)
    assert float(m["clip_frac"]) == 0.0  # a soft gate removes no gradient


def test_base_metrics_hand_values():
    lp, old, adv, mask = hand_batch()
    d = np.log([1.5, 0.5, 1.1, 0.7, 1.3])
    _, m = O.get("ppo")(lp, old, adv, mask)
    np.testing.assert_allclose(m["ppo_kl"], -d.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["logratio_std"], d.std(), rtol=1e-5)
    np.testing.assert_allclose(m["logratio_abs_max"], math.log(2.0), rtol=1e-6)  # seq2's ln 3 masked
    # F(2): only r = 0.5 has max(r, 1/r) = 2, which is not > 2 ... up to f32 rounding of
    # log(0.5); use a clear case instead below.
    np.testing.assert_allclose(m["logratio_seq_var"], (d[:3].var() + d[3:].var()) / 2, rtol=1e-5)
    lp2 = lp.at[0, 1].set(OLD + math.log(0.45))
    _, m2 = O.get("ppo")(lp2, old, adv, mask)
    np.testing.assert_allclose(m2["frac_ratio_gt_2"], 0.2, rtol=1e-6)


# ------------------------------------------------------------------------------------
# Gradient facts
# ------------------------------------------------------------------------------------


def test_clip_zeroes_exactly_the_clipped_tokens():
    lp, old, adv, mask = hand_batch()
    g = grad_of("ppo", lp, old, adv, mask)
    # Unclipped tokens: -A r / num_tokens; clipped (seq0 r=1.5, seq1 r=0.7) and padding: 0.
    # A max()-based clip with the 0.5/0.5 tie rule would give -A*r/2 at r exactly 1+eps;
    # a clip of only the high side would leave 2*0.7/5 on seq1's first token.
    expected = np.array([[0.0, -0.5, -1.1, 0.0], [0.0, 2 * 1.3, 0.0, 0.0], [0, 0, 0, 0]]) / 5
    np.testing.assert_allclose(g, expected, rtol=1e-6, atol=0)
    assert (g[expected == 0] == 0).all()


def test_clip_at_exact_boundary_keeps_gradient():
    # r exactly 1 + eps_high is not "r > 1 + eps_high": full gradient (max()'s tie rule
    # would halve it).
    old = jnp.zeros((1, 1))
    lp = jnp.log(jnp.array([[1.25]]))  # exactly representable ratio; eps_high 0.25
    g = compiled("ppo", lp, old, jnp.ones(1), jnp.ones((1, 1)), eps_high=0.25)[2]
    np.testing.assert_allclose(g, [[-1.25]], rtol=1e-6)


@pytest.mark.parametrize("name", O.names())
def test_clip_frac_is_the_share_of_tokens_whose_gradient_is_removed(name):
    """docs/objectives.md, "Diagnostics": clip_frac, in one unit for every objective, is
    the share of valid tokens whose gradient a clip removes. Here every valid token has
    A != 0 and |delta| < 20, so exactly those tokens have a gradient of exactly 0."""
    lp, old, adv, mask = smooth_batch()
    kw = extra_kwargs(name, lp.shape, gamma=np.full(lp.shape, 0.7, np.float32))
    if name in ("gspo", "gspo_token"):
        kw.update(eps_low=0.1, eps_high=0.1)  # clips seq1 (A < 0, s = e^-0.18) low
    if name == "ppo":
        kw["dual_clip"] = 1.5  # smooth_batch's r = e^0.9 at A < 0 binds it
    _, m = O.get(name)(lp, old, adv, mask, **kw)
    g = grad_of(name, lp, old, adv, mask, **kw)
    valid = np.asarray(mask) > 0
    removed = (g == 0) & valid
    np.testing.assert_allclose(m["clip_frac"], removed.sum() / valid.sum(), rtol=1e-6)
    if name in ("cispo", "sapo"):
        assert float(m["clip_frac"]) == 0.0
    else:
        assert float(m["clip_frac"]) > 0, name  # the batch has clipped tokens
    if "clip_frac_low" in m:
        share = m["clip_frac_low"] + m["clip_frac_high"] + m.get("dual_clip_frac", 0.0)
        np.testing.assert_allclose(m["clip_frac"], share, rtol=1e-6)


@pytest.mark.parametrize("name", O.names())
def test_zero_advantage_is_never_clipped(name):
    """A token with A = 0 has no gradient to remove: no clip share counts it, whatever
    its ratio (GMPO/RSPO once counted it as clipped high)."""
    lp, old, _, mask = hand_batch()
    lp = old + jnp.asarray([[3.0, -3.0, 0.9, 0.0], [-0.9, 3.0, 0, 0], [0, 0, 0, 0]], jnp.float32)
    kw = extra_kwargs(name, lp.shape)
    for adv in (jnp.zeros(3), jnp.zeros((3, 4))):
        if O.get(name).sequence_level and adv.ndim == 2:
            continue
        _, m = O.get(name)(lp, old, adv, mask, **kw)
        clip_keys = [k for k in m if "clip_frac" in k]
        assert "clip_frac" in clip_keys
        for k in clip_keys:
            assert float(m[k]) == 0.0, (name, k)
    # The same ratios with A != 0 are clipped (GMPO's high side: delta = 3 > 0.4).
    if name == "gmpo":
        _, m = O.get(name)(lp, old, jnp.array([1.0, 0.0, 0.0]), mask)
        np.testing.assert_allclose(m["clip_frac_high"], 2 / 5, rtol=1e-6)


def test_gspo_gradient_is_A_s_mean_grad_logp():
    lp, old, adv, mask = hand_batch()
    s0, s1 = gspo_hand()
    g = grad_of("gspo", lp, old, adv, mask, eps_low=0.1, eps_high=0.1)  # nothing clipped
    # dL/dlogp_t = -(1/#seqs) A_i s_i / n_i on every valid token of sequence i. A bug that
    # weights tokens by their own ratio r_t (token-level IS) would not be constant per row.
    expected = np.zeros((3, 4))
    expected[0, :3] = -1 * s0 / 3 / 2
    expected[1, :2] = 2 * s1 / 2 / 2
    np.testing.assert_allclose(g, expected, rtol=1e-5)
    # Default eps: seq1 is clipped (A < 0, s < 1 - 3e-4) and loses its gradient entirely.
    g = grad_of("gspo", lp, old, adv, mask)
    np.testing.assert_allclose(g[0, :3], -s0 / 3 / 2, rtol=1e-5)
    assert (g[1] == 0).all()


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.1, 0.1)])
def test_gspo_token_equals_gspo_with_constant_advantage(eps):
    rs = np.random.RandomState(0)
    n, t = 5, 7
    old = jnp.asarray(rs.normal(-1, 0.5, (n, t)), jnp.float32)
    lp = old + jnp.asarray(rs.normal(0, 0.05, (n, t)), jnp.float32)
    mask = jnp.asarray(rs.rand(n, t) > 0.3, jnp.float32).at[3].set(0.0)
    adv = jnp.asarray(rs.normal(0, 1, n), jnp.float32)
    hp = dict(eps_low=eps[0], eps_high=eps[1])
    lg, mg, gg = compiled("gspo", lp, old, adv, mask, **hp)
    for a in (adv, jnp.broadcast_to(adv[:, None], (n, t))):
        lt, mt, gt = compiled("gspo_token", lp, old, a, mask, **hp)
        np.testing.assert_allclose(lt, lg, rtol=1e-6)
        # Same clipping: the token-weighted clip fractions agree.
        np.testing.assert_allclose([mt["clip_frac_low"], mt["clip_frac_high"], mt["clip_frac"]],
                                   [mg["clip_frac_low"], mg["clip_frac_high"], mg["clip_frac"]],
                                   rtol=1e-6)
        np.testing.assert_allclose(gt, gg, rtol=1e-5, atol=1e-8)


def test_cispo_keeps_gradient_on_clipped_tokens():
    lp, old, adv, mask = hand_batch()
    g = grad_of("cispo", lp, old, adv, mask, eps_low=0.2)
    g_ppo = grad_of("dapo", lp, old, adv, mask)
    # seq0 r=1.5 > 1.28: PPO/DAPO drop the token (0); CISPO keeps -w A = -1.28 / 5.
    assert g_ppo[0, 0] == 0.0
    np.testing.assert_allclose(g[0, 0], -1.28 / 5, rtol=1e-6)
    # seq1 r=0.7 < 0.8: weight 0.8, gradient -0.8 * (-2) / 5.
    np.testing.assert_allclose(g[1, 0], 1.6 / 5, rtol=1e-6)
    # Every valid token has a non-zero gradient; padding none.
    assert (g[mask > 0] != 0).all() and (g[mask == 0] == 0).all()


def sapo_gate_of_grad(r, a):
    """SAPO's gradient divided by the unclipped policy gradient -A r (one token)."""
    old = jnp.zeros((1, 1))
    lp = jnp.full((1, 1), math.log(r), jnp.float32)
    g = compiled("sapo", lp, old, jnp.array([a], jnp.float32), jnp.ones((1, 1)))[2]
    return float(g[0, 0]) / (-a * r)


def test_sapo_gate_is_one_on_policy_and_decays_both_sides():
    # At r = 1 the gradient is exactly the unclipped one (a bug in the 4/tau factor would
    # give tau_pos or 1/tau_neg here).
    assert sapo_gate_of_grad(1.0, 1.0) == pytest.approx(1.0, rel=1e-6)
    assert sapo_gate_of_grad(1.0, -1.0) == pytest.approx(1.0, rel=1e-6)
    for a in (1.0, -1.0):
        up = [sapo_gate_of_grad(r, a) for r in (1.0, 1.2, 1.6, 2.5, 4.0)]
        down = [sapo_gate_of_grad(r, a) for r in (1.0, 0.8, 0.5, 0.2)]
        assert all(x > y for x, y in zip(up, up[1:])), up
        assert all(x > y for x, y in zip(down, down[1:])), down
    # Matches 4 p (1 - p), p = sigmoid(tau (r - 1)).
    p = sigmoid(1.05 * 0.6)
    assert sapo_gate_of_grad(1.6, -1.0) == pytest.approx(4 * p * (1 - p), rel=1e-5)


def test_sapo_decays_faster_for_negative_advantages():
    for r in (0.5, 0.8, 1.3, 2.0):
        # tau_neg = 1.05 > tau_pos = 1: swapping them would invert this inequality.
        assert sapo_gate_of_grad(r, -1.0) < sapo_gate_of_grad(r, 1.0)


def test_gmpo_no_larger_than_grpo_am_gm():
    # Unclipped (huge eps): |-A exp(mean delta)| <= |-A mean r| for each sequence.
    rs = np.random.RandomState(1)
    for _ in range(5):
        t = 6
        old = jnp.zeros((1, t))
        lp = jnp.asarray(rs.normal(0, 1, (1, t)), jnp.float32)
        mask = jnp.ones((1, t))
        a = jnp.asarray([rs.normal()], jnp.float32)
        lg, _, _ = compiled("gmpo", lp, old, a, mask, eps_low=100.0, eps_high=100.0)
        lr, _, _ = compiled("grpo", lp, old, a, mask, eps_low=0.999, eps_high=1e9, kl_coef=0.0)
        assert abs(float(lg)) <= abs(float(lr)) * (1 + 1e-6)


def test_gmpo_gradient_and_clip():
    lp, old, adv, mask = hand_batch()
    g0, g1 = gmpo_hand()
    g = grad_of("gmpo", lp, old, adv, mask)
    # -A g_i / n_i / #seqs on unclipped tokens; seq0 token 0 (ln 1.5 > 0.4, A > 0) has 0.
    expected = np.zeros((3, 4))
    expected[0, 1:3] = -g0 / 3 / 2
    expected[1, :2] = 2 * g1 / 2 / 2
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=0)


def test_rspo_with_unit_gamma_equals_gmpo():
    lp, old, adv, mask = hand_batch()
    ones = jnp.ones_like(lp)
    lr, _ = O.get("rspo")(lp, old, adv, mask, router_shift=ones)
    lg, _ = O.get("gmpo")(lp, old, adv, mask)
    np.testing.assert_allclose(lr, lg, rtol=1e-7)
    np.testing.assert_array_equal(grad_of("rspo", lp, old, adv, mask, router_shift=ones),
                                  grad_of("gmpo", lp, old, adv, mask))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rspo_gamma_below_one_shrinks_gradient_for_either_sign(sign):
    lp, old, _, mask = hand_batch()
    adv = jnp.asarray(sign * np.abs(ADV))
    gamma = jnp.asarray(GAMMA)
    gr = grad_of("rspo", lp, old, adv, mask, router_shift=gamma)
    gg = grad_of("gmpo", lp, old, adv, mask)
    # Exactly the per-sequence geometric mean of gamma: (0.4)^(1/3) and 0.6^(1/2). With gamma
    # inside the sgn(A) power (the literal paper form) the A < 0 case would grow instead.
    factor = np.array([0.4 ** (1 / 3), 0.6 ** 0.5, 1.0])[:, None]
    np.testing.assert_allclose(gr, gg * factor, rtol=1e-5, atol=0)
    assert np.abs(gr).sum() < np.abs(gg).sum()


def length_pair():
    """A 200-token and a 10-token response, r = 1, A = +1 each."""
    t = 200
    mask = np.zeros((2, t), np.float32)
    mask[0, :200] = 1
    mask[1, :10] = 1
    z = jnp.zeros((2, t))
    return z, z, jnp.ones(2), jnp.asarray(mask)


def test_dr_grpo_has_no_length_factor():
    lp, old, adv, mask = length_pair()
    g = compiled("dr_grpo", lp, old, adv, mask)[2]
    # -A r / (#seqs * L_norm) = -1/400 for every token of both; GRPO's 1/|o| would give
    # -1/(2*200) and -1/(2*10).
    np.testing.assert_allclose(g[mask > 0], -1 / 400, rtol=1e-6)
    g_grpo = compiled("grpo", lp, old, adv, mask, kl_coef=0.0)[2]
    np.testing.assert_allclose(g_grpo[0, 0], -1 / 400, rtol=1e-6)
    np.testing.assert_allclose(g_grpo[1, 0], -1 / 20, rtol=1e-6)


def test_token_mean_weights_every_token_alike():
    lp, old, adv, mask = length_pair()
    g = compiled("dapo", lp, old, adv, mask)[2]
    # -1/210 for each of the 210 tokens; seq-mean-token-mean would give -1/400 and -1/20.
    np.testing.assert_allclose(g[mask > 0], -1 / 210, rtol=1e-6)
    assert (g[mask == 0] == 0).all()


# ------------------------------------------------------------------------------------
# Exact accumulation over micro-batches
# ------------------------------------------------------------------------------------


def accumulation_batch():
    rs = np.random.RandomState(3)
    n, t = 6, 9
    old = rs.normal(-1.5, 0.5, (n, t)).astype(np.float32)
    lp = (old + rs.normal(0, 0.3, (n, t))).astype(np.float32)
    lengths = np.array([9, 2, 0, 5, 7, 1])  # an empty sequence, varied lengths
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    mask[4, 2] = 0  # a hole
    adv = rs.normal(0, 1, n).astype(np.float32)
    gamma = rs.uniform(0.5, 1, (n, t)).astype(np.float32)
    ref = (old + rs.normal(0, 0.2, (n, t))).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (lp, old, adv, mask, gamma, ref))


ACC_CASES = [(n, {"agg": a}) for n in ("ppo", "grpo", "dr_grpo", "dapo", "gspo_token",
                                        "cispo", "sapo") for a in O.AGG_MODES]
ACC_CASES += [(n, {}) for n in ("gspo", "gmpo", "rspo")]


@pytest.mark.parametrize("name,hp", ACC_CASES, ids=[f"{n}-{h.get('agg', 'seq')}" for n, h in ACC_CASES])
def test_micro_batches_sum_to_whole(name, hp):
    lp, old, adv, mask, gamma, ref = accumulation_batch()
    fn = O.get(name)
    hp = dict(hp, kl_coef=0.1, eps_low=0.1, eps_high=0.1) if name not in ("sapo",) else \
        dict(hp, kl_coef=0.1)
    if name in ("gmpo", "rspo"):
        hp.update(eps_low=0.2, eps_high=0.2)

    def whole_loss(lp_, norm=None, sl=slice(None)):
        kw = {"router_shift": gamma[sl]} if name == "rspo" else {}
        return fn(lp_, old[sl], adv[sl], mask[sl], ref_logp=ref[sl], normalizer=norm,
                  **kw, **hp)

    full, full_m = whole_loss(lp)
    norm = O.normalizer(mask)
    parts = [slice(0, 2), slice(2, 4), slice(4, 6)]  # the middle one holds the empty sequence

    def split_loss(lp_):
        return sum(whole_loss(lp_[s], norm, s)[0] for s in parts)

    np.testing.assert_allclose(split_loss(lp), full, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(split_loss)(lp),
                               jax.grad(lambda x: whole_loss(x)[0])(lp), rtol=1e-5, atol=1e-9)
    # Without the whole batch's normaliser the sum is wrong (a micro-batch-local mean):
    # this is what the keyword is for.
    local = sum(whole_loss(lp[s], None, s)[0] for s in parts)
    assert abs(float(local) - float(full)) > 1e-4
    # Metrics: the micro-batches' mergeable metrics, stacked and reduced, == whole-batch
    # metrics (each metric carries how it merges: gspo_jax.metrics).
    def part_metrics(s):
        kw = {"router_shift": gamma[s]} if name == "rspo" else {}
        return fn.apply(lp[s], old[s], adv[s], mask[s], ref_logp=ref[s], normalizer=norm,
                        **kw, **hp)[1]

    per = [part_metrics(s) for s in parts]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per)
    combined = compute_all(reduce_all(stacked))
    chex.assert_trees_all_close(combined, full_m, rtol=1e-5, atol=1e-6)


def test_normalizer_values():
    norm = O.normalizer(jnp.asarray(MASK))
    assert float(norm.num_tokens) == 5.0 and float(norm.num_seqs) == 2.0


# ------------------------------------------------------------------------------------
# Robustness: check_grads, jit, all-masked, extremes
# ------------------------------------------------------------------------------------


def smooth_batch():
    """Log-ratios away from every clip kink (|delta| in [0.02, 0.1] or > 0.6)."""
    rs = np.random.RandomState(7)
    n, t = 3, 5
    old = rs.normal(-1.0, 0.3, (n, t))
    mag = rs.uniform(0.02, 0.1, (n, t))
    mag[0, 0], mag[1, 2] = 0.8, 0.9  # clipped for every objective that clips
    sign = np.where(rs.rand(n, t) > 0.5, 1.0, -1.0)
    lp = old + sign * mag
    mask = np.ones((n, t), np.float32)
    mask[2, 3:] = 0
    adv = np.array([1.0, -0.7, 0.4])
    return tuple(jnp.asarray(x, jnp.float32) for x in (lp, old, adv, mask))


SMOOTH_HP = {"gspo": dict(eps_low=0.2, eps_high=0.2), "gspo_token": dict(eps_low=0.2, eps_high=0.2)}


@pytest.mark.parametrize("name", O.names())
def test_check_grads(name):
    lp, old, adv, mask = smooth_batch()
    kw = dict(extra_kwargs(name, lp.shape, gamma=np.full(lp.shape, 0.7, np.float32)),
              **SMOOTH_HP.get(name, {}))
    if name == "grpo":
        kw = {"ref_logp": old}  # exercise the default k3 KL too
    f = loss_fn(name, old, adv, mask, **kw)
    if name == "cispo":
        # The IS weight is a stop-gradient constant by design, so the loss's finite
        # differences include its variation and autodiff does not. Hold it fixed by moving
        # old_logp with logp (delta constant); then the two must agree.
        f = lambda x: O.get(name)(lp + x, old + x, adv, mask)[0]  # noqa: E731
        check_grads(f, (jnp.zeros_like(lp),), order=2, modes=("rev", "fwd"), eps=1e-3,
                    atol=1e-2, rtol=1e-2)
        return
    # GSPO-token's gradient path (delta_t - sg(delta_t)) is exact to first order (with an
    # advantage constant per sequence) but its second derivative is not the loss's.
    order = 1 if name == "gspo_token" else 2
    check_grads(f, (lp,), order=order, modes=("rev", "fwd"), eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name,kind", [("dapo", "k2"), ("gspo", "k3"), ("rspo", "k1"),
                                       ("sapo", "k3")])
def test_check_grads_with_kl_term(name, kind):
    lp, old, adv, mask = smooth_batch()
    kw = dict(extra_kwargs(name, lp.shape, gamma=np.full(lp.shape, 0.7, np.float32)),
              **SMOOTH_HP.get(name, {}), ref_logp=old + 0.3, kl_coef=0.2, kl_estimator=kind)
    check_grads(loss_fn(name, old, adv, mask, **kw), (lp,), order=2, modes=("rev", "fwd"),
                eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", O.names())
def test_jit_equals_eager(name):
    lp, old, adv, mask = hand_batch()
    kw = extra_kwargs(name, lp.shape)
    fn = O.get(name)
    eager = fn(lp, old, adv, mask, **kw)
    jitted = jax.jit(lambda *a: fn(*a, **kw))(lp, old, adv, mask)
    chex.assert_trees_all_close(eager, jitted, rtol=1e-6, atol=1e-7)
    ge = jax.grad(loss_fn(name, old, adv, mask, **kw))(lp)
    gj = jax.jit(jax.grad(loss_fn(name, old, adv, mask, **kw)))(lp)
    np.testing.assert_allclose(ge, gj, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", O.names())
def test_all_masked_batch_is_exactly_zero(name):
    lp, old, adv, _ = hand_batch()
    mask = jnp.zeros_like(lp)
    lp = lp.at[0, 0].set(-jnp.inf)  # padding may hold anything
    kw = dict(extra_kwargs(name, lp.shape), ref_logp=old, kl_coef=0.1)
    loss, m = O.get(name)(lp, old, adv, mask, **kw)
    assert float(loss) == 0.0
    g = grad_of(name, lp, old, adv, mask, **kw)
    assert np.isfinite(g).all() and (g == 0).all()
    assert all(np.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", O.names())
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_advantage_where_nothing_is_valid_is_ignored(name, bad):
    """A non-finite advantage on an empty row, or per token on padding, changes nothing
    (0 * NaN would otherwise make the loss and every gradient NaN)."""
    lp, old, adv, mask = hand_batch()  # row 2 has no valid token
    kw = dict(extra_kwargs(name, lp.shape), ref_logp=old + 0.1, kl_coef=0.05)
    fn = O.get(name)
    loss, metrics = fn(lp, old, adv, mask, **kw)
    grad = grad_of(name, lp, old, adv, mask, **kw)
    cases = [adv.at[2].set(bad)]
    if not fn.sequence_level:
        adv_tok = jnp.broadcast_to(adv[:, None], lp.shape)
        cases.append(jnp.where(mask > 0, adv_tok, bad))
    for a in cases:
        loss_b, metrics_b = fn(lp, old, a, mask, **kw)
        assert float(loss_b) == pytest.approx(float(loss), rel=1e-6)
        np.testing.assert_allclose(grad_of(name, lp, old, a, mask, **kw), grad,
                                   rtol=1e-6, atol=1e-9)
        chex.assert_trees_all_close(metrics_b, metrics, rtol=1e-6)


@pytest.mark.parametrize("name", O.names())
@pytest.mark.parametrize("big", [50.0, -50.0])
def test_extreme_log_ratios_are_finite(name, big):
    lp, old, adv, mask = hand_batch()
    lp = old + jnp.asarray([[big, -big, big, 0.0], [big, big, 0, 0], [0, 0, 0, 0]], jnp.float32)
    kw = dict(extra_kwargs(name, lp.shape), ref_logp=old, kl_coef=0.01)
    loss, m = O.get(name)(lp, old, adv, mask, **kw)
    g = grad_of(name, lp, old, adv, mask, **kw)
    assert np.isfinite(float(loss)) and np.isfinite(g).all()
    assert all(np.isfinite(v) for v in m.values())
    np.testing.assert_allclose(m["logratio_abs_max"], 20.0)  # clipped to +-20


# ------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------


def call(name="grpo", shape=(3, 4), adv_shape=None, **kw):
    z = jnp.zeros(shape)
    adv = jnp.zeros(adv_shape if adv_shape is not None else shape[:1])
    kw.setdefault("kl_coef", 0.0) if name == "grpo" else None
    return O.get(name)(z, z, adv, jnp.ones(shape), **kw)


@pytest.mark.parametrize("kw,match", [
    ({"eps_hi": 0.2}, "eps_hi"),
    ({"tau_pos": 1.0}, "tau_pos"),  # not a GRPO hyperparameter
    ({"eps_low": 1.0}, "eps_low"),
    ({"eps_low": -0.1}, "eps_low"),
    ({"eps_high": -0.1}, "eps_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"agg": "mean"}, "agg"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"kl_coef": -1.0}, "kl_coef"),
    ({"norm_len": 0}, "norm_len"),
    ({"eps_low": jnp.array(0.2)}, "eps_low"),  # must be static
    ({"eps_low": float("nan")}, "eps_low"),
])
def test_bad_hyperparameters(kw, match):
    with pytest.raises(ValueError, match=match):
        call(**kw)


@pytest.mark.parametrize("kw", [{"tau_pos": 0.0}, {"tau_neg": -1.0}])
def test_bad_tau(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        call("sapo", **kw)


def test_bad_name():
    with pytest.raises(ValueError, match=r"unknown objective 'grpo2'; known: \('ppo', 'grpo'"):
        O.get("grpo2")


def test_log_space_eps_may_exceed_one_but_not_be_negative():
    call("gmpo", eps_low=1.5)  # a log-space bound: ratio e^-1.5, legitimate
    with pytest.raises(ValueError, match="eps_low"):
        call("gmpo", eps_low=-0.1)


def test_bad_shapes():
    z = jnp.zeros((3, 4))
    fn = O.get("dapo")
    with pytest.raises(ValueError, match="old_logp"):
        fn(z, jnp.zeros((3, 5)), jnp.zeros(3), z)
    with pytest.raises(ValueError, match="mask"):
        fn(z, z, jnp.zeros(3), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match="advantages"):
        fn(z, z, jnp.zeros(4), z)
    with pytest.raises(ValueError, match="logp"):
        fn(jnp.zeros(4), jnp.zeros(4), jnp.zeros(4), jnp.zeros(4))
    with pytest.raises(ValueError, match="advantages"):
        O.get("gspo")(z, z, z, z)  # per-token advantages for a sequence objective
    with pytest.raises(ValueError, match="ref_logp"):
        fn(z, z, jnp.zeros(3), z, ref_logp=jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="ref_logp"):
        O.get("grpo")(z, z, jnp.zeros(3), z)  # default kl_coef 0.04 needs a reference
    with pytest.raises(ValueError, match="router_shift"):
        O.get("rspo")(z, z, jnp.zeros(3), z)
    with pytest.raises(ValueError, match="router_shift"):
        O.get("rspo")(z, z, jnp.zeros(3), z, router_shift=jnp.ones((3, 5)))
    with pytest.raises(ValueError, match="kind"):
        O.kl(z, z, "k0")


def test_shape_checks_fire_under_jit():
    fn = O.get("dapo")
    with pytest.raises(ValueError, match="advantages"):
        jax.jit(lambda lp, a: fn(lp, lp, a, lp)[0])(jnp.zeros((3, 4)), jnp.zeros(5))


# ------------------------------------------------------------------------------------
# PPO with a critic
# ------------------------------------------------------------------------------------


def test_value_loss_hand_values():
    v = jnp.array([[1.0, 2.0, 0.0]])
    v_old = jnp.array([[0.5, 2.0, 0.0]])
    ret = jnp.array([[0.0, 3.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    # tok0: (1-0)^2 = 1; clipped: 0.5 + clip(0.5, -0.2, 0.2) = 0.7 -> 0.49; max = 1 -> 0.5.
    # tok1: (2-3)^2 = 1; clipped equal -> 0.5.  token-mean: 0.5.
    loss, m = O.value_loss(v, v_old, ret, mask, clip_eps=0.2)
    np.testing.assert_allclose(loss, 0.5, rtol=1e-6)
    # V = 0 vs V_old = 0.5, R = 1: unclipped 1, clipped 0.3 -> 0.49... take one where clip wins:
    loss2, m2 = O.value_loss(jnp.array([[0.0]]), jnp.array([[0.5]]), jnp.array([[-1.0]]),
                             jnp.ones((1, 1)), clip_eps=0.2)
    # unclipped (0+1)^2 = 1; clipped 0.3 + 1 = 1.3^2 = 1.69 -> 0.845, and no gradient.
    np.testing.assert_allclose(loss2, 0.845, rtol=1e-6)
    assert float(m2["value_clip_frac"]) == 1.0
    g = jax.grad(lambda x: O.value_loss(x, jnp.array([[0.5]]), jnp.array([[-1.0]]),
                                        jnp.ones((1, 1)))[0])(jnp.array([[0.0]]))
    assert float(g[0, 0]) == 0.0


def test_entropy_bonus():
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
    h = O.token_entropy(logits)
    np.testing.assert_allclose(h, [[math.log(2), -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))]],
                               rtol=1e-6)
    loss, m = O.entropy_bonus(h, jnp.array([[1.0, 0.0]]), coef=0.1)
    np.testing.assert_allclose(loss, -0.1 * math.log(2), rtol=1e-6)
    np.testing.assert_allclose(m["entropy"], math.log(2), rtol=1e-6)
