r"""RSPO's router shift and the MoE routing diagnostics (docs/objectives.md, "Router shift").

Shapes: N sequences, T positions, L MoE layers, E experts, K experts per token.

  topk_router_logp   router log-softmax gathered at given expert indices.
  router_logp_shift  per token and layer, (1/K) sum_k |log p_theta^l(e_k) - log p_old^l(e_k)|,
                     e_k the experts pi_old's router selected: the raw router shift.
  router_shift       gamma_{i,t} = max(gamma_min, exp(-(1/L) sum_l router_logp_shift)),
                     stop-gradient: RSPO's weight. gamma_min=None gives the raw gamma.
  expert_flip_fraction  per layer, mean over tokens of |topK_old \ topK_theta| / K.
  token_flip_rate       share of tokens whose top-K set changed in any layer.

The flip diagnostics compare whatever top-K sets they are given; the trainer gives
them the *free* router's choices (``RouterAux.free_topk_indices``), which replay
does not change, so a flip means the same under no replay, R2 and R3
(docs/objectives.md, "Stability diagnostics").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def topk_router_logp(router_logits: Array, topk_idx: Array) -> Array:
    """Router log-softmax over all experts, gathered at the given experts.

    Args:
      router_logits: f32[N,T,L,E] router logits.
      topk_idx: int[N,T,L,K] expert indices in [0, E) (e.g. pi_old's top-K).

    Returns:
      f32[N,T,L,K] log p^l(e_k).
    """
    router_logits, topk_idx = jnp.asarray(router_logits), jnp.asarray(topk_idx)
    if (
        router_logits.ndim != 4
        or topk_idx.ndim != 4
        or router_logits.shape[:3] != topk_idx.shape[:3]
    ):
        raise ValueError(
            f"topk_router_logp: router_logits must be f32[N,T,L,E] and topk_idx "
            f"int[N,T,L,K] with the same N,T,L; got {router_logits.shape} and "
            f"{topk_idx.shape}"
        )
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"topk_router_logp: topk_idx must be integer, got {topk_idx.dtype}")
    logp = jax.nn.log_softmax(router_logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, topk_idx, axis=-1, mode="clip")


def router_logp_shift(
    old_router_logp_at_old_topk: Array, new_router_logp_at_old_topk: Array
) -> Array:
    """The raw router shift per token and layer: mean_k |log p_theta^l(e_k) - log p_old^l(e_k)|.

    Args:
      old_router_logp_at_old_topk: f32[N,T,L,K] log p_old^l at pi_old's top-K experts.
      new_router_logp_at_old_topk: f32[N,T,L,K] log p_theta^l at the same experts.

    Returns:
      f32[N,T,L] (stop-gradient); f32[N,T,0] for a model with no MoE layer.
    """
    old = jnp.asarray(old_router_logp_at_old_topk)
    new = jnp.asarray(new_router_logp_at_old_topk)
    if old.ndim != 4 or new.shape != old.shape:
        raise ValueError(
            f"router_logp_shift: old_router_logp_at_old_topk {old.shape} and "
            f"new_router_logp_at_old_topk {new.shape} must both be f32[N,T,L,K]"
        )
    if old.shape[3] == 0:
        return jnp.zeros(old.shape[:3], jnp.float32)
    diff = jnp.abs(new.astype(jnp.float32) - old.astype(jnp.float32))
    return jax.lax.stop_gradient(jnp.mean(diff, axis=3))


def router_shift(
    old_router_logp_at_old_topk: Array,
    new_router_logp_at_old_topk: Array,
    *,
    gamma_min: float | None = 0.5,
) -> Array:
    """RSPO's per-token router-shift weight gamma in [gamma_min, 1] (stop-gradient).

    Args:
      old_router_logp_at_old_topk: f32[N,T,L,K] log p_old^l at pi_old's top-K experts.
      new_router_logp_at_old_topk: f32[N,T,L,K] log p_theta^l at the same experts.
      gamma_min: floor in (0, 1]; the paper does not fix it (default 0.5, to be swept).
        None: no floor, the raw gamma in (0, 1] (a diagnostic: drift below the floor
        is invisible in the floored one).

    Returns:
      f32[N,T] gamma; 1 for a model with no MoE layer (no router to shift).
    """
    if gamma_min is not None and (
        isinstance(gamma_min, bool)
        or not isinstance(gamma_min, (int, float))
        or not 0.0 < gamma_min <= 1.0
    ):
        raise ValueError(f"router_shift: gamma_min must be in (0, 1] or None, got {gamma_min!r}")
    gamma = gamma_of_shift(
        router_logp_shift(old_router_logp_at_old_topk, new_router_logp_at_old_topk)
    )
    return gamma if gamma_min is None else jnp.maximum(gamma_min, gamma)


def gamma_of_shift(shift: Array) -> Array:
    """The raw gamma exp(-(1/L) sum_l shift^l), f32[N,T], from `router_logp_shift`'s
    f32[N,T,L]; 1 for a model with no MoE layer."""
    if shift.shape[2] == 0:
        return jnp.ones(shift.shape[:2], jnp.float32)
    return jnp.exp(-jnp.mean(shift, axis=2))


def _missing(old_idx: Array, new_idx: Array, mask: Array, fn: str):
    old_idx, new_idx, mask = jnp.asarray(old_idx), jnp.asarray(new_idx), jnp.asarray(mask)
    if old_idx.ndim != 4 or new_idx.shape != old_idx.shape or mask.shape != old_idx.shape[:2]:
        raise ValueError(
            f"{fn}: old_idx and new_idx must be int[N,T,L,K] and mask f32[N,T]; "
            f"got {old_idx.shape}, {new_idx.shape}, {mask.shape}"
        )
    # [N,T,L,K]: is old expert k among the new top-K?
    kept = jnp.any(old_idx[..., :, None] == new_idx[..., None, :], axis=-1)
    m = mask.astype(jnp.float32)
    return 1.0 - kept.astype(jnp.float32), m


def expert_flip_fraction(old_idx: Array, new_idx: Array, mask: Array) -> Array:
    """Per layer, the mean over valid tokens of |topK_old minus topK_new| / K.

    Args:
      old_idx: int[N,T,L,K] experts pi_old selected.
      new_idx: int[N,T,L,K] experts pi_theta selects.
      mask: f32[N,T] tokens that count.

    Returns:
      f32[L]; 0 when no token counts (and f32[0] for a model with no MoE layer).
    """
    missing, m = _missing(old_idx, new_idx, mask, "expert_flip_fraction")
    if missing.shape[3] == 0:  # no expert per token: nothing can flip
        return jnp.zeros(missing.shape[2], jnp.float32)
    per_tok_layer = jnp.mean(missing, axis=-1)  # [N,T,L]
    total = jnp.einsum("ntl,nt->l", per_tok_layer, m)
    return total / jnp.maximum(jnp.sum(m), 1.0)


def token_flip_rate(old_idx: Array, new_idx: Array, mask: Array) -> Array:
    """Share of valid tokens whose top-K set changed in at least one layer (f32[]);
    0 for a model with no MoE layer."""
    missing, m = _missing(old_idx, new_idx, mask, "token_flip_rate")
    if missing.shape[2] * missing.shape[3] == 0:
        return jnp.zeros((), jnp.float32)
    flipped = jnp.max(missing, axis=(2, 3))  # [N,T]
    return jnp.sum(m * flipped) / jnp.maximum(jnp.sum(m), 1.0)
