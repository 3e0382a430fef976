"""PPO with a critic: the clipped value loss, and the entropy bonus
(docs/objectives.md, "PPO with a critic"). GAE is `gspo_jax.advantages.gae`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.metrics import Mean, MetricDict
from gspo_jax.objectives import common
from gspo_jax.objectives.common import AGG_MODES, Normalizer, sg
from gspo_jax.objectives.hparams import is_static_number


def value_loss(
    values,
    old_values,
    returns,
    mask,
    *,
    clip_eps: float | None = 0.2,
    agg: str = "token-mean",
    norm_len: int | None = None,
    normalizer: Normalizer | None = None,
) -> tuple[jax.Array, dict]:
    r"""PPO's clipped value loss, aggregated like a policy loss:

      l_t = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)

    (``clip_eps=None``: the unclipped 1/2 (V - R)^2).

    Args:
      values: f32[N,T] V_phi(s_t) (differentiated).
      old_values: f32[N,T] the critic's values when the batch was collected.
      returns: f32[N,T] regression targets (`gspo_jax.advantages.gae`).
      mask: f32[N,T].
      clip_eps: eps_v >= 0, or None.
      agg, norm_len, normalizer: as for the objectives.

    Returns:
      (loss, metrics): ``value_clip_frac`` (share of tokens where the clipped term is
      the larger) and ``value_error`` (masked mean of (V - R)^2), as numbers.
    """
    loss, metrics = value_loss_mergeable(
        values,
        old_values,
        returns,
        mask,
        clip_eps=clip_eps,
        agg=agg,
        norm_len=norm_len,
        normalizer=normalizer,
    )
    return loss, {k: m.compute() for k, m in metrics.items()}


def value_loss_mergeable(
    values,
    old_values,
    returns,
    mask,
    *,
    clip_eps=0.2,
    agg="token-mean",
    norm_len=None,
    normalizer=None,
) -> tuple[jax.Array, MetricDict]:
    """`value_loss` with metrics that merge across micro-batches (`gspo_jax.metrics`)."""
    values = jnp.asarray(values)
    for arg, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if jnp.shape(x) != values.shape or values.ndim != 2:
            raise ValueError(
                f"value_loss: {arg} shape {jnp.shape(x)} != values shape "
                f"{values.shape} (both f32[N,T])"
            )
    if clip_eps is not None and not (is_static_number(clip_eps) and clip_eps >= 0):
        raise ValueError(f"value_loss: clip_eps must be None or >= 0, got {clip_eps!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"value_loss: agg must be one of {AGG_MODES}, got {agg!r}")
    mask = jnp.asarray(mask)
    norm = common.normalizer(mask) if normalizer is None else normalizer
    valid = mask > 0
    v = jnp.where(valid, values, 0.0)
    v_old = sg(jnp.where(valid, old_values, 0.0))
    ret = sg(jnp.where(valid, returns, 0.0))

    err = (v - ret) ** 2
    if clip_eps is None:
        loss_t, clipped = 0.5 * err, jnp.zeros_like(valid)
    else:
        err_clipped = (v_old + jnp.clip(v - v_old, -clip_eps, clip_eps) - ret) ** 2
        loss_t, clipped = 0.5 * jnp.maximum(err, err_clipped), err_clipped > err
    loss = common.aggregate(loss_t, mask, agg, norm, norm_len)
    return loss, {
        "value_clip_frac": Mean.masked(clipped, mask),
        "value_error": Mean.masked(sg(err), mask),
    }


def token_entropy(logits) -> jax.Array:
    """Entropy of the next-token distribution, f32[..., V] logits -> f32[...]."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def entropy_bonus(
    entropy,
    mask,
    *,
    coef: float = 0.01,
    agg: str = "token-mean",
    norm_len: int | None = None,
    normalizer: Normalizer | None = None,
) -> tuple[jax.Array, dict]:
    """Entropy bonus as a loss term, -coef * agg(H_t).

    Args:
      entropy: f32[N,T] per-token entropy (`token_entropy`), differentiated.
      mask: f32[N,T].
      coef: >= 0.
      agg, norm_len, normalizer: as for the objectives.

    Returns:
      (loss, {"entropy": masked token mean of H}).
    """
    entropy = jnp.asarray(entropy)
    if entropy.ndim != 2 or jnp.shape(mask) != entropy.shape:
        raise ValueError(
            f"entropy_bonus: entropy {entropy.shape} and mask {jnp.shape(mask)} "
            "must both be f32[N,T]"
        )
    if not (is_static_number(coef) and coef >= 0):
        raise ValueError(f"entropy_bonus: coef must be a number >= 0, got {coef!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"entropy_bonus: agg must be one of {AGG_MODES}, got {agg!r}")
    mask = jnp.asarray(mask)
    norm = common.normalizer(mask) if normalizer is None else normalizer
    loss = -coef * common.aggregate(entropy, mask, agg, norm, norm_len)
    return loss, {"entropy": Mean.masked(sg(entropy), mask).compute()}
