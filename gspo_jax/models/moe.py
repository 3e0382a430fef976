"""Mixture-of-Experts feed-forward: f32 router, top-K, replay, the routing record.

For a token x (row of [N, D]) with router logits z = x W_r (f32, [E]),
p = softmax(z), top-K experts e_1..e_K and gates w_k = p[e_k] (divided by
sum_k p[e_k] when `renormalize_topk`), the layer computes

    y = sum_k w_k * SwiGLU_{e_k}(x).

How the rows reach their experts (the dense, ragged and blocked dispatches,
`model.moe_backend`) is `gspo_jax.models.dispatch`, and on a device mesh
`gspo_jax.models.expert_parallel`; this module routes and records.

Routing replay (docs/objectives.md, "Routing replay"): replay int32[N, K], -1 = free.
A row whose K entries are all >= 0 uses exactly those experts; any other row
uses the free router's top-K.  Gates are the current router's probabilities at
the used experts (renormalised as in a free forward), so the router keeps its
gradient.  The mismatch rate is the share of replayed choices (valid tokens,
replayed rows) that are not in the free router's top-K.  The load-balancing
loss counts the free router's choices, replayed or not: a replayed assignment
is frozen, so a load computed from it would push the router the same way at
every update whatever the router does.

Router noise (the sampler's controllable mismatch, `gspo_jax.rollout`):
`router_noise` f32[N, E] is added to the router logits before everything else
(top-K, gates, statistics); training forwards pass None.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import dispatch, expert_parallel, lora
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import make_param


class MoEStats(NamedTuple):
    """Per-layer routing record (one MoE layer).

    router_logits f32[N, E] (router noise included, if any); topk_indices
    int32[N, K] (the experts used); free_topk_indices int32[N, K] (the router's
    own top-K, whatever replay forces; = topk_indices without replay);
    topk_weights f32[N, K] (the gates used); expert_load f32[E] (share of the
    valid tokens' free-router assignments per expert, sums to 1); aux_loss,
    z_loss, mismatch: f32 scalars.
    """

    router_logits: jax.Array
    topk_indices: jax.Array
    free_topk_indices: jax.Array
    topk_weights: jax.Array
    expert_load: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    mismatch: jax.Array


def route(logits, top_k: int, renormalize: bool, replay=None):
    """Top-K routing from f32 logits [N, E].

    Returns (idx int32[N, K], gates f32[N, K], probs f32[N, E], free_idx,
    replayed bool[N]).
    """
    probs = jax.nn.softmax(logits, axis=-1)
    free_w, free_idx = jax.lax.top_k(probs, top_k)
    free_idx = free_idx.astype(jnp.int32)
    if replay is None:
        idx, w = free_idx, free_w
        replayed = jnp.zeros(logits.shape[:1], bool)
    else:
        replayed = jnp.all(replay >= 0, axis=-1)
        idx = jnp.where(replayed[:, None], replay.astype(jnp.int32), free_idx)
        w = jnp.take_along_axis(probs, idx, axis=-1)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return idx, w, probs, free_idx, replayed


class MoE(nnx.Module):
    """MoE SwiGLU layer.  router [D, E] (f32 compute), experts gate/up [E, D, F],
    down [E, F, D] (+ LoRA adapters [E, D|F, r] and [E, r, F|D], `gspo_jax.models.lora`,
    through the same dispatch)."""

    LORA_WEIGHTS = {
        "gate": ("expert_gate", 1, 1, 3),
        "up": ("expert_up", 1, 1, 3),
        "down": ("expert_down", 1, 1, 3),
    }

    def __init__(self, cfg: ModelConfig, *, stack=(), rngs: nnx.Rngs):
        d, f, e, pd = cfg.d_model, cfg.moe_d_ff, cfg.num_experts, cfg.jnp_param_dtype
        self.cfg = cfg
        self.router = make_param(rngs, stack, (d, e), ("embed", None), pd, std=cfg.init_std)
        self.gate = make_param(
            rngs, stack, (e, d, f), ("expert", "embed", "mlp"), pd, std=cfg.init_std
        )
        self.up = make_param(
            rngs, stack, (e, d, f), ("expert", "embed", "mlp"), pd, std=cfg.init_std
        )
        self.down = make_param(
            rngs, stack, (e, f, d), ("expert", "mlp", "embed"), pd, std=cfg.init_std
        )

    def __call__(self, x, token_mask, replay=None, router_noise=None):
        """x [B, T, D] (compute dtype); token_mask bool[B, T] (False = padding:
        excluded from losses, load and mismatch); replay int32[B, T, K] or None;
        router_noise f32[B, T, E] added to the router logits, or None.

        The load-balancing loss aux_loss = E * sum_e f_e P_e takes the load f_e
        from the free router's top-K (not the replayed experts) and P_e, the mean
        router probability, over the valid tokens.

        Returns (y [B, T, D], MoEStats with leading [B, T] on per-token fields).
        """
        cfg = self.cfg
        b, t, d = x.shape
        n, k, e = b * t, cfg.top_k, cfg.num_experts
        xf = x.reshape(n, d)
        logits = xf.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [N, E]
        if router_noise is not None:
            logits = logits + router_noise.reshape(n, e).astype(jnp.float32)
        rep = None if replay is None else replay.reshape(n, k)
        idx, gates, probs, free_idx, replayed = route(logits, k, cfg.renormalize_topk, rep)

        dt = x.dtype
        wg, wu, wd = (lora.weight(self, w, dt) for w in ("gate", "up", "down"))
        backend = dispatch.resolve_backend(cfg.moe_backend)
        if backend == "dense":
            y = dispatch.dispatch_dense(xf, idx, gates, wg, wu, wd)
        elif backend == "ragged":
            y = expert_parallel.ragged_ffn(cfg, xf, idx, gates, wg, wu, wd)
        else:
            # The blocked dispatch runs per group of rows: with the rows sharded over
            # the batch devices in `moe_groups` blocks, each device sorts and computes
            # its own tokens. One sort over all N tokens would make XLA gather every
            # token to every device and compute every expert there (per-device FLOPs
            # of the layer on 4 CPU devices: 1.00x one device's; tests/test_models_sharding.py).
            g = math.gcd(b, cfg.moe_groups)
            grouped = lambda a: a.reshape((g, n // g) + a.shape[1:])  # noqa: E731
            blocked = functools.partial(dispatch.dispatch_blocked, max_block=cfg.moe_block_size)
            y = jax.vmap(blocked, in_axes=(0, 0, 0, None, None, None))(
                grouped(xf), grouped(idx), grouped(gates), wg, wu, wd
            )
            y = y.reshape(n, d)

        m = token_mask.reshape(n).astype(jnp.float32)
        n_valid = jnp.maximum(jnp.sum(m), 1.0)
        # The free router's load: under replay the used experts are fixed.
        assign = jnp.sum(jax.nn.one_hot(free_idx, e, dtype=jnp.float32), axis=1)  # [N, E]
        load = jnp.einsum("n,ne->e", m, assign) / (n_valid * k)
        mean_prob = jnp.einsum("n,ne->e", m, probs) / n_valid
        aux_loss = e * jnp.sum(load * mean_prob)
        lse = jax.nn.logsumexp(logits, axis=-1)
        z_loss = jnp.sum(m * lse * lse) / n_valid
        if rep is None:
            mismatch = jnp.zeros((), jnp.float32)
        else:
            hit = jnp.any(rep[:, :, None] == free_idx[:, None, :], axis=-1)  # [N, K]
            w_rep = m * replayed.astype(jnp.float32)
            missed = jnp.einsum("n,nk->", w_rep, (~hit).astype(jnp.float32))
            mismatch = missed / jnp.maximum(k * jnp.sum(w_rep), 1.0)
        stats = MoEStats(
            router_logits=logits.reshape(b, t, e),
            topk_indices=idx.reshape(b, t, k),
            free_topk_indices=free_idx.reshape(b, t, k),
            topk_weights=gates.astype(jnp.float32).reshape(b, t, k),
            expert_load=load,
            aux_loss=aux_loss,
            z_loss=z_loss,
            mismatch=mismatch,
        )
        return y.reshape(b, t, d), stats
