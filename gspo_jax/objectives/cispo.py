"""CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio, so that no
token loses its gradient (docs/objectives.md, "CISPO"). MiniMax-M1, arXiv:2506.13585."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gspo_jax.metrics import Max, Mean
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import TokenHparams, check_ratio_eps


@dataclasses.dataclass(frozen=True)
class CISPOHparams(TokenHparams):
    """eps_low, eps_high: the IS weight is clip(r, 1 - eps_low, 1 + eps_high).

    eps_low=None: no lower bound (MiniMax-M1's setting). eps_high=0.28 is this
    project's default (DAPO's clip-higher bound); the paper does not fix one.
    """

    name = "cispo"
    eps_low: float | None = None
    eps_high: float = 0.28
    agg: str = "token-mean"

    def __post_init__(self):
        super().__post_init__()
        check_ratio_eps(self, low_optional=True)


def cispo(x: common.Inputs, hp: CISPOHparams):
    r"""CISPO: l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t, by ``hp.agg``.

    Every valid token keeps the gradient -w_t A_t grad logp_t, w_t the clipped weight.

    Args:
      x: the checked inputs, as for `clipped.clipped_surrogate`.
      hp: `CISPOHparams`.

    Returns:
      (loss, metrics); ``is_weight_mean/max`` describe w, ``is_weight_clip_frac_low/high``
      the shares of tokens (A != 0) whose w is capped; ``clip_frac`` is 0: no
      gradient is removed.
    """
    mask, norm = x.mask, x.norm
    adv = common.token_advantages(x.advantages, mask)
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    ratio = sg(jnp.exp(delta))
    low_bound = -jnp.inf if hp.eps_low is None else 1.0 - hp.eps_low
    is_weight = jnp.clip(ratio, low_bound, 1.0 + hp.eps_high)

    loss_t = -is_weight * adv * jnp.where(mask > 0, x.logp, 0.0)
    loss = common.aggregate(loss_t, mask, hp.agg, norm, hp.norm_len, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(x.logp, x.ref_logp, mask, hp, norm, hp.agg, hp.norm_len)

    signal = adv != 0  # a zero advantage is never counted as clipped
    metrics = {
        **common.log_ratio_metrics(delta, mask),
        **common.no_clip_fraction(mask),
        "is_weight_clip_frac_low": Mean.masked(signal & (ratio < low_bound), mask),
        "is_weight_clip_frac_high": Mean.masked(signal & (ratio > 1.0 + hp.eps_high), mask),
        "is_weight_mean": Mean.masked(is_weight, mask),
        "is_weight_max": Max.masked(is_weight, mask),
        **kl_metrics,
    }
    return loss + kl_loss, metrics
