"""GSPO and GSPO-token: one importance ratio per sequence (docs/objectives.md, "GSPO",
"GSPO-token"). Group Sequence Policy Optimization, arXiv:2507.18071."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gspo_jax.metrics import Mean
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import Hparams, TokenHparams, check_ratio_eps


@dataclasses.dataclass(frozen=True)
class GSPOHparams(Hparams):
    """eps_low, eps_high: the sequence ratio s_i is clipped to [1 - eps_low, 1 + eps_high].

    The defaults are the paper's, tuned for long responses; short responses have
    sequence ratios nearer 1 and want wider bounds (configs/default.py).
    """

    name = "gspo"
    sequence_level = True
    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self):
        super().__post_init__()
        check_ratio_eps(self)


@dataclasses.dataclass(frozen=True)
class GSPOTokenHparams(TokenHparams):
    """As `GSPOHparams`, with a token-level aggregation (per-token advantages)."""

    name = "gspo_token"
    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self):
        super().__post_init__()
        check_ratio_eps(self)


def gspo(x: common.Inputs, hp: GSPOHparams):
    r"""GSPO: l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)),

    s_i = exp(sum_t mask delta_t / n_i), the geometric mean of the token ratios, and
    the loss is the mean of l_i over sequences with a valid token (+ the KL term,
    seq-mean-token-mean). Unclipped, every token of sequence i gets the same gradient
    weight A_i s_i / n_i; a clipped sequence gets none.

    Args:
      x: the checked inputs (`common.Inputs`): logp, old_logp, mask f[N,T];
        advantages f[N] (one per sequence); ref_logp f[N,T] when hp.kl_coef > 0;
        router_shift unused; norm the mini-batch's `common.Normalizer`; weight the
        rollout-correction weight, l_i multiplied by its mean over the sequence's
        valid tokens (None: 1; not on the KL).
      hp: `GSPOHparams`.

    Returns:
      (loss, metrics); ``seq_clip_frac*`` are shares of sequences, ``clip_frac*``
      the shares of tokens in clipped sequences.
    """
    mask, norm = x.mask, x.norm
    adv = common.seq_advantages(x.advantages, mask)
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    s = jnp.exp(common.seq_mean(delta, mask))  # f[N]

    loss_i = common.clipped_max(-adv * s, -adv * jnp.clip(s, 1.0 - hp.eps_low, 1.0 + hp.eps_high))
    loss = common.mean_over_sequences(loss_i, mask, norm, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(
        x.logp, x.ref_logp, mask, hp, norm, "seq-mean-token-mean"
    )

    s, has_tokens = sg(s), jnp.any(mask > 0, axis=-1)
    low, high = (adv < 0) & (s < 1.0 - hp.eps_low), (adv > 0) & (s > 1.0 + hp.eps_high)
    metrics = {
        **common.log_ratio_metrics(delta, mask),
        **common.clip_fractions(low[:, None] & (mask > 0), high[:, None] & (mask > 0), mask),
        "seq_clip_frac": Mean.masked(low | high, has_tokens),
        "seq_clip_frac_low": Mean.masked(low, has_tokens),
        "seq_clip_frac_high": Mean.masked(high, has_tokens),
        "seq_ratio_mean": Mean.masked(s, has_tokens),
        **kl_metrics,
    }
    return loss + kl_loss, metrics


def gspo_token(x: common.Inputs, hp: GSPOTokenHparams):
    r"""GSPO-token: the sequence ratio with a per-token gradient path,

      s_hat_{i,t} = sg(s_i) * exp(delta_t - sg(delta_t))   (value s_i, d/dlogp_t = s_i),
      l_t = max(-A_{i,t} s_hat, -A_{i,t} clip(s_hat, 1 - eps_low, 1 + eps_high)),

    aggregated by ``hp.agg`` (+ the KL term). With A_{i,t} = A_i for every t, the loss,
    its clipping and its gradient equal `gspo`'s. delta_t carries the +-20 clamp, so
    a token outside it has no gradient, as in GSPO's mean.

    Args:
      x: as for `gspo`, but advantages f[N] or f[N,T], and the weight w_t on l_t.
      hp: `GSPOTokenHparams`.

    Returns:
      (loss, metrics).
    """
    mask, norm = x.mask, x.norm
    adv = common.token_advantages(x.advantages, mask)
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    s = sg(jnp.exp(common.seq_mean(delta, mask)))  # f[N]
    s_hat = s[:, None] * jnp.exp(delta - sg(delta))

    clipped = jnp.clip(s_hat, 1.0 - hp.eps_low, 1.0 + hp.eps_high)
    loss_t = common.clipped_max(-adv * s_hat, -adv * clipped)
    loss = common.aggregate(loss_t, mask, hp.agg, norm, hp.norm_len, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(x.logp, x.ref_logp, mask, hp, norm, hp.agg, hp.norm_len)

    s_tok = s[:, None]
    metrics = {
        **common.log_ratio_metrics(delta, mask),
        **common.clip_fractions(
            (adv < 0) & (s_tok < 1.0 - hp.eps_low), (adv > 0) & (s_tok > 1.0 + hp.eps_high), mask
        ),
        "seq_ratio_mean": Mean.masked(s, jnp.any(mask > 0, axis=-1)),
        **kl_metrics,
    }
    return loss + kl_loss, metrics
