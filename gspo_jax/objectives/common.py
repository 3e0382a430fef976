"""What every objective shares: masking, the log-ratio, aggregation, the exact
micro-batch normaliser, KL estimators, input checks and the common diagnostics.

Every formula here is in ``docs/objectives.md`` under the section named beside it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from gspo_jax.metrics import Max, Mean, MetricDict, Std, Sum

Array = jax.Array
sg = jax.lax.stop_gradient

LOG_RATIO_CLIP = 20.0
"""Token log-ratios are clipped to [-20, 20] before exponentiation ("Conventions")."""

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------------
# Normaliser ("Aggregation": exact micro-batch accumulation)
# ----------------------------------------------------------------------------------


class Normalizer(NamedTuple):
    """The loss denominators of a whole mini-batch (a pytree of two scalars).

    Attributes:
      num_tokens: f32[], sum_{i,t} mask.
      num_seqs: f32[], #{i : n_i > 0}.
    """

    num_tokens: Array
    num_seqs: Array


def normalizer(mask: Array) -> Normalizer:
    """The denominators of ``mask`` (f32[N,T] or bool) for exact gradient accumulation.

    Pass the whole mini-batch's normaliser as ``normalizer=`` to every micro-batch's
    objective call: the micro-batch losses then sum to the mini-batch loss.
    """
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be f32[N,T], got shape {mask.shape}")
    valid = (mask > 0).astype(jnp.float32)
    return Normalizer(jnp.sum(valid), jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32)))


# ----------------------------------------------------------------------------------
# Masking and the log-ratio ("Conventions")
# ----------------------------------------------------------------------------------


def compute_dtype(x: Array):
    """f32, or f64 when given f64 (bf16 and f16 inputs are computed in f32)."""
    return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)


def log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """delta_t = clip(logp_t - sg(old_logp_t), -20, 20), and 0 where mask = 0.

    Beyond the clamp delta is the constant +-20 (no gradient); exactly on it, the
    gradient is kept, like every clip here ("Clipping", ties).
    """
    diff = jnp.where(mask > 0, logp - sg(old_logp), 0.0)
    return jnp.where(jnp.abs(diff) > LOG_RATIO_CLIP, jnp.sign(diff) * LOG_RATIO_CLIP, diff)


def seq_lengths(mask: Array) -> Array:
    """n_i = sum_t mask_{i,t}, f[N]."""
    return jnp.sum(jnp.where(mask > 0, 1.0, 0.0), axis=-1)


def seq_mean(x: Array, mask: Array) -> Array:
    """f[N]: sum_t mask * x / max(n_i, 1)."""
    return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=-1) / jnp.maximum(seq_lengths(mask), 1.0)


def token_advantages(advantages: Array, mask: Array) -> Array:
    """A_{i,t} as f[N,T]: per-sequence A_i broadcast over T, 0 where mask = 0.

    A constant (stop-gradient). Zeroing keeps a NaN or inf advantage on padding or an
    empty row out of the loss, where 0 * NaN would be NaN ("Conventions").
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return jnp.where(mask > 0, sg(jnp.broadcast_to(advantages, mask.shape)), 0.0)


def seq_advantages(advantages: Array, mask: Array) -> Array:
    """A_i as f[N], 0 on rows with no valid token (a constant)."""
    return jnp.where(jnp.any(mask > 0, axis=-1), sg(advantages), 0.0)


def clipped_max(unclipped: Array, clipped: Array) -> Array:
    """max(unclipped, clipped) of a clipped surrogate, for the loss -A r vs -A clip(r).

    Where the two are equal (the ratio inside the clip range, or exactly on a bound)
    the gradient is the unclipped term's: the clip binds only strictly beyond its
    bound ("Clipping"). ``jnp.maximum`` would halve the gradient at a tie.
    """
    return jnp.where(unclipped >= clipped, unclipped, clipped)


# ----------------------------------------------------------------------------------
# Aggregation ("Aggregation")
# ----------------------------------------------------------------------------------


