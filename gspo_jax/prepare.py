"""Stages 4-6 of an RL step as one program: from a collected batch to what the updates
read.

    prepare_batch(params, reference, dev, rewards, step)      one jit, its switches static
      4. old pass     pi_old's log-probs and routing (R2's replay, RSPO's router
                      log-probs), the critic's values; pi_old by updates.trust_region
         reference    pi_ref's log-probs (a KL term): its own parameters, or with LoRA
                      the state's parameters with the adapters off
      5. advantages   a group estimator over each group's rewards (vmapped over groups),
                      or GAE from the critic's values
      6. correction   the rollout correction's weights; the train-inference mismatch and
                      staleness diagnostics

What runs is decided by `PrepareConfig`, made once per run from the loaded config
(`PrepareConfig.of`), so a step's device work reads in one place and compiles once: one
program per run, dispatched once per step, with nothing coming back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from gspo_jax import advantages as adv_lib
from gspo_jax import lora_training, offpolicy, passes
from gspo_jax import metrics as metrics_lib
from gspo_jax import packing as packing_lib
from gspo_jax.objectives.correction import RolloutCorrection

# Under updates.trust_region='behaviour', pi_old's routing references are the sampler's:
# the experts it used and its router's log-probs there (RSPO's router shift).
BEHAVIOUR_REFERENCES = {
    "old_topk": "sampler_topk",
    "old_free_topk": "sampler_topk",
    "old_router_logp": "sampler_router_logp",
}
# What the updates read of the collected batch as it is.
BATCH_KEYS = ("prompt_tokens", "prompt_mask", "tokens", "mask")
REFERENCES = ("none", "full", "lora")


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """The static switches of the prepare program (hashable; bound before jit).

    estimator: ``config.advantage``: a group estimator (`adv_lib.GROUP_ESTIMATORS`) or
      'gae' (PPO's critic: the old pass returns values).
    reference: how pi_ref's log-probs are made: 'none' (no KL term), 'full' (its own
      parameters), 'lora' (the state's parameters with the adapters off, and the
      reference routers where the routers train).
    top_k: the model's experts per token (the empty routing references of a dense
      model under 'behaviour').
    packing: the log-prob passes' packed shape (`gspo_jax.packing`), or None: padded
      rows in ``logprob_micro_batches`` pieces.
    """

    estimator: str
    group_size: int
    gamma: float
    lam: float
    temperature: float
    logprob_micro_batches: int
    trust_region: str
    rollout_correction: RolloutCorrection
    routing_replay: str
    moe: bool
    reference: str
    top_k: int
    packing: packing_lib.Packing | None = None

    def __post_init__(self):
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")

    @classmethod
    def of(cls, cfg, model_cfg, reference: str, shapes=None) -> PrepareConfig:
        """The switches of a run: its loaded config ``cfg`` (`gspo_jax.run_config.RunConfig`),
        its model's ``model_cfg``, how its pi_ref is made (``reference``) and how the
        passes lay out the rows (``shapes``, `gspo_jax.packing.shapes`; None: padded, in
        ``updates.logprob_micro_batches`` pieces)."""
        if shapes is None:
            shapes = packing_lib.Shapes(None, None, 1, cfg.updates.logprob_micro_batches)
        return cls(
            estimator=cfg.advantage,
            group_size=cfg.rollout.group_size,
            gamma=cfg.gae.gamma,
            lam=cfg.gae.lam,
            temperature=cfg.rollout.temperature,
            logprob_micro_batches=shapes.logprob_micro_batches,
            trust_region=cfg.updates.trust_region,
            rollout_correction=cfg.rollout_correction,
            routing_replay=cfg.updates.routing_replay,
            moe=model_cfg.num_moe_layers > 0,
            reference=reference,
            top_k=model_cfg.top_k,
            packing=shapes.logprob,
        )

    @property
    def critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def behaviour(self) -> bool:
        return self.trust_region == "behaviour"

    @property
    def old_pass(self) -> bool:
        """Whether the old pass runs: always under 'decoupled' (pi_old is its log-probs);
        under 'behaviour' only for what nothing else gives, the critic's values and R2's
        routing."""
        return not self.behaviour or self.critic or self.routing_replay == "R2"


def gae_batch(seq_rewards, values, mask, *, gamma: float, lam: float):
    """GAE over response tokens with the sequence reward on its last token."""
    mask = mask.astype(jnp.float32)
    last = jnp.sum(mask, axis=1).astype(jnp.int32) - 1  # -1 for an empty response: no reward
    t = jnp.arange(mask.shape[1])[None, :]
    token_rewards = jnp.where(t == last[:, None], seq_rewards[:, None], 0.0) * mask
    return adv_lib.gae(token_rewards, values, mask, gamma=gamma, lam=lam)


def group_batch(rewards, *, estimator: str, group_size: int):
    """A group estimator over the batch's rows, f32[N] -> f32[N]: row i is sample
    i % G of prompt i // G, as the rollout lays them out."""
    per_prompt = adv_lib.GROUP_ESTIMATORS.get(estimator)(rewards.reshape(-1, group_size))
    return per_prompt.reshape(-1)


