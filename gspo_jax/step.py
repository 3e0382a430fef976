"""The pure, jit-compiled pieces of training.

Sequence layout used throughout: a rollout batch holds left-padded prompts
``prompt_tokens`` int32[N,P] (``prompt_mask``) followed by right-padded responses
``tokens`` int32[N,T] (``mask``). The model reads ``inputs = concat(prompt,
response)[:, :-1]`` and predicts ``targets = concat(prompt, response)[:, 1:]``;
response token t is predicted at input position P-1+t, so every per-token
array of the losses (log-probs, router records, γ) is the slice
``[:, P-1:P-1+T]`` of a full-sequence one.

Functions here are module-level and pure. Static pieces (the model's graphdef,
the optimizer, a :class:`StepConfig`) are bound with ``functools.partial``
before ``jax.jit``; nothing here reads a config object.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gspo_jax import metrics as metrics_lib
from gspo_jax import objectives, routing
from gspo_jax.metrics import Mean, Min, Sum
from gspo_jax.objectives.critic import value_loss_mergeable

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything a train step changes; a pytree, donated to each step."""

    step: jax.Array  # int32[]: optimizer updates applied or skipped
    params: Any  # nnx.State of the model (its variables are all nnx.Param)
    opt_state: Any
    skipped: jax.Array  # int32[]: updates skipped for a non-finite loss or gradient


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the policy update (hashable; bound before jit)."""

    objective: str
    hparams: tuple[tuple[str, Any], ...] = ()
    micro_batches: int = 1
    gamma_min: float = 0.5
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    # PPO with a critic: the value head's clipped regression loss.
    value_coef: float = 0.0  # 0 = no critic
    value_clip: float | None = 0.2

    @property
    def hparam_dict(self) -> dict[str, Any]:
        return dict(self.hparams)


# --------------------------------------------------------------------------
# Optimizer.


def make_optimizer(
    *,
    lr: float,
    schedule: str,
    total_steps: int,
    warmup_steps: int,
    end_lr_ratio: float,
    weight_decay: float,
    b1: float,
    b2: float,
    grad_clip: float,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then constant/cosine/linear decay, and global-norm clipping."""
    warmup_steps = max(0, min(warmup_steps, total_steps))
    decay_steps = max(1, total_steps - warmup_steps)
    if schedule == "constant":
        after = optax.constant_schedule(lr)
    elif schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=end_lr_ratio)
    elif schedule == "linear":
        after = optax.linear_schedule(lr, lr * end_lr_ratio, decay_steps)
    else:
        raise ValueError(f"schedule: unknown schedule {schedule!r}")
    if warmup_steps:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps]
        )
    else:
        sched = after
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts), sched


def _apply_update(state: TrainState, grads, loss, optimizer):
    """Optimizer update that is skipped, parameters and moments untouched, when
    the loss or the gradient is not finite."""
    grad_norm = optax.global_norm(grads)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = TrainState(
        step=state.step + 1,
        params=keep(new_params, state.params),
        opt_state=keep(new_opt, state.opt_state),
        skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
    )
    norms = {
        "grad_norm": grad_norm,
        "update_norm": jnp.where(ok, optax.global_norm(updates), 0.0),
        "param_norm": optax.global_norm(new_state.params),
        "skipped_update": jnp.where(ok, 0.0, 1.0),
        "skipped_total": new_state.skipped,
    }
    return new_state, norms


def _split_micro(tree, m: int):
    """[n, ...] -> [m, n/m, ...] on every leaf."""
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), tree)