def aggregate(
    loss_t: Array,
    mask: Array,
    agg: str,
    norm: Normalizer,
    norm_len: int | None = None,
    weight: Array | None = None,
) -> Array:
    """Per-token losses l_{i,t} -> one scalar, with the mini-batch's denominators.

    token-mean               sum_{i,t} mask*l / num_tokens
    seq-mean-token-mean      sum_i (sum_t mask*l / n_i) / num_seqs
    seq-mean-token-sum       sum_{i,t} mask*l / num_seqs
    seq-mean-token-sum-norm  sum_{i,t} mask*l / (num_seqs * norm_len), norm_len=None: T

    ``weight`` (a constant f[N,T], 0 on padding; None: 1) multiplies l before the sums;
    the denominators stay those above ("Rollout correction").
    """
    if weight is not None:
        loss_t = weight * loss_t
    row_sum = jnp.sum(jnp.where(mask > 0, loss_t, 0.0), axis=-1)
    num_tokens = jnp.maximum(sg(norm.num_tokens), 1.0)
    num_seqs = jnp.maximum(sg(norm.num_seqs), 1.0)
    if agg == "token-mean":
        return jnp.sum(row_sum) / num_tokens
    if agg == "seq-mean-token-mean":
        return jnp.sum(row_sum / jnp.maximum(seq_lengths(mask), 1.0)) / num_seqs
    if agg == "seq-mean-token-sum":
        return jnp.sum(row_sum) / num_seqs
    if agg == "seq-mean-token-sum-norm":
        return jnp.sum(row_sum) / (num_seqs * (norm_len or mask.shape[1]))
    raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")


def mean_over_sequences(
    loss_i: Array, mask: Array, norm: Normalizer, weight: Array | None = None
) -> Array:
    """Sequence-level losses l_i -> their sum over rows with n_i > 0, / num_seqs.

    ``weight`` (a constant f[N,T]; None: 1) multiplies l_i by its mean over the
    sequence's valid tokens, w_bar_i ("Rollout correction").
    """
    if weight is not None:
        loss_i = seq_mean(weight, mask) * loss_i
    has_tokens = jnp.any(mask > 0, axis=-1)
    return jnp.sum(jnp.where(has_tokens, loss_i, 0.0)) / jnp.maximum(sg(norm.num_seqs), 1.0)


# ----------------------------------------------------------------------------------
# KL to a reference policy ("KL to a reference policy")
# ----------------------------------------------------------------------------------


