"""SAPO: a soft, temperature-controlled gate instead of a hard clip
(docs/objectives.md, "SAPO"). Soft Adaptive Policy Optimization, arXiv:2511.20347."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gspo_jax.metrics import Mean, Min
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import TokenHparams, check_number


@dataclasses.dataclass(frozen=True)
class SAPOHparams(TokenHparams):
    """tau_pos, tau_neg: the gate's temperature for A > 0 and for A <= 0 (> 0; larger
    is a narrower trust region). The paper's tau_neg > tau_pos damps negative updates
    faster."""

    name = "sapo"
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "tau_pos", low=0.0, low_open=True)
        check_number(self, "tau_neg", low=0.0, low_open=True)


def sapo(x: common.Inputs, hp: SAPOHparams):
    r"""SAPO: l_t = -A_t (4 / tau) sigmoid(tau (r_t - 1)), tau = tau_pos if A_t > 0 else
    tau_neg, aggregated by ``hp.agg`` (+ the KL term).

    The gradient is -A_t g_t r_t grad logp_t with the gate g = 4 p (1 - p),
    p = sigmoid(tau (r - 1)): exactly 1 at r = 1, decaying smoothly on both sides.

    Args:
      x: the checked inputs, as for `clipped.clipped_surrogate`.
      hp: `SAPOHparams`.

    Returns:
      (loss, metrics); ``sapo_gate_mean/min`` describe the gate g; ``clip_frac`` is 0
      (no hard clip).
    """
    mask, norm = x.mask, x.norm
    adv = common.token_advantages(x.advantages, mask)
    delta = common.log_ratio(x.logp, x.old_logp, mask)
    ratio = jnp.exp(delta)
    tau = jnp.where(adv > 0, hp.tau_pos, hp.tau_neg)

    p = jax.nn.sigmoid(tau * (ratio - 1.0))
    loss_t = -adv * (4.0 / tau) * p
    loss = common.aggregate(loss_t, mask, hp.agg, norm, hp.norm_len, x.weight)
    kl_loss, kl_metrics = common.kl_penalty(x.logp, x.ref_logp, mask, hp, norm, hp.agg, hp.norm_len)

    gate = sg(4.0 * p * (1.0 - p))
    metrics = {
        **common.log_ratio_metrics(delta, mask),
        **common.no_clip_fraction(mask),
        "sapo_gate_mean": Mean.masked(gate, mask),
        "sapo_gate_min": Min.masked(gate, mask, empty=1.0),
        **kl_metrics,
    }
    return loss + kl_loss, metrics
