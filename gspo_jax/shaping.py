r"""DAPO's data-side techniques (docs/objectives.md, "DAPO's data-side techniques").

soft_overlong_penalty  added to the task reward, from the response length L:
                       0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if
                       L_max - L_cache < L <= L_max; -1 if L > L_max.
overlong_mask          overlong filtering: every token of a truncated response gets mask 0.
dynamic_sampling_keep  keep a group only if its rewards are not all equal.

The length penalty and the group filter act on what the verifier returned to the host
(the rewards, the lengths, the correctness), before the batch is assembled: they are
numpy functions, so that a step sends nothing to the devices and back for them.
Overlong filtering acts on the assembled batch's mask, on the devices.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.config_fields import err, setting

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DapoConfig:
    """``config.dapo``: DAPO's data-side techniques."""

    dynamic_sampling: bool = setting(
        False, doc="resample until the batch holds prompts with a reward spread"
    )
    max_sampling_rounds: int = setting(3, low=1, doc="rollouts per step at most, to fill the batch")
    overlong_filter: bool = setting(False, doc="truncated responses carry no loss")
    soft_overlong: bool = setting(False, doc="the soft overlong length penalty")
    overlong_cache_len: int = setting(
        8, low=1, doc="the penalty's ramp, in tokens; < rollout.max_new_tokens with soft_overlong"
    )

    def check_run(self, run, ctx) -> None:
        """Dynamic sampling needs groups; the overlong ramp fits in the responses."""
        if self.dynamic_sampling and run.rollout.group_size < 2:
            raise err("rollout.group_size", "dynamic sampling needs a group of at least 2")
        limit = run.rollout.max_new_tokens
        if self.soft_overlong and not self.overlong_cache_len < limit:
            raise err(
                "dapo.overlong_cache_len",
                f"must be < rollout.max_new_tokens={limit} with soft_overlong, "
                f"got {self.overlong_cache_len}",
            )


def soft_overlong_penalty(lengths, *, max_len: int, cache_len: int) -> np.ndarray:
    """DAPO's soft overlong punishment.

    Args:
      lengths: int or float [N] response lengths in tokens.
      max_len: L_max, a positive int.
      cache_len: L_cache, an int in [1, max_len].

    Returns:
      f32[N] penalty in [-1, 0] to add to the task reward.
    """
    for arg, v in (("max_len", max_len), ("cache_len", cache_len)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            raise ValueError(f"soft_overlong_penalty: {arg} must be a positive int, got {v!r}")
    if cache_len > max_len:
        raise ValueError(
            f"soft_overlong_penalty: cache_len={cache_len} must be <= max_len={max_len}"
        )
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"soft_overlong_penalty: lengths must be [N], got shape {lengths.shape}")
    length = lengths.astype(np.float32)
    start = np.float32(max_len - cache_len)
    ramp = (start - length) / np.float32(cache_len)
    out = np.where(length <= start, 0.0, np.where(length <= max_len, ramp, -1.0))
    return out.astype(np.float32)


def overlong_mask(truncated: Array, mask: Array) -> Array:
    """Overlong filtering: zeroes the mask of every truncated response.

    Args:
      truncated: bool[N], True where the response hit the length limit.
      mask: f32[N,T].

    Returns:
      f32[N,T] (mask's dtype) with rows of truncated responses set to 0.
    """
    truncated, mask = jnp.asarray(truncated), jnp.asarray(mask)
    if mask.ndim != 2 or truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"overlong_mask: truncated must be bool[N] and mask [N,T]; got "
            f"truncated {truncated.shape}, mask {mask.shape}"
        )
    return jnp.where(truncated.astype(bool)[:, None], jnp.zeros((), mask.dtype), mask)


def dynamic_sampling_keep(rewards) -> np.ndarray:
    """DAPO's dynamic sampling filter: keep groups whose rewards are not all equal.

    DAPO filters on accuracy: the trainer passes the verifier's 0/1 correctness, not
    the shaped reward (a length penalty would keep groups that are all right or all
    wrong).

    Args:
      rewards: f32[P,G] rewards (or correctness) of P groups of G samples.

    Returns:
      bool[P], True for groups to keep (0 < #correct < G for 0/1 rewards).
    """
    rewards = np.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(
            f"dynamic_sampling_keep: rewards must be f32[P,G], got shape {rewards.shape}"
        )
    return np.max(rewards, axis=1) != np.min(rewards, axis=1)
