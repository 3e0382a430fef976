"""The token-level clipped surrogate: PPO, GRPO, Dr.GRPO and DAPO.

One function, `clipped_surrogate`; the four objectives differ only in their
hyperparameters' defaults (docs/objectives.md, "PPO", "GRPO", "Dr.GRPO", "DAPO").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gspo_jax.metrics import Mean
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import TokenHparams, check_number, check_ratio_eps


@dataclasses.dataclass(frozen=True)
class PPOHparams(TokenHparams):
    """PPO (arXiv:1707.06347) and the dual clip (arXiv:1912.09729).

    eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
    dual_clip: c > 1; for A < 0 the loss is capped at -A c (None: no dual clip).
    """

    name = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"

    def __post_init__(self):
        super().__post_init__()
        check_ratio_eps(self)
        check_number(self, "dual_clip", low=1.0, low_open=True, optional=True)


@dataclasses.dataclass(frozen=True)
class GRPOHparams(PPOHparams):
    """GRPO (DeepSeekMath, arXiv:2402.03300): per-sequence token means, k3 KL, beta 0.04."""

    name = "grpo"
    agg: str = "seq-mean-token-mean"
    kl_coef: float = 0.04


@dataclasses.dataclass(frozen=True)
class DrGRPOHparams(PPOHparams):
    """Dr.GRPO (arXiv:2503.20783): token sums over a constant length, no KL."""

    name = "dr_grpo"
    agg: str = "seq-mean-token-sum-norm"


@dataclasses.dataclass(frozen=True)
class DAPOHparams(PPOHparams):
    """DAPO (arXiv:2503.14476): clip-higher (0.2, 0.28), token-level loss, no KL."""

    name = "dapo"
    eps_high: float = 0.28


def clipped_surrogate(x: common.Inputs, hp: PPOHparams):
    r"""l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), aggregated by ``hp.agg``;
    with a dual clip c, l_t = -A c where A < 0 and r > c; then + kl_coef * agg(k).

    A token's gradient is exactly zero where a clip binds (A > 0 and r > 1 + eps_high;
    A < 0 and r < 1 - eps_low; A < 0 and r > c), and -A r grad logp elsewhere.

    Args:
      x: the checked inputs (`common.Inputs`): logp, old_logp, mask f[N,T];
        advantages f[N] or f[N,T]; ref_logp f[N,T] log pi_ref when hp.kl_coef > 0;
        router_shift unused; norm the mini-batch's `common.Normalizer`; weight the
        rollout-correction weight w_t on l_t (None: 1; not on the KL).
      hp: `PPOHparams`, `GRPOHparams`, `DrGRPOHparams` or `DAPOHparams`.

    Returns:
      (loss, metrics): the scalar to minimise and mergeable metrics.
    """
    mask, norm = x.mask, x.norm
    adv = common.token_advantages(x.advantages, mask)
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    ratio = jnp.exp(delta)

    clipped_ratio = jnp.clip(ratio, 1.0 - hp.eps_low, 1.0 + hp.eps_high)
    loss_t = common.clipped_max(-adv * ratio, -adv * clipped_ratio)
    if hp.dual_clip is not None:
        loss_t = jnp.where((adv < 0) & (ratio > hp.dual_clip), -adv * hp.dual_clip, loss_t)
    loss = common.aggregate(loss_t, mask, hp.agg, norm, hp.norm_len, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(x.logp, x.ref_logp, mask, hp, norm, hp.agg, hp.norm_len)

    ratio = sg(ratio)
    low, high = (adv < 0) & (ratio < 1.0 - hp.eps_low), (adv > 0) & (ratio > 1.0 + hp.eps_high)
    dual = (adv < 0) & (ratio > hp.dual_clip) if hp.dual_clip else jnp.zeros(mask.shape, bool)
    metrics = {
        **common.log_ratio_metrics(delta, mask),
        **common.clip_fractions(low, high, mask, dual),
        "dual_clip_frac": Mean.masked(dual, mask),
        **kl_metrics,
    }
    return loss + kl_loss, metrics
