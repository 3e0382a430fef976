"""GMPO and RSPO: the geometric mean of token ratios clipped in log space
(docs/objectives.md, "GMPO", "RSPO").

Geometric-Mean Policy Optimization, arXiv:2507.20673; RSPO (router-shift policy
optimization) multiplies GMPO's ratio by the geometric mean of the router shift,
arXiv:2510.23027.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gspo_jax.metrics import Mean, Min
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import Hparams, check_number


@dataclasses.dataclass(frozen=True)
class GMPOHparams(Hparams):
    """eps_low, eps_high: bounds on the log-ratio, one-sided by the sign of A: delta is
    capped at eps_high where A >= 0 and floored at -eps_low where A < 0 (ratio bounds
    e^{-eps_low}, e^{eps_high}; any value >= 0 is meaningful)."""

    name = "gmpo"
    sequence_level = True
    eps_low: float = 0.4
    eps_high: float = 0.4

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "eps_low", low=0.0)
        check_number(self, "eps_high", low=0.0)


@dataclasses.dataclass(frozen=True)
class RSPOHparams(GMPOHparams):
    """As GMPO, and gamma_min: the floor in (0, 1] on each token's router-shift weight,
    gamma = max(gamma_min, gamma_raw). The paper uses a floor without fixing it; 0.5 is
    this project's default, to be swept (experiments/stability)."""

    name = "rspo"
    needs_router_shift = True
    gamma_min: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "gamma_min", low=0.0, low_open=True, high=1.0)


def gmpo(x: common.Inputs, hp: GMPOHparams):
    r"""GMPO: l_i = -A_i exp(sum_t mask delta*_t / n_i), mean over sequences,

      delta*_t = min(delta_t, eps_high) if A_i >= 0,  max(delta_t, -eps_low) if A_i < 0,

    so a token past its bound has no gradient (+ the KL term, seq-mean-token-mean).

    Args:
      x: the checked inputs, as for `gspo.gspo` (advantages f[N]).
      hp: `GMPOHparams`.

    Returns:
      (loss, metrics).
    """
    return _geometric(x, hp)


def rspo(x: common.Inputs, hp: RSPOHparams):
    r"""RSPO: l_i = -A_i exp(sum_t mask delta*_t / n_i) exp(sum_t mask log gamma_t / n_i),

    gamma_t = max(hp.gamma_min, router_shift_t): GMPO's ratio times the geometric mean
    of the floored router shift, a constant. gamma stands outside the sgn(A) power, so
    routing drift damps the update for either sign of A (docs/objectives.md, "RSPO").

    Args:
      x: as for `gmpo`, with x.router_shift f[N,T] the raw gamma in (0, 1]
        (`gspo_jax.routing.router_shift` with gamma_min=None); anything >= 0 on padding.
      hp: `RSPOHparams`.

    Returns:
      (loss, metrics) with ``gamma_mean`` and ``gamma_min``, the token mean and min of
      the floored gamma.
    """
    # The floor: a token's gamma never falls below gamma_min (a constant, as gamma).
    return _geometric(x, hp, gamma=jnp.maximum(hp.gamma_min, x.router_shift))


def _geometric(x: common.Inputs, hp, gamma=None):
    """GMPO (gamma None) and RSPO: the two differ only in the gamma factor, f[N,T]."""
    mask, norm = x.mask, x.norm
    adv = common.seq_advantages(x.advantages, mask)[:, None]  # f[N,1]
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    high, low = (adv >= 0) & (delta > hp.eps_high), (adv < 0) & (delta < -hp.eps_low)
    delta_star = jnp.where(high, hp.eps_high, jnp.where(low, -hp.eps_low, delta))
    log_ratio_i = common.seq_mean(delta_star, mask)
    if gamma is not None:
        log_ratio_i += common.seq_mean(jnp.log(jnp.where(mask > 0, sg(gamma), 1.0)), mask)

    loss = common.mean_over_sequences(-adv[:, 0] * jnp.exp(log_ratio_i), mask, norm, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(
        x.logp, x.ref_logp, mask, hp, norm, "seq-mean-token-mean"
    )

    metrics = {
        **common.log_ratio_metrics(delta, mask),
        # The loss caps A = 0 rows from above too (value and gradient are 0 there);
        # only A != 0 counts as clipped.
        **common.clip_fractions(low, high & (adv > 0), mask),
        "seq_ratio_mean": Mean.masked(sg(jnp.exp(log_ratio_i)), jnp.any(mask > 0, axis=-1)),
        **kl_metrics,
    }
    if gamma is not None:
        metrics["gamma_mean"] = Mean.masked(gamma, mask)
        metrics["gamma_min"] = Min.masked(gamma, mask, empty=1.0)
    return loss + kl_loss, metrics
