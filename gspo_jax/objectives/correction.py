r"""Rollout correction: importance weights between the sampler and the trainer's pi_old
(docs/objectives.md, "Rollout correction").

The sampler (the inference engine) and the trainer's old-log-prob pass compute the
same policy with different numerics, so the tokens come from pi_sampler while the
objectives assume pi_old. Per valid token

    r_t = pi_old(o_t) / pi_sampler(o_t) = exp(old_logp_t - sampler_logp_t),

and per sequence rho_i = exp(mean_t log r_t) ("geometric") or exp(sum_t log r_t)
("product"). The weight, a constant, multiplies each objective's per-token policy loss
(``weight=`` of every objective):

    none        w_t = 1
    token_tis   w_t = min(r_t, C)
    seq_tis     w_t = min(rho_i, C)                            every token of sequence i
    token_mask  w_t = 1[1/c_low <= r_t <= c_high]
    seq_mask    w_t = 1[1/c_low <= rho_i <= c_high]            every token of sequence i

Everything is computed in log space: min(r, C) = exp(min(log r, log C)), and the masks
compare log r with -log c_low and log c_high, so a product over a long sequence never
overflows. seq_mask first clamps each token's log r to +-SEQ_LOG_RATIO_CLAMP, as verl's
sequence rejection does; seq_tis sums them unclamped, as verl's sequence IS weight does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import chex
import jax.numpy as jnp

from gspo_jax.config_fields import err, from_dataclass_error, setting
from gspo_jax.metrics import Max, Mean, MetricDict
from gspo_jax.objectives import common
from gspo_jax.objectives.common import sg
from gspo_jax.objectives.hparams import check_choice, check_number

MODES = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask")
SEQ_RATIOS = ("geometric", "product")

SEQ_LOG_RATIO_CLAMP = 20.0
"""seq_mask clamps each valid token's log r to [-20, 20] before the sum or mean: parity with
verl's sequence rejection (``SAFETY_BOUND`` in its rollout_corr_helper.py), and a bounded
statistic: one token with |log r| > 20, even infinite, moves log rho_i by at most 20 (the
product) or 20/n_i (the geometric mean)."""


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """How the weight pi_old / pi_sampler is formed.

    mode: one of MODES ("none": weight 1).
    cap: C >= 1, the truncation of the tis modes.
    c_low, c_high: >= 1; the mask modes keep ratios in [1/c_low, c_high].
    seq_ratio: the sequence ratio of the seq_* modes: "geometric", exp(mean_t log r_t),
      or "product", exp(sum_t log r_t).
    """

    name: ClassVar[str] = "rollout_correction"  # used in error messages
    mode: str = setting(
        "none",
        domain=", ".join(MODES),
        doc="importance weights pi_old / pi_sampler on the per-token loss "
        '(docs/objectives.md, "Rollout correction")',
    )
    cap: float = setting(2.0, domain="finite float >= 1", doc="C, the truncation of the tis modes")
    c_low: float = setting(
        2.0, domain="finite float >= 1", doc="the mask modes keep ratios >= 1/c_low"
    )
    c_high: float = setting(
        2.0, domain="finite float >= 1", doc="the mask modes keep ratios <= c_high"
    )
    seq_ratio: str = setting(
        "geometric",
        domain=", ".join(SEQ_RATIOS),
        doc="the seq_* modes' sequence ratio: exp(mean_t log r_t) or exp(sum_t log r_t)",
    )

    def __post_init__(self):
        check_choice(self, "mode", MODES)
        for key in ("cap", "c_low", "c_high"):  # >= 1: an on-policy token keeps weight 1
            check_number(self, key, low=1.0)
        check_choice(self, "seq_ratio", SEQ_RATIOS)

    @classmethod
    def check_node(cls, node) -> None:
        """``config.rollout_correction`` made as this class (its own checks), errors
        naming the field."""
        rc = dict(node)
        try:
            cls(**rc)
        except (TypeError, ValueError) as e:
            raise from_dataclass_error(e, cls.name, cls.name, rc) from None

    def check_run(self, run, ctx) -> None:
        """A weight of pi_old / pi_behaviour is 1 where pi_old is the sampler's."""
        if run.updates.trust_region == "behaviour" and self.mode != "none":
            raise err(
                "rollout_correction.mode",
                f"{self.mode!r} weighs pi_old / pi_behaviour, which is 1 under "
                "updates.trust_region='behaviour' (pi_old is the sampler's): use 'none', or "
                "trust_region 'decoupled'",
            )


