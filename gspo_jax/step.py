"""The pure, jit-compiled pieces of training.

Sequence layout used throughout: a rollout batch holds left-padded prompts
``prompt_tokens`` int32[N,P] (``prompt_mask``) followed by right-padded responses
``tokens`` int32[N,T] (``mask``). The model reads ``inputs = concat(prompt,
response)[:, :-1]`` and predicts ``targets = concat(prompt, response)[:, 1:]``;
response token t is predicted at input position P-1+t, so every per-token
array of the losses (log-probs, router records, γ) is the slice
``[:, P-1:P-1+T]`` of a full-sequence one. The model may compute them on packed
buffers (`StepConfig.packing`, `gspo_jax.packing`); the losses read them in this
layout either way.

Functions here are module-level and pure. Static pieces (the model's graphdef,
the optimizer, a :class:`StepConfig`) are bound with ``functools.partial``
before ``jax.jit``; nothing here reads a config object.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gspo_jax import metrics as metrics_lib
from gspo_jax import objectives, packing, routing
from gspo_jax.config_fields import err, is_real, setting
from gspo_jax.metrics import Last, Max, Mean, Min, Sum
from gspo_jax.models import lora, quantized
from gspo_jax.objectives.critic import value_loss_mergeable
from gspo_jax.objectives.hparams import Hparams
from gspo_jax.passes import forward, sequence_inputs, split_micro

Batch = dict[str, jax.Array]

REPLAY_MODES = ("none", "R2", "R3")
# The policy the objectives' ratio is taken against (docs/offpolicy.md).
TRUST_REGIONS = ("decoupled", "behaviour")


@dataclasses.dataclass(frozen=True)
class UpdatesConfig:
    """``config.updates``: the updates made from each rollout (the off-policy regime
    where MoE instability shows)."""

    num_minibatches: int = setting(
        2, low=1, doc="optimizer steps per rollout and epoch; divides the rollout batch"
    )
    num_epochs: int = setting(1, low=1, doc="passes over each rollout")
    micro_batches: int = setting(
        1, low=1, doc="gradient accumulation inside a mini-batch; divides it"
    )
    packing: bool = setting(
        True,
        doc="the train step's and the log-prob passes' forwards on packed buffers, the "
        "rows' real tokens end to end (gspo_jax.packing); the same loss and gradient as "
        "padded rows, to float rounding",
    )
    micro_batch_tokens: int = setting(
        0,
        low=0,
        doc="the token budget of a micro-batch (and of a log-prob pass's piece): packed "
        "buffer rows of pack_length slots, of which only those the real tokens fill are "
        "computed, or with packing off padded rows of max_prompt_len + max_new_tokens - 1 "
        "(the padded twin). 0: micro-batches by row count (micro_batches, "
        "logprob_micro_batches)",
    )
    pack_length: int = setting(
        0,
        low=0,
        doc="with micro_batch_tokens: slots per packed buffer row, at least max_prompt_len + "
        "max_new_tokens - 1 (0: that); a sequence never spans two buffer rows, so a longer "
        "row packs sequences over half that length, at attention over more keys",
    )
    logprob_micro_batches: int = setting(
        1,
        low=1,
        doc="the old-policy (and reference) log-prob passes run the rollout batch in this "
        "many strided pieces, one after another, each split over the batch shards "
        "(docs/memory.md)",
    )
    routing_replay: str = setting(
        "none", choices=REPLAY_MODES, doc="routing replay: none, R2 or R3 (R2/R3: MoE only)"
    )
    trust_region: str = setting(
        "decoupled",
        choices=TRUST_REGIONS,
        doc="the policy the objectives' ratio and clip are around: 'decoupled', pi_old "
        "recomputed at the step's parameters (rollout_correction weighs pi_old / "
        "pi_behaviour), or 'behaviour', the sampler's log-probs (no old pass; "
        "docs/offpolicy.md)",
    )
    # Deprecated: RSPO's floor is its own hyperparameter, objective.hparams.gamma_min
    # (`gspo_jax.old_keys.move_deprecated` moves a value set here, with a notice).
    gamma_min: Optional[float] = setting(
        None,
        check=lambda v: None if v is None or is_real(v) else f"must be a number, got {v!r}",
        domain="deprecated",
        doc="deprecated: RSPO's floor is config.objective.hparams.gamma_min",
    )
    # Router losses in RL: off by default (the warm start keeps its own, sft.*).
    aux_loss_coef: float = setting(
        0.0,
        low=0,
        doc="load-balancing loss in RL; its expert load is the free router's, even under replay",
    )
    z_loss_coef: float = setting(0.0, low=0, doc="router z-loss in RL")
    update_without_signal: bool = setting(
        False,
        doc="whether a mini-batch whose advantages are all zero (no RL signal) still makes "
        "an update (router losses, KL or entropy alone would drive it); counted as "
        "no_signal_minibatches",
    )
    max_consecutive_skips: int = setting(
        8,
        low=0,
        resume=True,
        doc="non-finite losses or gradients skip the update; more than this many in a row "
        "stop the run with an error",
    )

    def check_run(self, run, ctx) -> None:
        """Routing replay needs experts; the rollout batch, its mini-, micro- and log-prob
        batches against each other and the mesh's batch shards (``ctx.batch_shards``)."""
        if run.model.dense and self.routing_replay != "none":
            raise err(
                "updates.routing_replay",
                f"{self.routing_replay!r} needs MoE layers; "
                "model.fields.num_experts=0 is a dense model: use 'none'",
            )
        shards = ctx.batch_shards
        n = run.rollout.prompts_per_step * run.rollout.group_size
        mb = self.num_minibatches
        if n % mb:
            raise err(
                "updates.num_minibatches",
                f"{mb} does not divide the rollout batch prompts_per_step*group_size = {n}",
            )
        micro = self.micro_batches
        if (n // mb) % micro:
            raise err(
                "updates.micro_batches",
                f"{micro} does not divide the mini-batch of {n // mb} sequences",
            )
        if (n // mb // micro) % shards:
            raise err(
                "mesh",
                f"the micro-batch of {n // mb // micro} sequences is not divisible by the "
                f"data*fsdp*expert = {shards} batch shards",
            )
        lp = self.logprob_micro_batches
        if n % lp or (n // lp) % shards:
            raise err(
                "updates.logprob_micro_batches",
                f"{lp} pieces of the rollout batch of {n} sequences: each must be a whole "
                f"number of sequences divisible by the data*fsdp*expert = {shards} batch shards",
            )
        packing.shapes(self, run, shards)  # the token budget's own checks


@flax.struct.dataclass
class TrainState:
    """Everything a train step changes; a pytree, donated to each step."""

    step: jax.Array  # int32[]: updates attempted (applied or skipped)
    params: Any  # nnx.State of the model (its variables are all nnx.Param)
    opt_state: Any
    skipped: jax.Array  # int32[]: updates skipped for a non-finite loss or gradient
    skipped_in_a_row: jax.Array  # int32[]: the current run of such skips
    applied: jax.Array  # int32[]: updates the optimizer applied (its schedule's count)

    @classmethod
    def create(cls, params, opt_state) -> "TrainState":
        # One buffer per counter: the state is donated, and a buffer may be donated once.
        def zero():
            return jnp.zeros((), jnp.int32)

        return cls(
            step=zero(),
            params=params,
            opt_state=opt_state,
            skipped=zero(),
            skipped_in_a_row=zero(),
            applied=zero(),
        )


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the policy update (hashable; bound before jit)."""

    # The objective's hyperparameters, its frozen dataclass (config.objective.hparams);
    # the objective is the one they belong to.
    hparams: Hparams
    micro_batches: int = 1
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    # PPO with a critic: the value head's clipped regression loss.
    value_coef: float = 0.0  # 0 = no critic
    value_clip: float | None = 0.2
    # The sampling temperature: log-probs are those of softmax(logits / temperature).
    temperature: float = 1.0
    # Update on a mini-batch whose advantages are all zero (router losses, KL and
    # entropy would be its only drive); off: such a mini-batch changes nothing.
    update_without_signal: bool = False
    # The parameters updated (`gspo_jax.models.lora.TRAINABLE`): 'all', or with LoRA
    # the adapters (and routers); the rest is frozen, with no gradient or moments.
    trainable: str = "all"
    # The policy forward on packed buffers of this shape (`gspo_jax.packing`), its
    # micro-batches those of the plan (``micro_batches`` is then unused); None: padded.
    packing: Optional[packing.Packing] = None

    @property
    def objective(self) -> str:
        return self.hparams.name


def step_config(
    objective: str, hparams: Mapping[str, Any] | Sequence = (), **settings
) -> StepConfig:
    """The `StepConfig` of ``objective`` with ``hparams`` (a mapping or ``(key, value)``
    pairs) over its defaults, and ``settings``: for a step built outside a run (a run's
    is `gspo_jax.rl.RLPhase`'s, from the loaded config)."""
    return StepConfig(hparams=objectives.get(objective).hparams(**dict(hparams)), **settings)


def apply_update(
    state: TrainState, grads, loss, optimizer, schedule, apply=True, trainable: str = "all"
):
    """The optimizer update of the ``trainable`` parameters (`lora.partition`), unless
    the loss or the gradient is not finite (counted in ``skipped`` and
    ``skipped_in_a_row``) or ``apply`` is False (a mini-batch with no signal): then
    parameters and optimizer moments stay as they were.

    ``lr`` is the schedule at the optimizer's own count of applied updates: the rate
    this update applies (or would have applied, when skipped).

    The update runs under `lax.cond`, so a step holds one copy of the parameters and
    moments (updated in place in the donated buffers) rather than the old and the new
    side by side for a select: on CPU XLA's temporaries of this function fall from
    1.85x to 1.25x the parameters' bytes, the same as an update that is never skipped
    (a 2-layer model, `memory_analysis()`); on an H200 the select's second copy kept a
    16-layer model from fitting (`experiments/accelerator.md`).
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite & apply

    def update(params, opt_state):
        updates, new_opt = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt, optax.tree.norm(updates)

    def keep(params, opt_state):
        return params, opt_state, jnp.zeros((), grad_norm.dtype)

    params, frozen = lora.partition(state.params, trainable)
    new_params, new_opt, update_norm = jax.lax.cond(ok, update, keep, params, state.opt_state)
    new_params = lora.join(new_params, frozen)
    nonfinite = jnp.where(finite, 0, 1).astype(jnp.int32)
    new_state = TrainState(
        step=state.step + 1,
        params=new_params,
        opt_state=new_opt,
        skipped=state.skipped + nonfinite,
        skipped_in_a_row=jnp.where(
            finite, jnp.where(ok, 0, state.skipped_in_a_row), state.skipped_in_a_row + 1
        ),
        applied=state.applied + ok.astype(jnp.int32),
    )
    params_finite = jnp.all(
        jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_state.params)])
    )
    norms = {
        "grad_norm": Mean.of(grad_norm),
        "update_norm": Mean.of(update_norm),
        "param_norm": Mean.of(
            optax.tree.norm(quantized.dequantized(new_state.params))
        ),  # may overflow while all are finite; a quantized base's weights dequantized
        "params_finite": Min.of(params_finite),
        "lr": Last.of(schedule(state.applied)),
        "skipped_update": Mean.of(1.0 - finite.astype(jnp.float32)),
        "skipped_total": Max.of(new_state.skipped),
        "skipped_in_a_row": Max.of(new_state.skipped_in_a_row),
    }
    return new_state, norms


def accumulate(loss_fn, params, batch, m: int, trainable: str = "all"):
    """Sum of value-and-grad of ``loss_fn`` over m micro-batches (lax.scan); the
    gradient of the ``trainable`` parameters only (`lora.partition`; the rest frozen).

    ``loss_fn`` returns ``(loss, metrics)``, the loss of each micro-batch already
    scaled by the whole mini-batch's denominators (so the sum is the mini-batch loss
    exactly, but for the load-balancing loss, taken per micro-batch) and the metrics
    as mergeable values (`gspo_jax.metrics`), which merge into the mini-batch's.
    Returns (loss, the mini-batch's metrics, still mergeable, grads).

    Memory: the accumulator and the current micro-batch's gradient are both whole f32
    gradients when they are added (42.9 GiB of the 16-layer benchmark model's 118 GiB
    train step on an H200, docs/memory.md). Accumulating in place would need each
    layer's backward to add into the accumulator's slice; JAX's transpose of the layer
    scan writes a fresh stacked gradient instead. Not done.
    """
    params, frozen = lora.partition(params, trainable)
    if frozen is not None:
        full_loss = loss_fn
        loss_fn = lambda p, b: full_loss(lora.join(p, frozen), b)  # noqa: E731
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if m == 1:
        (loss, metrics), grads = grad_fn(params, batch)
        return loss, metrics, grads

    def body(carry, mb):
        loss_acc, grads_acc = carry
        (loss, metrics), grads = grad_fn(params, mb)
        return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), stacked = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros), split_micro(batch, m)
    )
    return loss, metrics_lib.reduce_all(stacked), grads


def _accumulate_packed(loss_fn, params, batch, plan: packing.Plan, m: int, trainable: str):
    """`accumulate` over the micro-batches of a packing ``plan``: only its ``plan.used``
    ones are computed (a ``while`` loop from zero; ``m`` is the most it may use), each the
    rows it packs, and their metrics merged as they come."""
    params, frozen = lora.partition(params, trainable)

    def loss_j(p, j):
        return loss_fn(p if frozen is None else lora.join(p, frozen), batch, packed=(plan, j))

    grad_fn = jax.value_and_grad(loss_j, has_aux=True)
    if m == 1:
        (loss, metrics), grads = grad_fn(params, 0)
        return loss, metrics, grads

    def body(j, carry):
        loss_acc, grads_acc, metrics_acc = carry
        (loss, metrics), grads = grad_fn(params, j)
        merged = {k: v.merge(metrics[k]) for k, v in metrics_acc.items()}
        return loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads), merged

    (_, shapes), _ = jax.eval_shape(grad_fn, params, 0)
    start = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(jnp.zeros_like, params),
        metrics_lib.nothing_like(shapes),
    )
    loss, grads, metrics = jax.lax.fori_loop(0, plan.used, body, start)
    return loss, metrics, grads


def has_signal(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """bool[]: some valid token has a non-zero advantage (f32[N] or f32[N,T])."""
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    return jnp.any((adv != 0) & (mask > 0))


# --------------------------------------------------------------------------
# The policy update.


def router_tokens(batch: Batch) -> jax.Array:
    """f32[]: the positions the router sees as valid (the model's attention mask)."""
    return jnp.sum(sequence_inputs(batch)[3].astype(jnp.float32))


def policy_loss(
    params, batch: Batch, *, graphdef, cfg: StepConfig, norm, num_router_tokens, packed=None
):
    """The objective on one (micro-)batch, scaled by whole-mini-batch denominators.

    ``norm`` holds the mini-batch's response counts (`objectives.normalizer`) and
    ``num_router_tokens`` its `router_tokens`. ``packed`` = (plan, j): the micro-batch
    is micro-batch j of a packing plan of ``batch`` (`gspo_jax.packing`): the forward
    runs on its buffers, and the objective reads the whole mini-batch's rows with the
    others masked out (their log-probs pi_old's, so that nothing there is computed
    from garbage). Returns ``(loss, metrics)``, the metrics as mergeable values
    (`gspo_jax.metrics`): each says how it merges over micro-batches.
    """
    model = nnx.merge(graphdef, params)
    replay = batch.get("replay")
    critic = cfg.value_coef > 0
    # The router shift gamma (RSPO's, which floors it at its gamma_min) reads the
    # current router's log-probs at the experts pi_old used (``at_topk``).
    f = forward(
        model,
        batch,
        replay,
        values=critic,
        temperature=cfg.temperature,
        at_topk=batch["old_topk"],
        packed=packed,
    )
    mask = batch["mask"].astype(jnp.float32)
    logp, entropy, values, new_router_lp = f.logp, f.entropy, f.values, f.router_logp
    if f.computed is not None:  # a packed micro-batch: its rows count, the others are inert
        mask = mask * f.computed
        logp = jnp.where(f.computed, logp, jax.lax.stop_gradient(batch["old_logp"]))
        new_router_lp = jnp.where(
            f.computed[..., None, None], new_router_lp, batch["old_router_logp"]
        )
        if critic:
            values = jnp.where(f.computed, values, batch["old_values"])
    shift = routing.router_logp_shift(batch["old_router_logp"], new_router_lp)  # [N,T,L]
    gamma_raw = routing.gamma_of_shift(shift)
    fn = objectives.get(cfg.objective)
    loss, metrics = fn.apply(
        logp,
        batch["old_logp"],
        batch["advantages"],
        mask,
        ref_logp=batch.get("ref_logp"),
        router_shift=gamma_raw if fn.needs_router_shift else None,
        normalizer=norm,
        weight=batch.get("rc_weight"),  # rollout correction (None: off)
        hp=cfg.hparams,
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
    # per micro-batch and averaged (as MoE trainers do; weighted by the micro-batch's
    # share of the positions when packed, whose micro-batches vary in number); exact
    # only with one micro-batch.
    router_positions = f.router_tokens
    z_share = router_positions / jnp.maximum(num_router_tokens, 1.0)
    lb_share = z_share if packed is not None else 1.0 / cfg.micro_batches
    loss = loss + cfg.aux_loss_coef * f.aux_loss * lb_share + cfg.z_loss_coef * f.z_loss * z_share
    metrics.update(entropy=Mean.masked(jax.lax.stop_gradient(entropy), mask))
    # k3 estimate of KL(pi_old || pi_theta) on pi_old's tokens: at the first update of a
    # rollout, under trust_region 'behaviour', the behaviour-vs-proximal KL.
    log_r = jax.lax.stop_gradient(logp - batch["old_logp"])
    metrics.update(kl_k3=Mean.masked(jnp.expm1(log_r) - log_r, mask))
    # Means over micro-batches: weighted by their routed positions when packed (their
    # number varies), equally when padded (equal micro-batches).
    per_micro = router_positions if packed is not None else 1.0
    metrics.update(
        aux_loss=Mean.of(f.aux_loss, weight=per_micro),
        z_loss=Mean.of(f.z_loss, weight=router_positions),
    )
    gamma = jnp.maximum(gamma_floor(cfg), gamma_raw)
    metrics.update(routing_metrics(batch, f, mask, shift, gamma_raw, gamma, per_micro))
    return loss, metrics


def gamma_floor(cfg: StepConfig) -> float:
    """The floor of the ``router_shift_mean`` / ``router_shift_min`` diagnostics: RSPO's
    ``gamma_min`` under RSPO (the gamma its loss uses), RSPO's default floor under every
    other objective (the gamma RSPO would use at its defaults)."""
    return getattr(cfg.hparams, "gamma_min", objectives.get("rspo").defaults["gamma_min"])


def routing_metrics(batch: Batch, f, mask, shift, gamma_raw, gamma, per_micro=1.0) -> dict:
    """The routing diagnostics of one update (docs/objectives.md, "Stability diagnostics").

    Flips compare the current *free* router's top-K (what it would choose, whatever
    replay forces) with pi_old's free top-K (``old_free_topk``) and with the
    sampler's routing (``sampler_topk``, when given), so they read the same under no
    replay, R2 and R3. The router shift is reported raw (mean |delta log p| at pi_old's
    experts, and gamma before the floor) besides the floored ``gamma`` (`gamma_floor`).
    """
    num_tokens = jnp.sum(mask)
    free_topk = f.free_topk  # the forward's (`gspo_jax.passes.Forward`)

    def per_layer(name, layer_values):  # f32[L] -> the layer vector and its mean
        overall = jnp.mean(layer_values) if layer_values.size else jnp.zeros(())
        return {
            f"{name}_layer": Mean.of(layer_values, weight=num_tokens),
            name: Mean.of(overall, weight=num_tokens),
        }

    layer_shift = jnp.einsum("ntl,nt->l", shift, mask) / jnp.maximum(num_tokens, 1.0)
    out = {
        **per_layer(
            "flip_frac", routing.expert_flip_fraction(batch["old_free_topk"], free_topk, mask)
        ),
        "token_flip_rate": Mean.of(
            routing.token_flip_rate(batch["old_free_topk"], free_topk, mask), weight=num_tokens
        ),
        **per_layer("router_shift_raw", layer_shift),
        "gamma_raw_mean": Mean.masked(gamma_raw, mask),
        "gamma_raw_min": Min.masked(gamma_raw, mask, empty=1.0),
        "router_shift_mean": Mean.masked(gamma, mask),
        "router_shift_min": Min.masked(gamma, mask, empty=1.0),
    }
    if "sampler_topk" in batch:
        flips = routing.expert_flip_fraction(batch["sampler_topk"], free_topk, mask)
        out.update(per_layer("flip_frac_vs_sampler", flips))
    if batch.get("replay") is not None:
        mismatch = f.replay_mismatch  # f32[L], a rate over all routed positions
        w = per_micro  # the micro-batch's weight (`policy_loss`)
        out["replay_mismatch_layer"] = Mean.of(mismatch, weight=w)
        out["replay_mismatch"] = Mean.of(jnp.mean(mismatch) if mismatch.size else 0.0, weight=w)
    return out


def train_step(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    graphdef,
    optimizer,
    schedule,
    cfg: StepConfig,
):
    """One optimizer update on a mini-batch, accumulated over micro-batches.

    ``batch`` holds the rollout layout of the module docstring plus ``old_logp``,
    ``advantages``, ``old_topk``, ``old_free_topk``, ``old_router_logp`` and,
    optionally, ``ref_logp``, ``replay``, ``sampler_topk`` and ``rc_weight`` (the
    rollout correction). A mini-batch whose advantages are all zero makes no update
    unless ``cfg.update_without_signal`` (``no_signal`` = 1 in its metrics).
    Returns (the new state, the update's metrics, each of its kind in
    `gspo_jax.metrics`: `gspo_jax.metrics.compute_all` gives the numbers, and an RL
    step merges its updates' by the same rule).
    ``rng`` is unused by the current objectives (no dropout) and kept so that
    stochastic regularisers need no API change.
    """
    del rng
    norm = objectives.normalizer(batch["mask"])
    valid = sequence_inputs(batch)[3]  # the input positions the router sees as real
    loss_fn = functools.partial(
        policy_loss,
        graphdef=graphdef,
        cfg=cfg,
        norm=norm,
        num_router_tokens=jnp.sum(valid.astype(jnp.float32)),
    )
    if cfg.packing is None:
        loss, metrics, grads = accumulate(
            loss_fn, state.params, batch, cfg.micro_batches, cfg.trainable
        )
        computed = jnp.asarray(valid.size, jnp.float32)
    else:
        plan = packing.plan(valid, cfg.packing)
        loss, metrics, grads = _accumulate_packed(
            loss_fn, state.params, batch, plan, cfg.packing.micro, cfg.trainable
        )
        computed = packing.computed_slots(plan, cfg.packing)
    # The positions the forward computed, and the share of them that are real tokens.
    metrics.update(
        computed_tokens=Sum.of(computed),
        real_token_share=Mean.of(jnp.sum(valid) / computed, weight=computed),
    )
    signal = has_signal(batch["advantages"], batch["mask"])
    new_state, norms = apply_update(
        state,
        grads,
        loss,
        optimizer,
        schedule,
        apply=signal | cfg.update_without_signal,
        trainable=cfg.trainable,
    )
    no_signal = Sum.of(1.0 - signal.astype(jnp.float32))
    return new_state, dict(metrics, loss=Mean.of(loss), no_signal=no_signal, **norms)