def behaviour_references(dev, cfg: PrepareConfig) -> dict[str, jax.Array]:
    """pi_old's routing references under trust_region 'behaviour': the sampler's
    (`BEHAVIOUR_REFERENCES`); a dense model's are empty, as its old pass's are."""
    if cfg.moe:
        return {k: dev[v] for k, v in BEHAVIOUR_REFERENCES.items()}
    empty = jnp.zeros(dev["tokens"].shape + (0, cfg.top_k), jnp.int32)
    return {"old_topk": empty, "old_free_topk": empty, "old_router_logp": empty + 0.0}


def prepare_batch(params, reference, dev, rewards, step, *, graphdef, cfg: PrepareConfig):
    """The device batch of the updates, and the step's diagnostics.

    Args:
      params: the state's parameters (pi_old's under 'decoupled').
      reference: pi_ref's parameters ('full'), the reference routers or None ('lora'),
        or None ('none').
      dev: the collected batch on the devices (`gspo_jax.collect`): the rows, the
        sampler's log-probs (``rollout_logp``) and routing record, ``policy_version``.
      rewards: f32[N] the rows' shaped rewards, on the devices.
      step: int32[] this RL step (the staleness of each row is step - its version).

    Returns:
      (batch, info): the batch the objectives read (``advantages``, ``old_logp`` and
      pi_old's routing references, ``rc_weight``, ``replay``, ``ref_logp``, the critic's
      ``returns`` and ``old_values``), and the staleness, mismatch and rollout-correction
      metrics as numbers.
    """
    logp_pass = functools.partial(
        passes.logprob_pass,
        graphdef=graphdef,
        temperature=cfg.temperature,
        micro_batches=cfg.logprob_micro_batches,
        packing_shape=cfg.packing,
    )
    batch = {k: dev[k] for k in BATCH_KEYS}
    old = None
    if cfg.old_pass:  # R3 replays the sampler's routing in pi_old's pass too
        replay_key = "replay_r3" if cfg.routing_replay == "R3" else None
        old = logp_pass(params, dev, replay_key=replay_key, values=cfg.critic)
    if cfg.critic:
        a, returns = gae_batch(rewards, old["values"], dev["mask"], gamma=cfg.gamma, lam=cfg.lam)
        batch.update(advantages=a, returns=returns, old_values=old["values"])
    else:
        batch["advantages"] = group_batch(
            rewards, estimator=cfg.estimator, group_size=cfg.group_size
        )
    proximal = None if cfg.behaviour else old["logp"]
    batch["old_logp"], weight, rc_metrics = offpolicy.trust_region_inputs(
        cfg.trust_region, dev["rollout_logp"], proximal, dev["mask"], cfg.rollout_correction
    )
    if weight is not None:
        batch["rc_weight"] = weight
    if cfg.behaviour:
        batch.update(behaviour_references(dev, cfg))
    else:
        batch.update(
            old_topk=old["topk_resp"],
            old_free_topk=old["free_topk_resp"],
            old_router_logp=old["router_logp"],
        )
    if cfg.moe:  # the sampler's routing at the response positions
        if "sampler_topk" in dev:
            batch["sampler_topk"] = dev["sampler_topk"]
        else:
            p, t = dev["prompt_tokens"].shape[1], dev["tokens"].shape[1]
            batch["sampler_topk"] = passes.response_slice(dev["replay_r3"], p, t)
    if cfg.routing_replay == "R2":
        batch["replay"] = old["topk"]
    elif cfg.routing_replay == "R3":
        batch["replay"] = dev["replay_r3"]
    # pi_ref always routes freely (it is pi_ref, not pi_ref under pi's routing).
    if cfg.reference == "full":
        batch["ref_logp"] = logp_pass(reference, dev)["logp"]
    elif cfg.reference == "lora":
        batch["ref_logp"] = logp_pass(lora_training.reference(params, reference), dev)["logp"]
    info: dict[str, Any] = offpolicy.staleness_metrics(dev["policy_version"], dev["mask"], step)
    if old is not None:  # the positions each log-prob pass computed, and their real share
        valid = jnp.sum(passes.sequence_inputs(dev)[3])
        info.update(logprob_computed_tokens=old["computed_tokens"])
        info.update(logprob_real_token_share=valid / old["computed_tokens"])
    if not cfg.behaviour:
        info.update(
            passes.mismatch_metrics(
                dev["rollout_logp"],
                old["logp"],
                dev["mask"],
                batch.get("sampler_topk"),
                old["free_topk_resp"] if cfg.moe else None,
            )
        )
    if rc_metrics:
        info.update(metrics_lib.compute_all(rc_metrics))
    return batch, info
