"""Tests of gspo_jax.advantages against hand values and a plain-loop reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import advantages as adv


def test_group_hand_values():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    a = adv.group(r)
    s0 = math.sqrt(1 / 3)  # Bessel: sum of squares 1.0 over G - 1 = 3 (ddof=0 gives 0.5)
    np.testing.assert_allclose(a[0], np.array([0.5, -0.5, -0.5, 0.5]) / (s0 + 1e-6), rtol=1e-6)
    s1 = math.sqrt(20 / 3)
    np.testing.assert_allclose(a[1], np.array([-3.0, -1.0, 1.0, 3.0]) / (s1 + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("fn", [adv.group, adv.group_no_std, adv.rloo])
def test_identical_rewards_give_exact_zero(fn):
    r = jnp.array([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 1.0, 1.0]])
    assert (np.asarray(fn(r)) == 0.0).all()


def test_group_no_std_and_rloo_hand_values():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(adv.group_no_std(r), [[0.5, -0.5, -0.5, 0.5]], rtol=1e-6)
    # RLOO: 1 - mean(0, 0, 1) = 2/3 and 0 - mean(1, 0, 1) = -2/3.
    np.testing.assert_allclose(adv.rloo(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]], rtol=1e-6)


def test_groups_are_independent():
    # vmap over prompts: one group's rewards never leak into another's.
    r = jnp.array([[1.0, 0.0, 0.0], [5.0, 7.0, 9.0]])
    for fn in (adv.group, adv.group_no_std, adv.rloo):
        np.testing.assert_allclose(fn(r)[0], fn(r[:1])[0], rtol=1e-6)


def test_group_validation():
    with pytest.raises(ValueError, match="rewards"):
        adv.group(jnp.zeros(4))
    with pytest.raises(ValueError, match="G >= 2"):
        adv.group(jnp.zeros((3, 1)))
    with pytest.raises(ValueError, match="G >= 2"):
        adv.rloo(jnp.zeros((3, 1)))
    adv.group_no_std(jnp.zeros((3, 1)))  # fine with one sample


def test_gae_hand_values():
    r = jnp.array([[0.0, 0.0, 1.0]])
    v = jnp.array([[0.5, 0.6, 0.7]])
    a, ret = adv.gae(r, v, jnp.ones((1, 3)), gamma=0.9, lam=0.8)
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9*0.7 - 0.6 = 0.03; delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.3; A_1 = 0.03 + 0.72*0.3 = 0.246; A_0 = 0.04 + 0.72*0.246 = 0.21712
    np.testing.assert_allclose(a, [[0.21712, 0.246, 0.3]], rtol=1e-5)
    np.testing.assert_allclose(ret, [[0.71712, 0.846, 1.0]], rtol=1e-5)


def test_gae_skips_masked_positions():
    r = jnp.array([[0.0, 123.0, 1.0, 9.0]])
    v = jnp.array([[0.5, 55.0, 0.7, 9.0]])
    mask = jnp.array([[1.0, 0.0, 1.0, 0.0]])
    a, ret = adv.gae(r, v, mask, gamma=0.9, lam=0.8)
    # Position 1 is not a step: A_0 = (0.9*0.7 - 0.5) + 0.72*0.3 = 0.346.
    np.testing.assert_allclose(a, [[0.346, 0.0, 0.3, 0.0]], rtol=1e-5)
    np.testing.assert_allclose(ret, [[0.846, 0.0, 1.0, 0.0]], rtol=1e-5)


def gae_reference(r, v, m, gamma, lam):
    n, t = r.shape
    a = np.zeros((n, t))
    for i in range(n):
        next_v, next_a = 0.0, 0.0
        for j in reversed(range(t)):
            if m[i, j] > 0:
                next_a = r[i, j] + gamma * next_v - v[i, j] + gamma * lam * next_a
                next_v = v[i, j]
                a[i, j] = next_a
    return a, np.where(m > 0, a + v, 0.0)


def test_gae_matches_loop_reference():
    rs = np.random.RandomState(0)
    r, v = rs.normal(size=(4, 11)), rs.normal(size=(4, 11))
    m = (rs.rand(4, 11) > 0.3).astype(np.float32)
    a, ret = adv.gae(jnp.asarray(r, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(m),
                     gamma=0.95, lam=0.9)
    ea, eret = gae_reference(r, v, m, 0.95, 0.9)
    np.testing.assert_allclose(a, ea, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, eret, rtol=1e-5, atol=1e-5)


def test_gae_monte_carlo_limit():
    # gamma = lam = 1: A_t = sum_{t' >= t} r_t' - V_t.
    r = jnp.array([[1.0, 2.0, 3.0]])
    v = jnp.array([[0.5, 0.25, 1.0]])
    a, _ = adv.gae(r, v, jnp.ones((1, 3)), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a, [[5.5, 4.75, 2.0]], rtol=1e-6)


def test_gae_jit_and_validation():
    r = jnp.ones((2, 5))
    a1 = adv.gae(r, r, r, gamma=0.9, lam=0.9)
    a2 = jax.jit(lambda x: adv.gae(x, x, x, gamma=0.9, lam=0.9))(r)
    np.testing.assert_allclose(a1[0], a2[0], rtol=1e-6)
    with pytest.raises(ValueError, match="gamma"):
        adv.gae(r, r, r, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="values"):
        adv.gae(r, jnp.ones((2, 4)), r, gamma=0.9, lam=0.9)