def _accumulate(loss_fn, params, batch, m: int):
    """Sum of value-and-grad of ``loss_fn`` over m micro-batches (lax.scan).

    ``loss_fn`` returns ``(loss, metrics)``, the loss of each micro-batch already
    scaled by the whole mini-batch's denominators (so the sum is the mini-batch loss
    exactly, but for the load-balancing loss, taken per micro-batch) and the metrics
    as mergeable values (`gspo_jax.metrics`), which merge into the mini-batch's.
    Returns (loss, metrics as numbers, grads).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if m == 1:
        (loss, metrics), grads = grad_fn(params, batch)
        return loss, metrics_lib.compute_all(metrics), grads

    def body(carry, mb):
        loss_acc, grads_acc = carry
        (loss, metrics), grads = grad_fn(params, mb)
        return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), stacked = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros), _split_micro(batch, m)
    )
    return loss, metrics_lib.compute_all(metrics_lib.reduce_all(stacked)), grads


# --------------------------------------------------------------------------
# Sequences.


def sequence_inputs(batch: Batch):
    """Model inputs for the prompt+response layout (see the module docstring).

    Returns inputs, targets int32[N,P+T-1], positions int32[N,P+T-1] (counted
    over real tokens, so left padding does not shift them) and attn_mask.
    """
    seq = jnp.concatenate([batch["prompt_tokens"], batch["tokens"]], axis=1)
    valid = jnp.concatenate([batch["prompt_mask"], batch["mask"]], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return seq[:, :-1], seq[:, 1:], positions[:, :-1], valid[:, :-1]


def response_slice(x: jax.Array, prompt_len: int, resp_len: int) -> jax.Array:
    """The positions that predict the response tokens: [:, P-1 : P-1+T]."""
    return jax.lax.slice_in_dim(x, prompt_len - 1, prompt_len - 1 + resp_len, axis=1)


def _forward(model, batch: Batch, replay, *, values: bool = False):
    """Response log-probs, entropies (and critic values V(s_t)) of one forward.

    Returns (logp, entropy, values or None, aux); per-token arrays f32[N,T].
    """
    inputs, targets, positions, attn = sequence_inputs(batch)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    if values:
        h, aux = model.hidden(inputs, positions=positions, attn_mask=attn, replay=replay)
        logp, entropy = model.logprobs_from_hidden(h, targets)
        v = response_slice(model.value(h), p, t)
    else:
        logp, entropy, aux = model.token_logprobs(
            inputs, targets, positions=positions, attn_mask=attn, replay=replay
        )
        v = None
    return response_slice(logp, p, t), response_slice(entropy, p, t), v, aux


def logprob_pass(
    params, batch: Batch, *, graphdef, replay_key: str | None = None, values: bool = False
):
    """Per-token log-probs of the response under ``params`` (no gradient).

    Used for the old policy (recomputed by the training model) and for the
    reference policy. Also returns the routing record of this forward:
    ``topk`` int32[N,P+T-1,L,K] over all input positions (the R2 replay), and
    at the response positions the router log-softmax at those top-K experts
    (RSPO's old router log-probs) and the top-K themselves; with ``values``,
    the critic's V(s_t) too.
    """
    model = nnx.merge(graphdef, params)
    replay = batch[replay_key] if replay_key else None
    logp, entropy, v, aux = _forward(model, batch, replay, values=values)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    topk_resp = response_slice(aux.topk_indices, p, t)
    router_lp = routing.topk_router_logp(response_slice(aux.router_logits, p, t), topk_resp)
    out = {
        "logp": logp,
        "entropy": entropy,
        "topk": aux.topk_indices,
        "topk_resp": topk_resp,
        "router_logp": router_lp,
    }
    if values:
        out["values"] = v
    return out


# --------------------------------------------------------------------------
# The policy update.


def router_tokens(batch: Batch) -> jax.Array:
    """f32[]: the positions the router sees as valid (the model's attention mask)."""
    return jnp.sum(sequence_inputs(batch)[3].astype(jnp.float32))


def policy_loss(params, batch: Batch, *, graphdef, cfg: StepConfig, norm, num_router_tokens):
    """The objective on one (micro-)batch, scaled by whole-mini-batch denominators.

    ``norm`` holds the mini-batch's response counts (`objectives.normalizer`) and
    ``num_router_tokens`` its `router_tokens`. Returns ``(loss, metrics)``, the
    metrics as mergeable values (`gspo_jax.metrics`): each says how it merges over
    micro-batches.
    """
    model = nnx.merge(graphdef, params)
    replay = batch.get("replay")
    critic = cfg.value_coef > 0
    logp, entropy, values, aux = _forward(model, batch, replay, values=critic)
    mask = batch["mask"].astype(jnp.float32)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    num_tokens = jnp.sum(mask)  # this micro-batch's response tokens

    # Routing: the current router's log-probs at the old top-K experts give
    # RSPO's γ; the current top-K against the old one gives the flip rates.
    new_router_lp = routing.topk_router_logp(
        response_slice(aux.router_logits, p, t), batch["old_topk"]
    )
    gamma = routing.router_shift(batch["old_router_logp"], new_router_lp, gamma_min=cfg.gamma_min)
    fn = objectives.get(cfg.objective)
    loss, metrics = fn.apply(
        logp,
        batch["old_logp"],
        batch["advantages"],
        mask,
        ref_logp=batch.get("ref_logp"),
        router_shift=gamma if fn.needs_router_shift else None,
        normalizer=norm,
        **cfg.hparam_dict,
    )
    if cfg.entropy_coef:
        bonus, _ = objectives.entropy_bonus(entropy, mask, coef=cfg.entropy_coef, normalizer=norm)
        loss = loss + bonus
    if critic:
        vloss, value_metrics = value_loss_mergeable(
            values,
            batch["old_values"],
            batch["returns"],
            mask,
            clip_eps=cfg.value_clip,
            normalizer=norm,
        )
        loss = loss + cfg.value_coef * vloss  # vloss: already this micro-batch's share
        metrics.update(value_metrics, value_loss=Sum.of(vloss))
    # Router losses. z_loss is a mean over the router's valid positions: weighted by
    # this micro-batch's share of them, the sum over micro-batches is the mini-batch's.
    # The load-balancing loss is a product of two means over a batch, so it is taken
    # per micro-batch and averaged (as MoE trainers do); exact only when m = 1.
    router_positions = router_tokens(batch)
    z_share = router_positions / jnp.maximum(num_router_tokens, 1.0)
    loss = (
        loss
        + cfg.aux_loss_coef * aux.aux_loss / cfg.micro_batches
        + cfg.z_loss_coef * aux.z_loss * z_share
    )

    cur_topk = response_slice(aux.topk_indices, p, t)
    flips = routing.expert_flip_fraction(batch["old_topk"], cur_topk, mask)  # f32[L]
    metrics.update(
        {
            "entropy": Mean.masked(jax.lax.stop_gradient(entropy), mask),
            "aux_loss": Mean.of(aux.aux_loss),  # the mean over micro-batches
            "z_loss": Mean.of(aux.z_loss, weight=router_positions),
            "router_shift_mean": Mean.masked(gamma, mask),
            "router_shift_min": Min.masked(gamma, mask, empty=1.0),
            "expert_flip_frac_layer": Mean.of(flips, weight=num_tokens),
            "expert_flip_frac": Mean.of(jnp.mean(flips) if flips.size else 0.0, weight=num_tokens),
            "token_flip_rate": Mean.of(
                routing.token_flip_rate(batch["old_topk"], cur_topk, mask), weight=num_tokens
            ),
        }
    )
    if replay is not None:
        mismatch = aux.replay_mismatch  # f32[L], a rate over all routed positions
        metrics["replay_mismatch_layer"] = Mean.of(mismatch)
        metrics["replay_mismatch"] = Mean.of(jnp.mean(mismatch) if mismatch.size else 0.0)
    return loss, metrics


def train_step(
    state: TrainState, batch: Batch, rng: jax.Array, *, graphdef, optimizer, cfg: StepConfig
):
    """One optimizer update on a mini-batch, accumulated over micro-batches.

    ``batch`` holds the rollout layout of the module docstring plus
    ``old_logp``, ``advantages``, ``old_topk``, ``old_router_logp`` and,
    optionally, ``ref_logp`` and ``replay``. ``rng`` is unused by the current
    objectives (no dropout) and kept so that stochastic regularisers need no
    API change.
    """
    del rng
    norm = objectives.normalizer(batch["mask"])
    loss_fn = functools.partial(
        policy_loss, graphdef=graphdef, cfg=cfg, norm=norm, num_router_tokens=router_tokens(batch)
    )
    loss, metrics, grads = _accumulate(loss_fn, state.params, batch, cfg.micro_batches)
    new_state, norms = _apply_update(state, grads, loss, optimizer)
    return new_state, dict(metrics, loss=loss, **norms)


# --------------------------------------------------------------------------
# Supervised warm start.


def sft_loss(
    params, batch: Batch, *, graphdef, num_tokens, micro_batches: int, aux_loss_coef: float
):
    """Token-mean negative log-likelihood of the response given the prompt."""
    model = nnx.merge(graphdef, params)
    logp, entropy, _, aux = _forward(model, batch, None)
    mask = batch["mask"].astype(jnp.float32)
    nll = -jnp.sum(logp * mask) / num_tokens  # this micro-batch's share of the mean
    metrics = {
        "sft_nll": Sum.of(jax.lax.stop_gradient(nll)),
        "entropy": Mean.masked(jax.lax.stop_gradient(entropy), mask),
        "aux_loss": Mean.of(aux.aux_loss),
    }
    return nll + aux_loss_coef * aux.aux_loss / micro_batches, metrics


def sft_step(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    graphdef,
    optimizer,
    micro_batches: int = 1,
    aux_loss_coef: float = 0.0,
):
    """One supervised update on prompt+reference-response sequences."""
    del rng
    num_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
    loss_fn = functools.partial(
        sft_loss,
        graphdef=graphdef,
        num_tokens=num_tokens,
        micro_batches=micro_batches,
        aux_loss_coef=aux_loss_coef,
    )
    loss, metrics, grads = _accumulate(loss_fn, state.params, batch, micro_batches)
    new_state, norms = _apply_update(state, grads, loss, optimizer)
    return new_state, dict(metrics, loss=loss, **norms)
