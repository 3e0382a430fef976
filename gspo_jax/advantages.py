r"""Advantage estimators (docs/objectives.md, "Advantages").

The group estimators are written for one group of G rewards (the G samples of one
prompt) and `jax.vmap`-ed over prompts: the public functions take f32[P,G] and
return f32[P,G].

  group         A_i = (R_i - mean R) / (std R + 1e-6), std with ddof = 1 (DeepSeekMath).
  group_no_std  A_i = R_i - mean R (Dr.GRPO).
  rloo          A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean R).

A group of identical rewards gives A = 0 exactly (not a rounding residue of
R - mean R) for all three.

`gae` is generalised advantage estimation for PPO with a critic, a reverse
`lax.scan` over time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from gspo_jax.config_fields import err, setting
from gspo_jax.registry import Registry

Array = jax.Array

GROUP_STD_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GaeConfig:
    """``config.gae``: generalised advantage estimation and its critic (advantage 'gae',
    objective 'ppo')."""

    gamma: float = setting(1.0, low=0, high=1, doc="discount")
    lam: float = setting(0.95, low=0, high=1, doc="GAE's lambda")
    value_clip: float = setting(0.2, low=0, doc="the critic's value clip")
    value_coef: float = setting(
        0.5, low=0, doc="the value loss's weight; > 0 with 'gae' (the critic must learn)"
    )

    def check_run(self, run, ctx) -> None:
        """With advantage 'gae' the critic must learn."""
        if run.advantage == "gae" and not self.value_coef > 0:
            raise err(
                "gae.value_coef",
                "must be > 0 with advantage 'gae' (0 would leave the critic untrained), "
                f"got {self.value_coef!r}",
            )


def _check_rewards(rewards, fn: str, min_group: int) -> Array:
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(
            f"{fn}: rewards must be f32[P,G] (prompts x group), got shape {rewards.shape}"
        )
    if rewards.shape[1] < min_group:
        raise ValueError(
            f"{fn}: rewards needs a group size G >= {min_group}, got shape {rewards.shape}"
        )
    return rewards.astype(jnp.float32)


def _all_equal(r: Array) -> Array:
    return jnp.max(r) == jnp.min(r)


def _group_one(r: Array) -> Array:
    """f32[G] -> f32[G]: (R - mean) / (std_ddof1 + 1e-6)."""
    centered = r - jnp.mean(r)
    std = jnp.sqrt(jnp.sum(centered * centered) / (r.shape[0] - 1))
    return jnp.where(_all_equal(r), 0.0, centered / (std + GROUP_STD_EPS))


def _group_no_std_one(r: Array) -> Array:
    return jnp.where(_all_equal(r), 0.0, r - jnp.mean(r))


def _rloo_one(r: Array) -> Array:
    g = r.shape[0]
    loo_mean = (jnp.sum(r) - r) / (g - 1)
    return jnp.where(_all_equal(r), 0.0, r - loo_mean)


def group(rewards: Array) -> Array:
    """GRPO group-normalised advantages, f32[P,G] -> f32[P,G] (needs G >= 2)."""
    return jax.vmap(_group_one)(_check_rewards(rewards, "group", 2))


def group_no_std(rewards: Array) -> Array:
    """Dr.GRPO advantages R_i - mean(R), f32[P,G] -> f32[P,G]."""
    return jax.vmap(_group_no_std_one)(_check_rewards(rewards, "group_no_std", 1))


def rloo(rewards: Array) -> Array:
    """Leave-one-out advantages R_i - mean_{j!=i} R_j, f32[P,G] -> f32[P,G] (needs G >= 2)."""
    return jax.vmap(_rloo_one)(_check_rewards(rewards, "rloo", 2))


# The group estimators by their ``config.advantage`` name (``gae`` is the other one).
# The group estimators by name (config.advantage; 'gae' is the critic's, apart).
GROUP_ESTIMATORS: Registry[Callable[[Array], Array]] = Registry("group estimator")
for _name, _fn in (("group", group), ("group_no_std", group_no_std), ("rloo", rloo)):
    GROUP_ESTIMATORS.register(_name, _fn)


def gae(
    rewards: Array, values: Array, mask: Array, *, gamma: float, lam: float
) -> tuple[Array, Array]:
    r"""Generalised advantage estimation over response tokens.

    Positions with mask 0 are not steps: the recursion skips them (the value and
    advantage after them carry over), and they get advantage and return 0. After the
    last valid token the episode ends (bootstrap value 0). For a valid t with next
    valid step t':

      delta_t = r_t + gamma V_{t'} - V_t,   A_t = delta_t + gamma lam A_{t'},   R_t = A_t + V_t.

    Args:
      rewards: f32[N,T] per-token rewards (e.g. the task reward on the last token).
      values: f32[N,T] V(s_t) from the critic (treated as constants).
      mask: f32[N,T] response-token mask.
      gamma: discount in [0, 1].
      lam: GAE lambda in [0, 1].

    Returns:
      (advantages, returns), f32[N,T] each, 0 where mask = 0.
    """
    rewards, values, mask = jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)
    if rewards.ndim != 2:
        raise ValueError(f"gae: rewards must be f32[N,T], got shape {rewards.shape}")
    for arg, x in (("values", values), ("mask", mask)):
        if x.shape != rewards.shape:
            raise ValueError(f"gae: {arg} shape {x.shape} != rewards shape {rewards.shape}")
    for arg, x in (("gamma", gamma), ("lam", lam)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
            raise ValueError(f"gae: {arg} must be a number in [0, 1], got {x!r}")
    valid = mask > 0
    r = jnp.where(valid, rewards.astype(jnp.float32), 0.0)
    v = jax.lax.stop_gradient(jnp.where(valid, values.astype(jnp.float32), 0.0))

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, ok = xs
        adv = r_t + gamma * next_value - v_t + (gamma * lam) * next_adv
        new_carry = (jnp.where(ok, v_t, next_value), jnp.where(ok, adv, next_adv))
        return new_carry, jnp.where(ok, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
    advantages = adv_t.T
    returns = jnp.where(valid, advantages + v, 0.0)
    return advantages, returns
