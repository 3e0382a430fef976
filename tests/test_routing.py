"""Tests of gspo_jax.routing: RSPO's router shift and the routing diagnostics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import objectives, routing


def test_router_shift_hand_value():
    # One token, L = 2 layers, K = 2: |diffs| = 0.2, 0, 0, 0.4 -> mean 0.15.
    old = jnp.array([[[[-1.0, -2.0], [-0.5, -1.0]]]])
    new = jnp.array([[[[-1.2, -2.0], [-0.5, -0.6]]]])
    np.testing.assert_allclose(routing.router_shift(old, new), [[math.exp(-0.15)]], rtol=1e-6)
    np.testing.assert_allclose(routing.router_shift(old, new, gamma_min=0.9), [[0.9]])
    np.testing.assert_allclose(routing.router_shift(old, old), [[1.0]])
    # The raw weight is not floored: drift below gamma_min stays visible.
    np.testing.assert_allclose(routing.router_shift(old, new, gamma_min=None), [[math.exp(-0.15)]], rtol=1e-6)
    np.testing.assert_allclose(routing.router_logp_shift(old, new), [[[0.1, 0.2]]], rtol=1e-6)


def test_no_moe_layer_means_no_shift_and_no_flips():
    """A dense model records [N,T,0,0]: gamma is 1, nothing flips (no NaN from an
    empty mean, no error from an empty max)."""
    empty = jnp.zeros((2, 3, 0, 0))
    np.testing.assert_array_equal(routing.router_shift(empty, empty), np.ones((2, 3)))
    idx, mask = jnp.zeros((2, 3, 0, 0), jnp.int32), jnp.ones((2, 3))
    assert routing.expert_flip_fraction(idx, idx, mask).shape == (0,)
    assert float(routing.token_flip_rate(idx, idx, mask)) == 0.0


def test_router_shift_is_stop_gradient():
    old = jnp.zeros((1, 1, 2, 2))
    g = jax.grad(lambda x: routing.router_shift(old, x, gamma_min=0.01).sum())(old + 0.3)
    assert (np.asarray(g) == 0).all()


def test_router_shift_validation():
    x = jnp.zeros((1, 2, 3, 2))
    with pytest.raises(ValueError, match="gamma_min"):
        routing.router_shift(x, x, gamma_min=0.0)
    with pytest.raises(ValueError, match="new_router_logp_at_old_topk"):
        routing.router_shift(x, jnp.zeros((1, 2, 3, 3)))


def test_topk_router_logp():
    logits = jnp.array([[[[0.0, 1.0, 2.0, 3.0]]]])
    idx = jnp.array([[[[3, 1]]]], jnp.int32)
    z = math.log(sum(math.exp(k) for k in range(4)))
    np.testing.assert_allclose(routing.topk_router_logp(logits, idx), [[[[3 - z, 1 - z]]]],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="topk_idx"):
        routing.topk_router_logp(logits, jnp.zeros((1, 1, 1, 2)))  # float indices


def flip_case():
    # N=1, T=3, L=2, K=2.
    old = jnp.array([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[5, 6], [7, 0]]]], jnp.int32)
    new = jnp.array([[[[1, 0], [2, 4]], [[0, 1], [3, 2]], [[1, 2], [3, 4]]]], jnp.int32)
    return old, new


def test_expert_flip_fraction_hand_values():
    old, new = flip_case()
    mask = jnp.array([[1.0, 1.0, 0.0]])  # third token (all flipped) is padding
    # Layer 0: token0 same set (order differs), token1 same -> 0. Layer 1: token0 lost
    # expert 3 -> 1/2; token1 same -> mean 1/4.
    np.testing.assert_allclose(routing.expert_flip_fraction(old, new, mask), [0.0, 0.25])
    np.testing.assert_allclose(routing.token_flip_rate(old, new, mask), 0.5)
    full = jnp.ones((1, 3))
    np.testing.assert_allclose(routing.expert_flip_fraction(old, new, full), [1 / 3, 1 / 2])
    np.testing.assert_allclose(routing.token_flip_rate(old, new, full), 2 / 3)
    zero = jnp.zeros((1, 3))
    np.testing.assert_allclose(routing.expert_flip_fraction(old, new, zero), [0.0, 0.0])


def test_flip_validation():
    old, new = flip_case()
    with pytest.raises(ValueError, match="mask"):
        routing.token_flip_rate(old, new, jnp.ones((1, 2)))


def test_router_shift_feeds_rspo():
    # End to end: router log-probs -> gamma -> RSPO, jitted.
    rs = np.random.RandomState(0)
    n, t, l, e, k = 2, 5, 3, 8, 2
    old_logits = jnp.asarray(rs.normal(size=(n, t, l, e)), jnp.float32)
    new_logits = old_logits + 0.3 * jnp.asarray(rs.normal(size=(n, t, l, e)), jnp.float32)
    idx = jax.lax.top_k(old_logits, k)[1]

    @jax.jit
    def step(new_logits, logp):
        gamma = routing.router_shift(routing.topk_router_logp(old_logits, idx),
                                     routing.topk_router_logp(new_logits, idx))
        return objectives.get("rspo")(logp, jnp.zeros((n, t)), jnp.array([1.0, -1.0]),
                                      jnp.ones((n, t)), router_shift=gamma)

    loss, m = step(new_logits, jnp.zeros((n, t)))
    assert 0.5 <= float(m["gamma_min"]) <= float(m["gamma_mean"]) < 1.0
    assert np.isfinite(float(loss))