def kl(logp: Array, ref_logp: Array, kind: str) -> Array:
    """Per-token estimator of KL(pi_theta || pi_ref), d = ref_logp - logp:

    k1 = -d,   k2 = d^2 / 2,   k3 = exp(d) - d - 1.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {ref_logp.shape} != logp shape {logp.shape}")
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return jnp.exp(d) - d - 1.0


def kl_penalty(logp, ref_logp, mask, hp, norm: Normalizer, agg: str, norm_len=None):
    """(kl_coef * agg(k), metrics): the KL term of a loss and its token mean ``kl``.

    (0, {}) when ``hp.kl_coef`` is 0, a static choice: no reference pass is needed.
    """
    if hp.kl_coef == 0:
        return 0.0, {}
    k = kl(jnp.where(mask > 0, logp, 0.0), jnp.where(mask > 0, sg(ref_logp), 0.0), hp.kl_estimator)
    penalty = hp.kl_coef * aggregate(k, mask, agg, norm, norm_len)
    return penalty, {"kl": Mean.masked(sg(k), mask)}


# ----------------------------------------------------------------------------------
# Diagnostics ("Diagnostics")
# ----------------------------------------------------------------------------------

_LN2 = math.log(2.0)


def log_ratio_metrics(delta: Array, mask: Array) -> MetricDict:
    """The metrics every objective reports, from the masked log-ratio delta."""
    delta = sg(delta)
    n = seq_lengths(mask)
    has_tokens = n > 0
    seq_var = seq_mean(delta * delta, mask) - seq_mean(delta, mask) ** 2
    return {
        "num_tokens": Sum.of(jnp.sum(n)),
        "num_seqs": Sum.of(jnp.sum(has_tokens)),
        "ppo_kl": Mean.masked(-delta, mask),  # approximate KL(pi_old || pi_theta)
        "logratio_std": Std.masked(delta, mask),
        "logratio_abs_max": Max.masked(jnp.abs(delta), mask),
        "logratio_seq_var": Mean.masked(jnp.maximum(seq_var, 0.0), has_tokens),
        "frac_ratio_gt_2": Mean.masked(jnp.abs(delta) > _LN2, mask),  # max(r, 1/r) > 2
    }


def clip_fractions(
    clipped_low: Array, clipped_high: Array, mask: Array, dual: Array | None = None
) -> MetricDict:
    """Token shares of the tokens whose gradient a clip removes (bool[N,T] each, where
    the low / high side binds; ``dual``: where PPO's dual clip binds): ``clip_frac``
    (any of them) and each side's share ("Diagnostics").

    Callers pass only tokens with A != 0 (a zero advantage is never clipped).
    """
    removed = clipped_low | clipped_high
    if dual is not None:
        removed = removed | dual
    return {
        "clip_frac": Mean.masked(removed, mask),
        "clip_frac_low": Mean.masked(clipped_low, mask),
        "clip_frac_high": Mean.masked(clipped_high, mask),
    }


def no_clip_fraction(mask: Array) -> MetricDict:
    """``clip_frac`` = 0 (a Mean over the valid tokens) for objectives whose clip, if
    any, never removes a gradient (CISPO, SAPO)."""
    return {"clip_frac": Mean.masked(jnp.zeros(mask.shape, bool), mask)}


# ----------------------------------------------------------------------------------
# Input checks (shape contracts, asserted at every objective's entry)
# ----------------------------------------------------------------------------------


class Inputs(NamedTuple):
    """An objective's inputs after `check_inputs`, in the compute dtype.

    Attributes:
      logp, old_logp: f[N,T].
      advantages: f[N] or f[N,T].
      mask: [N,T] as given (valid where > 0).
      ref_logp: f[N,T], or None.
      router_shift: f[N,T] (RSPO's raw gamma), or None.
      norm: the mini-batch's `Normalizer` (this batch's when none was given).
      weight: f[N,T] constant, 0 where mask = 0, or None.
    """

    logp: Array
    old_logp: Array
    advantages: Array
    mask: Array
    ref_logp: Array | None
    router_shift: Array | None
    norm: Normalizer
    weight: Array | None


def check_inputs(
    hp,
    logp,
    old_logp,
    advantages,
    mask,
    *,
    ref_logp=None,
    router_shift=None,
    norm=None,
    weight=None,
) -> Inputs:
    """Checks shapes and dtypes (chex, at trace time: they fire under ``jax.jit`` too)
    and returns the `Inputs` in the compute dtype.

    ``hp`` (the objective's `Hparams`) gives the name used in messages, whether the
    objective is sequence-level and whether it needs the router shift. Raises
    ValueError naming the argument (and, from chex, the shapes or dtypes). ``norm``:
    the mini-batch's `Normalizer` (None: this batch's).
    """
    name = hp.name
    check = functools.partial(expect, name)
    given = {
        arg: _as_array(x, arg, name)
        for arg, x in (
            ("logp", logp),
            ("old_logp", old_logp),
            ("mask", mask),
            ("advantages", advantages),
            ("ref_logp", ref_logp),
            ("router_shift", router_shift),
            ("weight", weight),
        )
        if x is not None
    }
    logp, mask, advantages = given["logp"], given["mask"], given["advantages"]
    check(chex.assert_rank, logp, 2, says="logp must be f32[N,T]")
    for arg, x in given.items():
        if arg != "mask":
            check(chex.assert_type, x, float, says=f"{arg} must be floating point")
        if arg not in ("logp", "advantages"):
            check(chex.assert_equal_shape, [logp, x], says=f"{arg} must have logp's shape [N,T]")
    shape, dtype = logp.shape, compute_dtype(logp)
    if hp.sequence_level and advantages.shape != shape[:1]:
        raise ValueError(
            f"{name}: advantages must be f32[N] = {shape[:1]} for a sequence-level "
            f"objective, got shape {advantages.shape}"
        )
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"{name}: advantages must be f32[N] or f32[N,T] with (N, T) = {shape}, "
            f"got shape {advantages.shape}"
        )
    if ref_logp is None and hp.kl_coef > 0:
        raise ValueError(
            f"{name}: kl_coef={hp.kl_coef} > 0 needs ref_logp (pass ref_logp, or kl_coef=0.0)"
        )
    if router_shift is None and hp.needs_router_shift:
        raise ValueError(
            f"{name}: router_shift (f32[N,T], gspo_jax.routing.router_shift) is required"
        )
    norm = normalizer(mask) if norm is None else norm
    if not isinstance(norm, Normalizer):
        raise ValueError(
            f"{name}: normalizer must be objectives.Normalizer, got {type(norm).__name__}"
        )
    for field, x in zip(norm._fields, norm):
        check(chex.assert_rank, x, 0, says=f"normalizer.{field} must be a scalar")

    def in_dtype(arg):
        return given[arg].astype(dtype) if arg in given else None

    if weight is not None:
        weight = jnp.where(mask > 0, sg(in_dtype("weight")), 0.0)
    return Inputs(
        logp=in_dtype("logp"),
        old_logp=in_dtype("old_logp"),
        advantages=in_dtype("advantages"),
        mask=mask,
        ref_logp=in_dtype("ref_logp"),
        router_shift=in_dtype("router_shift"),
        norm=norm,
        weight=weight,
    )


def expect(name: str, assertion, *args, says: str) -> None:
    """Runs the chex ``assertion`` on ``args``; when it fails, a ValueError with chex's
    message (the shapes or dtypes) followed by ``[<name>: <says>]``, naming the argument."""
    assertion(*args, custom_message=f"{name}: {says}", exception_type=ValueError)


def _as_array(x, arg: str, name: str) -> Array:
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise ValueError(f"{name}: {arg} is not an array: {e}") from None