def rollout_correction(old_logp, sampler_logp, mask, rc: RolloutCorrection):
    """The rollout-correction weight of a batch and its metrics.

    Args:
      old_logp: f32[N,T] log pi_old of the sampled tokens (the trainer's pass).
      sampler_logp: f32[N,T] the same tokens' log-probs under the sampler.
      mask: f32[N,T] or bool, 1 on valid response tokens.
      rc: `RolloutCorrection`.

    Returns:
      (weight, metrics): weight f32[N,T] (f64 for f64 inputs), a constant, 0 where
      mask = 0 (an empty row is all 0); metrics mergeable (`gspo_jax.metrics`):
      ``rc_weight_mean``, ``rc_weight_max``, ``rc_truncated_frac`` (tis modes: share
      with r > C), ``rc_masked_frac`` (mask modes: share with weight 0), over valid
      tokens, or over sequences with a valid token for the seq_* modes; 0 where a
      metric does not apply.
    """
    old_logp, sampler_logp, mask = _check(old_logp, sampler_logp, mask, rc)
    valid = mask > 0
    log_r = jnp.where(valid, sg(old_logp) - sg(sampler_logp), 0.0)
    if rc.mode.startswith("seq_"):
        if rc.mode == "seq_mask":  # verl's IS weight (seq_tis) sums the unclamped log r
            log_r = jnp.clip(log_r, -SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)
        log_rho = jnp.sum(log_r, axis=-1)
        if rc.seq_ratio == "geometric":
            log_rho = log_rho / jnp.maximum(common.seq_lengths(mask), 1.0).astype(log_r.dtype)
        w, truncated, masked = _weight(log_rho, rc)  # f[N]
        weight, units = jnp.where(valid, w[:, None], 0.0), jnp.any(valid, axis=-1)
    else:
        w, truncated, masked = _weight(log_r, rc)  # f[N,T]
        weight, units = jnp.where(valid, w, 0.0), valid
    metrics: MetricDict = {
        "rc_weight_mean": Mean.masked(w, units),
        "rc_weight_max": Max.masked(w, units),
        "rc_truncated_frac": Mean.masked(truncated, units),
        "rc_masked_frac": Mean.masked(masked, units),
    }
    return weight, metrics


def _weight(log_ratio, rc: RolloutCorrection):
    """(weight, truncated, masked) of ratios given in log space, elementwise."""
    none = jnp.zeros(log_ratio.shape, bool)
    if rc.mode.endswith("_tis"):
        log_cap = math.log(rc.cap)
        return jnp.exp(jnp.minimum(log_ratio, log_cap)), log_ratio > log_cap, none
    if rc.mode.endswith("_mask"):
        keep = (log_ratio >= -math.log(rc.c_low)) & (log_ratio <= math.log(rc.c_high))
        return keep.astype(log_ratio.dtype), none, ~keep
    return jnp.ones_like(log_ratio), none, none


def _check(old_logp, sampler_logp, mask, rc):
    name = RolloutCorrection.name
    if not isinstance(rc, RolloutCorrection):
        raise ValueError(f"{name}: rc must be a RolloutCorrection, got {type(rc).__name__}")
    old_logp = common._as_array(old_logp, "old_logp", name)
    sampler_logp = common._as_array(sampler_logp, "sampler_logp", name)
    mask = common._as_array(mask, "mask", name)
    check = functools.partial(common.expect, name)

    check(chex.assert_rank, old_logp, 2, says="old_logp must be f32[N,T]")
    for arg, x in (("old_logp", old_logp), ("sampler_logp", sampler_logp)):
        check(chex.assert_type, x, float, says=f"{arg} must be floating point")
    for arg, x in (("sampler_logp", sampler_logp), ("mask", mask)):
        check(chex.assert_equal_shape, [old_logp, x], says=f"{arg} must have old_logp's shape")
    dtype = jnp.promote_types(common.compute_dtype(old_logp), common.compute_dtype(sampler_logp))
    return old_logp.astype(dtype), sampler_logp.astype(dtype), mask
