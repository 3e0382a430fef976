"""One RL step: sample, score, shape and filter, the old (and reference, value) passes,
advantages, the rollout correction, the updates and the step's summary.

    RLPhase.step(s)
      collect        1. sample     G responses to each of the step's prompts (Trainer.rollout)
                     2. score      the task's verifier (Trainer.score)
                     3. filter     DAPO's overlong shaping and dynamic sampling; the batch
                                   assembled on the devices from the kept rows
      prepare        4. old pass   pi_old's log-probs and routing (R2), pi_ref's, the critic's
                     5. advantages group (vmap over groups) or GAE, all here
                     6. correction the rollout correction's weights
      updates        7. num_epochs x num_minibatches calls of gspo_jax.step.train_step
      summary        8. the updates' metrics merged by their kind (gspo_jax.metrics)

Host traffic: the rollout stays on the devices. Only the response token ids, lengths
and truncation flags come to the host (to decode and score them, and for the step's
metrics); the batch is assembled on the devices from row indices (dynamic sampling's
selection, the fill), and the mini-batches are gathered there too. One prompt length
(``rollout.max_prompt_len``) and one batch shape serve the whole run: the sampler, the
log-prob passes and the train step compile once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import advantages as adv_lib
from gspo_jax import metrics as metrics_lib
from gspo_jax import offpolicy, passes, shaping, step
from gspo_jax.models.precision import inference_params
from gspo_jax.models.sharding import BATCH_AXES, on_mesh
from gspo_jax.objectives.correction import RolloutCorrection
from gspo_jax.rollout import replay_r3
from gspo_jax.run_config import RunConfig
from gspo_jax.trainer import Trainer

# Metrics whose value after the first update (k = 0) and after the last update of a
# rollout the RL-step record keeps besides their mean: how far the policy and its
# router drift from pi_old within one rollout.
DRIFT_METRICS = (
    "flip_frac",
    "flip_frac_vs_sampler",
    "token_flip_rate",
    "router_shift_raw",
    "gamma_raw_mean",
    "ppo_kl",
    "logratio_abs_max",
    "frac_ratio_gt_2",
    "clip_frac",
)


def summarize_updates(ms: list[metrics_lib.MetricDict]) -> tuple[dict, list[dict]]:
    """One RL step's summary of its updates' metrics, and each update's numbers (the
    records of ``updates.jsonl``).

    Every figure of the summary is its updates' metrics merged by their kind
    (`gspo_jax.metrics.merge_all`): fractions and means over all the step's tokens,
    pooled standard deviations, maxima of maxima, the learning rate of the last
    update, the count of mini-batches with no signal (``no_signal_minibatches``). For
    `DRIFT_METRICS` the values of the first (``<name>_k0``), second (``<name>_k1``)
    and last (``<name>_klast``) update are kept as well. An update's metrics are
    measured in its forward pass, at the parameters before it: k = 0 is at pi_old
    (nothing has drifted yet), k = 1 after one update.
    """
    per_update = jax.device_get([metrics_lib.compute_jit(m) for m in ms])
    out = jax.device_get(metrics_lib.merged_jit(ms))
    out["no_signal_minibatches"] = out.pop("no_signal")
    for k in DRIFT_METRICS:
        if k in out:
            out[f"{k}_k0"], out[f"{k}_klast"] = per_update[0][k], per_update[-1][k]
            if len(ms) > 1:  # measured after one update (k = 0 is at pi_old itself)
                out[f"{k}_k1"] = per_update[1][k]
    return out, per_update


@dataclasses.dataclass
class _Round:
    """One sampling round of :meth:`Trainer.collect`."""

    rollout: Any  # the Rollout, on the devices
    host: dict[str, np.ndarray]  # lengths and truncation flags of every row (Trainer.score)
    rewards: np.ndarray  # [n * G], shaped (Trainer.shape_and_filter)
    components: dict[str, np.ndarray]  # the reward's components (rewards.score)
    fails: dict[str, int]  # verifier failure counts
    rows: np.ndarray  # int[kept * G]: the rollout rows of the kept groups
    groups_kept: int
    prompts_truncated: int
    sample_time: float


# Under updates.trust_region='behaviour', pi_old's routing references are the sampler's:
# the experts it used and its router's log-probs there (RSPO's router shift).
BEHAVIOUR_REFERENCES = {
    "old_topk": "sampler_topk",
    "old_free_topk": "sampler_topk",
    "old_router_logp": "sampler_router_logp",
}

# The Rollout's arrays the training batch is assembled from (`_assemble`); the
# routing record only where the sampler kept it.
_BATCH_FIELDS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "truncated", "logp")
_ROUTING_FIELDS = {
    "all": ("experts", "router_logp", "prompt_experts"),
    "response": ("experts", "router_logp"),
    "none": (),
}


def _assemble(parts, src_round, src_row, valid, *, overlong_filter: bool):
    """The training batch, on the devices, from the rollouts of a step's sampling
    rounds: row i is row ``src_row[i]`` of round ``src_round[i]``; ``valid`` 0 marks
    padding rows (their mask is 0: dynamic sampling fell short).

    ``parts``: per round, a dict of the Rollout's arrays (`_BATCH_FIELDS`, plus
    ``experts`` and ``prompt_experts`` where the sampler kept them); a fixed number of
    them (`Trainer.fill_batch` repeats round 0 for rounds not sampled), so that one
    program serves every step. Returns the batch layout of :mod:`gspo_jax.step`:
    ``prompt_tokens``, ``prompt_mask`` (f32), ``tokens``, ``mask`` (overlong
    filtering applied), ``rollout_logp`` (the sampler's log-probs of the
    distribution that drew the tokens), ``sampler_topk`` (the sampler's routing at
    the response positions) and ``replay_r3`` (R3: the sampler's routing at every
    input position [0, P+T-1)), the last two where the record is there.
    """

    def take(key):
        out = jnp.take(parts[0][key], src_row, axis=0)
        for r in range(1, len(parts)):
            sel = (src_round == r).reshape((-1,) + (1,) * (out.ndim - 1))
            out = jnp.where(sel, jnp.take(parts[r][key], src_row, axis=0), out)
        return out

    mask = take("mask").astype(jnp.float32)
    if overlong_filter:
        mask = shaping.overlong_mask(take("truncated"), mask)
    batch = {
        "prompt_tokens": take("prompt_tokens"),
        "prompt_mask": take("prompt_mask").astype(jnp.float32),
        "tokens": take("tokens"),
        "mask": mask * valid[:, None],
        "rollout_logp": take("logp"),
    }
    if "experts" in parts[0]:
        # The sampler's routing of the position that produced each response token.
        batch["sampler_topk"] = take("experts")
        # ... and its router's log-probs at those experts (the behaviour policy's router).
        batch["sampler_router_logp"] = take("router_logp")
    if "prompt_experts" in parts[0]:
        batch["replay_r3"] = replay_r3(take("prompt_experts"), batch["sampler_topk"])
    return batch


def _gae_batch(seq_rewards, values, mask, *, gamma: float, lam: float):
    """GAE over response tokens with the sequence reward on its last token."""
    mask = mask.astype(jnp.float32)
    last = jnp.sum(mask, axis=1).astype(jnp.int32) - 1  # -1 for an empty response: no reward
    t = jnp.arange(mask.shape[1])[None, :]
    token_rewards = jnp.where(t == last[:, None], seq_rewards[:, None], 0.0) * mask
    return adv_lib.gae(token_rewards, values, mask, gamma=gamma, lam=lam)


def _permutations(key, *, n: int, epochs: int) -> jax.Array:
    """int32[epochs, n]: the mini-batch order of each epoch of one rollout's updates
    (epoch e: ``permutation(fold_in(key, e), n)``)."""
    perm = lambda e: jax.random.permutation(jax.random.fold_in(key, e), n)
    return jnp.stack([perm(e) for e in range(epochs)]).astype(jnp.int32)


def _minibatch(batch: dict[str, jax.Array], perm, epoch, j, *, size: int) -> dict[str, jax.Array]:
    """Mini-batch ``j`` of epoch ``epoch``: the rows ``perm[epoch, j*size : (j+1)*size]``
    of every array of the batch, gathered on the devices (``epoch``, ``j`` traced)."""
    idx = jax.lax.dynamic_slice_in_dim(perm[epoch], j * size, size)
    return {k: jnp.take(v, idx, axis=0) for k, v in batch.items()}


def shape_and_filter(
    cfg: RunConfig, host, r: np.ndarray, correct: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Stage 3, shape and filter (DAPO, ``config.dapo``), on one round (``host``: the row lengths
    `score` returns): the soft overlong punishment added to the rewards ``r``; dynamic
    sampling keeps only the groups whose correctness differs (``correct``, the
    verifier's 0/1 per response: DAPO filters on accuracy, not on the shaped
    reward, so a length penalty or a format reward cannot keep a group whose
    answers are all right or all wrong). Overlong filtering (the mask of truncated
    responses zeroed) happens on the devices, in `_assemble`. Returns (the shaped
    rewards of every response, the rows of the kept groups, the number of groups
    kept)."""
    g, T = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    if cfg.dapo.soft_overlong:
        length = np.asarray(host["lengths"], np.float32)
        r = r + jax.device_get(
            shaping.soft_overlong_penalty(
                jnp.asarray(length), max_len=T, cache_len=cfg.dapo.overlong_cache_len
            )
        )
    keep = (
        jax.device_get(shaping.dynamic_sampling_keep(jnp.asarray(correct).reshape(-1, g)))
        if cfg.dapo.dynamic_sampling
        else np.ones(len(r) // g, bool)
    )
    rows = np.flatnonzero(np.repeat(keep, g))
    return r, rows, int(keep.sum())


def rl_optimizer(cfg: RunConfig):
    """The RL phase's optimizer and schedule (``config.optimizer``), over every update of
    the run (``total_rl_steps x num_minibatches x num_epochs``)."""
    updates_per_step = cfg.updates.num_minibatches * cfg.updates.num_epochs
    return step.make_optimizer(
        lr=cfg.optimizer.lr,
        schedule=cfg.optimizer.schedule,
        total_steps=cfg.total_rl_steps * updates_per_step,
        warmup_steps=cfg.optimizer.warmup_steps,
        end_lr_ratio=cfg.optimizer.end_lr_ratio,
        weight_decay=cfg.optimizer.weight_decay,
        b1=cfg.optimizer.b1,
        b2=cfg.optimizer.b2,
        grad_clip=cfg.optimizer.grad_clip,
        mu_dtype=cfg.optimizer.mu_dtype,
    )


class RLPhase:
    """The RL phase of a run: its state, its compiled functions and one step
    (`RLPhase.step`). ``trainer``: the run's parts; ``params``: where RL starts (the
    warm start's parameters), which are also the reference policy of a KL term."""

    def __init__(self, trainer: Trainer, params):
        self.t, self.c, self.cfg = trainer, trainer.c, trainer.cfg
        c = trainer.c
        cfg = trainer.cfg
        self.updates_per_step = cfg.updates.num_minibatches * cfg.updates.num_epochs
        self.optimizer, self.sched = rl_optimizer(trainer.cfg)
        self.step_cfg = step.StepConfig(
            objective=c.objective.name,
            hparams=tuple(sorted(dict(c.objective.hparams).items())),
            micro_batches=cfg.updates.micro_batches,
            aux_loss_coef=cfg.updates.aux_loss_coef,
            z_loss_coef=cfg.updates.z_loss_coef,
            entropy_coef=cfg.entropy_coef,
            value_coef=cfg.gae.value_coef if c.advantage == "gae" else 0.0,
            value_clip=cfg.gae.value_clip,
            temperature=cfg.rollout.temperature,
            update_without_signal=cfg.updates.update_without_signal,
        )
        self.rollout_correction = RolloutCorrection(**dict(c.rollout_correction))
        # The routing record the training rollouts keep: R3 replays all of it; an MoE
        # model's mismatch metrics compare the response tokens' with the trainer's.
        self.routing = offpolicy.routing_record(cfg, trainer.model_cfg)
        self.assemble_fn = jax.jit(
            functools.partial(_assemble, overlong_filter=cfg.dapo.overlong_filter),
            # on the sampler's devices; `queued` moves it to the training mesh
            out_shardings=NamedSharding(trainer.sampler_mesh, P(BATCH_AXES)),
        )
        # The reference policy is where RL starts; copied, as the state is donated, and
        # held in the compute dtype (the same logits; docs/memory.md).
        self.ref_params = inference_params(params, trainer.model_cfg) if trainer.kl_coef else None
        self.state = trainer.new_state(params, self.optimizer)
        self.train_fn = trainer.jit_step(
            step.train_step,
            self.state,
            optimizer=self.optimizer,
            schedule=self.sched,
            cfg=self.step_cfg,
        )
        replay = c.updates.routing_replay
        self.critic = c.advantage == "gae"
        self.moe = trainer.model_cfg.num_moe_layers > 0
        logp_pass = functools.partial(
            passes.logprob_pass,
            graphdef=trainer.graphdef,
            values=self.critic,
            temperature=cfg.rollout.temperature,
            micro_batches=cfg.updates.logprob_micro_batches,
        )
        # The old policy's pass replays the sampler's routing under R3; the reference
        # policy's always routes freely (it is pi_ref, not pi_ref under pi's routing).
        self.logp_fn = on_mesh(
            jax.jit(
                functools.partial(logp_pass, replay_key="replay_r3" if replay == "R3" else None)
            ),
            trainer.mesh,
        )
        self.ref_logp_fn = on_mesh(
            jax.jit(functools.partial(logp_pass, replay_key=None)), trainer.mesh
        )
        self.gae_fn = jax.jit(functools.partial(_gae_batch, gamma=cfg.gae.gamma, lam=cfg.gae.lam))
        self.trust_region_fn = jax.jit(
            functools.partial(
                offpolicy.trust_region_inputs,
                cfg.updates.trust_region,
                rc=self.rollout_correction,
            )
        )
        self.mismatch_fn = jax.jit(passes.mismatch_metrics)
        self.staleness_fn = jax.jit(offpolicy.staleness_metrics)
        # Off-policy (gspo_jax.offpolicy): the queue of scored batches, the parameters
        # the sampler reads, and which policy the trust region is around.
        self.queue: collections.deque[offpolicy.QueuedBatch] = collections.deque()
        self.sampler_params = None  # on the sampler's devices, when it has its own
        self.behaviour = cfg.updates.trust_region == "behaviour"
        self.old_pass = not self.behaviour or self.critic or replay == "R2"
        # The mini-batches: the permutation and the gather on the devices.
        n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        self.perm_fn = jax.jit(functools.partial(_permutations, n=n, epochs=cfg.updates.num_epochs))
        self.minibatch_fn = jax.jit(
            functools.partial(_minibatch, size=n // cfg.updates.num_minibatches),
            out_shardings=NamedSharding(trainer.mesh, P(BATCH_AXES)),
        )

    def prepare(self, queued: offpolicy.QueuedBatch, s: int):
        """Stages 4-6: the device batch with pi_old's (and the reference's) log-probs,
        routing records, advantages and the rollout correction; and the step's
        train-inference mismatch metrics. ``queued``: the batch `collect_batch` made
        (on the devices, but for the host ``rewards`` of its rows); ``s``: this step.

        ``updates.trust_region`` (docs/offpolicy.md): 'decoupled' recomputes pi_old at
        the step's parameters (the proximal policy) in the old pass, and the rollout
        correction weighs pi_old / pi_behaviour; 'behaviour' takes pi_old to be the
        sampler's own log-probs and routing (`BEHAVIOUR_REFERENCES`), and the old pass
        runs only for what nothing else gives: the critic's values, R2's routing.
        Nothing here waits for the devices: group advantages are computed first, so
        that their host part never queues behind the pass."""
        c = self.c
        dev = self.t.put_batch(queued.device)
        batch = {k: dev[k] for k in ("prompt_tokens", "prompt_mask", "tokens", "mask")}
        if not self.critic:
            batch.update(self.advantages(queued.rewards, None, dev["mask"]))
        old = self.logp_fn(self.state.params, dev) if self.old_pass else None
        if self.critic:
            batch.update(self.advantages(queued.rewards, old["values"], dev["mask"]))
        proximal = None if self.behaviour else old["logp"]
        batch["old_logp"], weight, rc_metrics = self.trust_region_fn(
            dev["rollout_logp"], proximal, dev["mask"]
        )
        if weight is not None:
            batch["rc_weight"] = weight
        if self.behaviour:
            batch.update(self.behaviour_references(dev))
        else:
            batch.update(
                old_topk=old["topk_resp"],
                old_free_topk=old["free_topk_resp"],
                old_router_logp=old["router_logp"],
            )
        if self.moe:  # the sampler's routing at the response positions
            if "sampler_topk" in dev:
                batch["sampler_topk"] = dev["sampler_topk"]
            else:
                p, t = dev["prompt_tokens"].shape[1], dev["tokens"].shape[1]
                batch["sampler_topk"] = passes.response_slice(dev["replay_r3"], p, t)
        if c.updates.routing_replay == "R2":
            batch["replay"] = old["topk"]
        elif c.updates.routing_replay == "R3":
            batch["replay"] = dev["replay_r3"]
        if self.ref_params is not None:
            batch["ref_logp"] = self.ref_logp_fn(self.ref_params, dev)["logp"]
        info = self.staleness_fn(dev["policy_version"], dev["mask"], np.int32(s))
        if not self.behaviour:
            info.update(
                self.mismatch_fn(
                    dev["rollout_logp"],
                    old["logp"],
                    dev["mask"],
                    batch.get("sampler_topk"),
                    old["free_topk_resp"] if self.moe else None,
                )
            )
        if rc_metrics:
            info.update(metrics_lib.compute_all(rc_metrics))
        return batch, info

    def behaviour_references(self, dev) -> dict[str, jax.Array]:
        """pi_old's routing references under trust_region 'behaviour': the sampler's
        (`BEHAVIOUR_REFERENCES`); a dense model's are empty, as its old pass's are."""
        if self.moe:
            return {k: dev[v] for k, v in BEHAVIOUR_REFERENCES.items()}
        shape = dev["tokens"].shape + (0, self.t.model_cfg.top_k)
        empty = jnp.zeros(shape, jnp.int32)
        return {"old_topk": empty, "old_free_topk": empty, "old_router_logp": empty + 0.0}

    def updates(self, batch, rng) -> tuple[list, list[dict]]:
        """Stage 7: ``num_epochs x num_minibatches`` train steps on the batch, dispatched
        (nothing waits here). Returns their metric states and where each update was."""
        cfg = self.cfg
        perm = self.perm_fn(jax.random.fold_in(rng, 1_000_003))
        ms, where = [], []
        for epoch in range(cfg.updates.num_epochs):
            for j in range(cfg.updates.num_minibatches):
                mini = self.minibatch_fn(batch, perm, np.int32(epoch), np.int32(j))
                self.state, m = self.train_fn(
                    self.state, mini, jax.random.fold_in(rng, 7 + len(ms))
                )
                ms.append(m)
                where.append({"k": len(where), "epoch": epoch, "minibatch": j})
        return ms, where

    def step(self, s: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One RL step: collect step s + k's batch (k = ``rollout.staleness``), train on
        step s's (sampled k steps ago; `gspo_jax.offpolicy`). Serially, the batch is
        collected first and then trained on (k = 0: the on-policy loop); with
        ``rollout.overlap`` the updates are dispatched first and the next batch is
        sampled and scored on the sampler's devices while they run. Returns the step's
        summary metrics and one record per optimizer update (``k``: its index within
        the rollout)."""
        cfg = self.cfg
        k = cfg.rollout.staleness
        rng = jax.random.fold_in(jax.random.key(self.c.seed + 1), s)
        self.fill_queue(s)
        t0 = time.perf_counter()
        if cfg.rollout.overlap:
            queued = self.queue.popleft()
            batch, pinfo = self.prepare(queued, s)
            ms, where = self.updates(batch, rng)
            t1 = t2 = time.perf_counter()  # dispatched: the sampler side runs now
            self.queue.append(self.collect_batch(s + k, version=s))
            t_collected = time.perf_counter()
        else:
            self.queue.append(self.collect_batch(s + k, version=s))
            t1 = time.perf_counter()
            queued = self.queue.popleft()
            batch, pinfo = self.prepare(queued, s)
            jax.block_until_ready(batch)
            t2 = time.perf_counter()
            ms, where = self.updates(batch, rng)
        m, per_update = summarize_updates(ms)  # fetches the numbers: the updates are done
        pinfo, mask_sum = jax.device_get((pinfo, jnp.sum(batch["mask"])))
        t3 = time.perf_counter()
        if self.t.sampler_devices.split:  # the new parameters to the sampler's devices
            self.sampler_params = self.t.sampler_devices.publish(self.state.params)
        updates = [dict(w, **u) for w, u in zip(where, per_update)]
        m.update(queued.info)
        m.update(pinfo)
        m.update(self._behaviour_metrics(pinfo, per_update[0]))
        step_time = t3 - t0
        trained_tokens = float(mask_sum) * cfg.updates.num_epochs
        m.update(
            step_time=step_time,
            rollout_time=t1 - t0,
            old_logp_time=t2 - t1,
            update_time=t3 - t2,
            tokens_per_s=(queued.info["gen_tokens"] + trained_tokens) / step_time,
        )
        if cfg.rollout.overlap:  # which side the step waited on
            m.update(collect_time=t_collected - t1, train_wait_time=t3 - t_collected)
        return m, updates

    def _behaviour_metrics(self, pinfo, first_update) -> dict[str, float]:
        """KL(pi_behaviour || pi_proximal) (k3 estimate) and F(2), the share of tokens
        whose ratio is outside [1/2, 2]: from the old pass over the whole batch
        ('decoupled'), or from the first update's forward, at the step's parameters, over
        its mini-batch ('behaviour', which runs no old pass)."""
        if self.behaviour:
            return {
                "behaviour_kl": first_update["kl_k3"],
                "behaviour_f2": first_update["frac_ratio_gt_2"],
            }
        return {"behaviour_kl": pinfo["mismatch_kl"], "behaviour_f2": pinfo["mismatch_f2"]}

    # ---- the queue of scored batches (gspo_jax.offpolicy) --------------------

    def fill_queue(self, s: int) -> None:
        """Before step s: batches s ... s + k - 1 in the queue. Only at a fresh start is
        anything sampled here (by the parameters RL starts from); a resume restores the
        queue from its checkpoint (`load_checkpoint`)."""
        k = self.cfg.rollout.staleness
        while len(self.queue) < k:
            self.queue.append(self.collect_batch(s + len(self.queue), version=s))

    def sampling_params(self):
        """The parameters the sampler reads: the state's, or their copy on the sampler's
        own devices (published after each step)."""
        if not self.t.sampler_devices.split:
            return self.state.params
        if self.sampler_params is None:
            self.sampler_params = self.t.sampler_devices.publish(self.state.params)
        return self.sampler_params

    def collect_batch(self, j: int, *, version: int) -> offpolicy.QueuedBatch:
        """Batch j (its data and RNG are step j's), sampled and scored by the current
        parameters, RL step ``version``'s, on the training mesh."""
        with self.t.sampler_context():
            rng = jax.random.fold_in(jax.random.key(self.c.seed + 1), j)
            collected, info = self.collect(self.sampling_params(), j, rng)
        return self.queued(collected, info, step=j, version=version)

    def queued(self, collected, info, *, step: int, version: int) -> offpolicy.QueuedBatch:
        """`collect`'s batch as the queue holds it: on the training mesh (device to
        device if the sampler has its own), each row marked with ``version``."""
        collected = dict(collected)
        rewards = collected.pop("rewards")
        device = self.t.put_batch(collected)
        device["policy_version"] = self.t.put_rows(np.full(len(rewards), version, np.int32))
        return offpolicy.QueuedBatch(device, rewards, info, step=step, version=version)

    def checkpoint_items(self) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint holds: the train state (and, with staleness, the queue's
        device arrays), and the JSON record of the queue's host part."""
        if not self.cfg.rollout.staleness:
            return self.state, {}
        tree = {"train": self.state, "queue": [b.device for b in self.queue]}
        return tree, {"queue": [b.meta() for b in self.queue]}

    def checkpoint_target(self):
        """The restore target of `checkpoint_items`' tree."""
        return offpolicy.checkpoint_target(self.t, self.state)

    def load_checkpoint(self, tree, meta: dict[str, Any]) -> None:
        """Restore what `checkpoint_items` saved (tree onto `checkpoint_target`)."""
        if not self.cfg.rollout.staleness:
            self.state = tree
            return
        self.state = tree["train"]
        self.queue.clear()
        for device, record in zip(tree["queue"], meta["queue"]):
            self.queue.append(offpolicy.QueuedBatch.from_checkpoint(device, record))
        self.sampler_params = None

    def collect(self, params, step_idx: int, rng) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Stages 1-3: rollouts, rewards and DAPO's filters for one RL step.

        Rounds of sample -> score -> shape and filter, until the kept groups fill
        the batch (one round without dynamic sampling); then the batch is filled
        and given its advantages. Returns the batch (without old log-probs), on the
        devices, and host metrics. Of the rollouts only the response token ids,
        lengths and truncation flags came to the host (`score`).
        """
        c = self.c
        cfg = self.cfg
        n_prompts = cfg.rollout.prompts_per_step
        max_rounds = cfg.dapo.max_sampling_rounds if c.dapo.dynamic_sampling else 1
        rounds: list[_Round] = []
        for rnd in range(max_rounds):
            # Round r of step s reads prompts at position (s * max_rounds + r) * n_prompts,
            # a pure function of the step: resume needs no extra data state.
            pos = (step_idx * max_rounds + rnd) * n_prompts
            examples, ro, cut, seconds = self.sample(params, pos, jax.random.fold_in(rng, rnd))
            r, components, fails, host = self.t.score(examples, ro)
            shaped, rows, groups_kept = shape_and_filter(self.cfg, host, r, components["correct"])
            rounds.append(
                _Round(ro, host, shaped, components, fails, rows, groups_kept, cut, seconds)
            )
            if sum(r.groups_kept for r in rounds) >= n_prompts:
                break
        return self.fill_batch(rounds), self._collect_metrics(rounds)

    def sample(self, params, pos: int, rng):
        """Stage 1, sample: the ``prompts_per_step`` prompts at data position ``pos``
        and ``group_size`` responses to each. Returns (examples, the rollout on the
        devices, the number of prompts truncated, seconds spent sampling)."""
        n = self.cfg.rollout.prompts_per_step
        examples = self.t.train_data.batch(pos, n)
        t0 = time.perf_counter()
        # Keyed by data stream id, not split index: a batch across an epoch boundary
        # may hold one example twice, and the sampler needs distinct ids.
        ro, cut = self.t.rollout(
            params,
            examples,
            rng,
            prompt_ids=self.t.train_data.stream_ids(pos, n).tolist(),
            router_noise=True,
            routing=self.routing,
        )
        jax.block_until_ready(ro)
        return examples, ro, cut, time.perf_counter() - t0

    def fill_batch(self, rounds: list[_Round]) -> dict[str, Any]:
        """Stage 3, the batch: exactly ``prompts_per_step`` groups from the rounds'
        kept rows, assembled on the devices (`_assemble`; only row indices go there
        from the host). If dynamic sampling fell short, the missing groups are copies
        of the first kept one (of row 0 if none was kept) whose mask is 0 (they add
        nothing). ``rewards`` (host, shaped) are the batch rows' rewards, for
        `advantages`."""
        c = self.c
        cfg = self.cfg
        n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        src_round = np.concatenate([np.full(len(r.rows), i) for i, r in enumerate(rounds)])
        src_row = np.concatenate([r.rows for r in rounds])
        reward = np.concatenate([r.rewards[r.rows] for r in rounds])
        src_round, src_row, reward = src_round[:n_rows], src_row[:n_rows], reward[:n_rows]
        valid = (np.arange(n_rows) < len(src_row)).astype(np.float32)
        if not len(src_row):  # nothing kept: the padding copies row 0 of round 0
            src_round, src_row, reward = np.zeros(1, int), np.zeros(1, int), rounds[0].rewards[:1]
        short = n_rows - len(src_row)
        src_round = np.concatenate([src_round, np.repeat(src_round[:1], short)])
        src_row = np.concatenate([src_row, np.repeat(src_row[:1], short)])
        reward = np.concatenate([reward, np.repeat(reward[:1], short)])
        # Every round's arrays, the same number of rounds each step (round 0 repeated
        # for the rounds not sampled): one program for every step.
        max_rounds = cfg.dapo.max_sampling_rounds if c.dapo.dynamic_sampling else 1
        fields = _BATCH_FIELDS + _ROUTING_FIELDS[self.routing]
        parts = [{k: getattr(r.rollout, k) for k in fields} for r in rounds]
        parts += [parts[0]] * (max_rounds - len(parts))
        batch = self.assemble_fn(
            tuple(parts), src_round.astype(np.int32), src_row.astype(np.int32), valid
        )
        batch["rewards"] = reward
        return batch

    def advantages(self, rewards: np.ndarray, values, mask) -> dict[str, jax.Array]:
        """Stage 5, advantages (``config.advantage``), on the devices: per response over
        each group of the rows' shaped ``rewards`` (host), or GAE per token from the
        critic's ``values`` of the old pass (the sequence reward on the last token).
        Returns ``advantages`` (and for GAE ``returns`` and ``old_values``)."""
        c = self.c
        cfg = self.cfg
        rg = np.asarray(rewards).reshape(-1, cfg.rollout.group_size)
        if c.advantage == "gae":
            seq_rewards = self.t.put_rows(rg.reshape(-1).astype(np.float32))
            a, returns = self.gae_fn(seq_rewards, values, mask)
            return {"advantages": a, "returns": returns, "old_values": values}
        group = {"group": adv_lib.group, "group_no_std": adv_lib.group_no_std, "rloo": adv_lib.rloo}
        a = group[c.advantage](jnp.asarray(rg))
        return {"advantages": self.t.put_rows(np.asarray(a, np.float32).reshape(-1))}

    def _collect_metrics(self, rounds: list[_Round]) -> dict[str, Any]:
        """Host metrics of one step's rounds (every sampled response, kept or not)."""
        c = self.c
        cfg = self.cfg
        n_prompts, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        r_all = np.concatenate([r.rewards for r in rounds])
        rg_all = r_all.reshape(-1, g)
        lengths = [np.asarray(r.host["lengths"], np.float32) for r in rounds]
        length = np.concatenate(lengths)
        fail_counts: dict[str, int] = {}
        for r in rounds:
            for k, v in r.fails.items():
                fail_counts[k] = fail_counts.get(k, 0) + v
        info = {
            "reward_mean": float(r_all.mean()),
            "reward_std": float(r_all.std()),
            "reward_correct": float(
                np.concatenate([r.components["correct"] for r in rounds]).mean()
            ),
            "reward_format": float(np.concatenate([r.components["format"] for r in rounds]).mean()),
            "zero_std_group_frac": float(np.mean(rg_all.std(axis=1) == 0)),
            "response_len": float(length.mean()),
            "truncation_rate": float(
                np.concatenate([np.asarray(r.host["truncated"]) for r in rounds]).mean()
            ),
            "prompts_truncated": sum(r.prompts_truncated for r in rounds),
            "sampling_rounds": len(rounds),
            "dynamic_sampling_bound_hit": float(
                c.dapo.dynamic_sampling and sum(r.groups_kept for r in rounds) < n_prompts
            ),
            "sample_time": sum(r.sample_time for r in rounds),
            "gen_tokens": sum(int(x.sum()) for x in lengths),
        }
        info.update({f"verifier_{k}": v for k, v in fail_counts.items()})
        return info
