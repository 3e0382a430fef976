"""The direction of learning, for every registered objective.

A tiny linear-softmax policy, one free logit row per (sequence, position), so that a
token's log-prob depends on its own row only: one gradient-descent step on an
objective's loss must raise the log-prob of every valid token whose advantage is
positive and lower it where the advantage is negative, and leave padding alone. A sign
error in any objective's loss (or in its gradient path) turns every one of these
around. PPO's critic and the entropy bonus, and the KL term, are checked the same way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import objectives as O
from gspo_jax.objectives.critic import value_loss

N, T, V = 4, 3, 5
LR = 0.5
ADV = np.array([1.0, -1.0, 0.5, -2.0], np.float32)  # one per sequence, both signs
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], np.float32)
GAMMA = np.array([[0.9, 1.0, 0.7], [0.8, 0.6, 1.0], [1.0, 1.0, 1.0], [0.95, 0.9, 0.85]], np.float32)


def policy():
    """Logits f32[N,T,V] and the sampled tokens int32[N,T]."""
    rs = np.random.RandomState(0)
    return jnp.asarray(rs.normal(size=(N, T, V)), jnp.float32), jnp.asarray(rs.randint(0, V, (N, T)))


def token_logp(logits, tokens):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)[..., 0]


def step_change(loss_of_logp, logits, tokens):
    """logp after one gradient-descent step on ``loss_of_logp`` minus logp before."""
    grads = jax.grad(lambda w: loss_of_logp(token_logp(w, tokens)))(logits)
    return np.asarray(token_logp(logits - LR * grads, tokens) - token_logp(logits, tokens))


@pytest.mark.parametrize("name", O.names())
def test_a_step_raises_positive_and_lowers_negative_advantage_tokens(name):
    logits, tokens = policy()
    old = jax.lax.stop_gradient(token_logp(logits, tokens))  # on policy: no clip binds
    fn = O.get(name)
    kw = {"router_shift": jnp.asarray(GAMMA)} if fn.needs_router_shift else {}
    kw["ref_logp"] = old  # GRPO's default KL term: zero gradient at the reference

    change = step_change(lambda lp: fn(lp, old, jnp.asarray(ADV), jnp.asarray(MASK), **kw)[0], logits, tokens)
    signed = change * np.sign(ADV)[:, None]
    valid = MASK > 0
    assert np.all(signed[valid] > 1e-4), (name, change)
    np.testing.assert_array_equal(change[~valid], 0.0)


@pytest.mark.parametrize("name", O.names())
def test_the_kl_term_pulls_towards_the_reference(name):
    """With every advantage 0 only the KL term (k3, k2) acts: each valid token's log-prob
    moves towards the reference's."""
    logits, tokens = policy()
    old = jax.lax.stop_gradient(token_logp(logits, tokens))
    ref = old + jnp.asarray(np.random.RandomState(1).choice([-0.5, 0.5], (N, T)), jnp.float32)
    fn = O.get(name)
    kw = {"router_shift": jnp.asarray(GAMMA)} if fn.needs_router_shift else {}
    valid = MASK > 0
    for estimator in ("k2", "k3"):
        change = step_change(
            lambda lp: fn(lp, old, jnp.zeros(N), jnp.asarray(MASK), ref_logp=ref, kl_coef=0.5,
                          kl_estimator=estimator, **kw)[0],
            logits, tokens)
        towards = change * np.sign(np.asarray(ref - old))
        assert np.all(towards[valid] > 1e-4), (name, estimator, change)


def test_ppo_with_its_critic_and_entropy_bonus():
    """PPO's loss as the train step forms it with a critic and an entropy bonus: the
    policy still follows the advantages, the value moves towards the return, and the
    entropy bonus alone raises the entropy."""
    logits, tokens = policy()
    old = jax.lax.stop_gradient(token_logp(logits, tokens))
    values = jnp.asarray(np.random.RandomState(2).normal(size=(N, T)), jnp.float32)
    returns = values + jnp.asarray(np.random.RandomState(3).choice([-0.1, 0.1], (N, T)), jnp.float32)
    adv, mask = jnp.asarray(np.broadcast_to(ADV[:, None], (N, T))), jnp.asarray(MASK)
    valid = MASK > 0

    def loss(w, v, entropy_coef=0.01):
        policy_loss, _ = O.get("ppo")(token_logp(w, tokens), old, adv, mask)
        critic, _ = value_loss(v, values, returns, mask)
        bonus, _ = O.entropy_bonus(O.token_entropy(w), mask, coef=entropy_coef)
        return policy_loss + 0.5 * critic + bonus

    gw, gv = jax.grad(loss, argnums=(0, 1))(logits, values)
    change = np.asarray(token_logp(logits - LR * gw, tokens) - old)
    assert np.all((change * np.sign(ADV)[:, None])[valid] > 1e-4), change
    value_change = np.asarray(-LR * gv)
    assert np.all((value_change * np.sign(np.asarray(returns - values)))[valid] > 0), value_change
    np.testing.assert_array_equal(value_change[~valid], 0.0)

    gw = jax.grad(lambda w: O.entropy_bonus(O.token_entropy(w), mask, coef=1.0)[0])(logits)
    entropy_change = np.asarray(O.token_entropy(logits - LR * gw) - O.token_entropy(logits))
    assert np.all(entropy_change[valid] > 0), entropy_change
