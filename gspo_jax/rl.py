"""One RL step: sample, score, shape and filter, the old (and reference, value) passes,
advantages, the rollout correction, the updates and the step's summary.

    RLPhase.step(s)
      collect_batch  1. sample     G responses to each of batch s + k's prompts
                     2. score      the task's verifier (RunParts.score)
                     3. filter     DAPO's overlong shaping and dynamic sampling; the batch
                                   assembled on the devices from the kept rows
                                   (gspo_jax.collect), queued (gspo_jax.offpolicy)
      prepare        one program (gspo_jax.prepare.prepare_batch):
                     4. old pass   batch s's pi_old log-probs and routing (R2), pi_ref's,
                                   the critic's; pi_old by updates.trust_region
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

import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import checkpoint, heldout, lora_training, offpolicy, optim, packing, partial, step
from gspo_jax import metrics as metrics_lib
from gspo_jax.collect import Collector
from gspo_jax.models.precision import inference_params
from gspo_jax.models.sharding import BATCH_AXES, on_mesh
from gspo_jax.prepare import PrepareConfig, prepare_batch
from gspo_jax.run_config import RunConfig
from gspo_jax.run_parts import RunParts

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


def rl_optimizer(cfg: RunConfig):
    """The RL phase's optimizer and schedule (``config.optimizer``), over every update of
    the run (``total_rl_steps x num_minibatches x num_epochs``)."""
    updates_per_step = cfg.updates.num_minibatches * cfg.updates.num_epochs
    return optim.make_optimizer(
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


# ---------------------------------------------------------------------------
# The RL checkpoint: one layout, whatever the features, built and read here alone.
#
#   tree    {"train": the train state (with LoRA its trainable part, lora_training.saved_state),
#            "queue": the device arrays of the batches waiting (rollout.staleness k; [] at 0)}
#   record  {"layout": 2, "queue": those batches' host part (rewards, step, version),
#            "lora_base" (LoRA: the frozen base's identity) or "reference" (a KL term's
#            pi_ref in full fine-tuning): what a resume rebuilds from its source, checked}
#
# train.py adds the phase, the step, the config and the inputs' fingerprints to the
# record. A checkpoint from before "layout" (1) holds the bare state at staleness 0.
CHECKPOINT_LAYOUT = 2


def _bare_state(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's tree is the train state alone: layout 1 at staleness 0,
    whose record holds no queue."""
    return meta.get("layout", 1) < 2 and "queue" not in meta


def checkpoint_target(trainer: RunParts, state, pool=None):
    """The restore target of an RL checkpoint for the train state ``state`` (with LoRA
    its trainable part), as a function of the checkpoint's record (its layout, and the
    prompt length its queue was sampled with: `gspo_jax.offpolicy.queue_target`); what
    `gspo_jax.evaluate` and `gspo_jax.export` restore too. ``pool``: the run's partial
    rollouts (`gspo_jax.partial.Pool`), whose carried responses a checkpoint holds."""
    queue = offpolicy.queue_target(trainer)

    def target(meta: dict[str, Any]):
        if _bare_state(meta):
            return state
        out = {"train": state, "queue": queue(meta)}
        if "partial" in meta:  # evaluate/export restore the responses too, unused
            record = offpolicy.routing_record(trainer.cfg, trainer.model_cfg)
            out["partial"] = (pool or partial.Pool(trainer, record, allocate=False)).target(meta)
        return out

    return target


def unpack_checkpoint(tree, meta: dict[str, Any]) -> tuple[Any, list]:
    """(the saved train state, the queued batches' device arrays) of a restored tree."""
    if _bare_state(meta):
        return tree, []
    return tree["train"], list(tree["queue"])


class ReferenceChanged(checkpoint.SourceChanged):
    """A resumed run's reference policy is not the one its checkpoint trained against."""


def check_reference(saved: dict | None, current: dict | None) -> None:
    """Refuse a resume whose rebuilt pi_ref (``current``, `checkpoint.identity`) differs
    from the one the RL checkpoint recorded (``saved``); a checkpoint from before the
    record existed is resumed with a notice."""
    if current is None:
        return
    if saved is None:
        print(
            "gspo_jax: the RL checkpoint records no checksum of the reference policy (saved "
            f"before one was recorded): pi_ref, rebuilt from {current['source']!r}, is not "
            "checked against the one it trained with",
            file=sys.stderr,
        )
    elif saved["checksum"] != current["checksum"]:
        raise ReferenceChanged(
            f"the KL term's reference policy rebuilt from {current['source']!r} has checksum "
            f"{current['checksum']}, but the RL checkpoint was trained against "
            f"{saved['source']!r} with checksum {saved['checksum']}: its source changed "
            "since (the warm start's checkpoint was replaced, or model.pretrained's files "
            "changed in place); restore it to resume, or start a new run in another workdir"
        )


class RLPhase:
    """The RL phase of a run: its state, its compiled functions and one step
    (`RLPhase.step`). ``trainer``: the run's parts; ``params``: where RL starts (the
    warm start's parameters), which are also the reference policy of a KL term."""

    def __init__(self, trainer: RunParts, params):
        self.t, self.cfg = trainer, trainer.cfg
        # As a phase of the run's loop: its steps, the one it resumes at (set by
        # load_checkpoint) and the writer of one record per optimizer update.
        self.steps, self.start, self.update_writer = trainer.cfg.total_rl_steps, 0, None
        cfg = trainer.cfg
        self.updates_per_step = cfg.updates.num_minibatches * cfg.updates.num_epochs
        self.optimizer, self.sched = rl_optimizer(trainer.cfg)
        shards = int(np.prod([trainer.mesh.shape[a] for a in BATCH_AXES]))
        self.shapes = packing.shapes(cfg.updates, cfg, shards)  # packed or padded rows
        self.step_cfg = step.StepConfig(
            hparams=cfg.objective.hparams,
            micro_batches=self.shapes.micro_batches,
            aux_loss_coef=cfg.updates.aux_loss_coef,
            z_loss_coef=cfg.updates.z_loss_coef,
            entropy_coef=cfg.entropy_coef,
            value_coef=cfg.gae.value_coef if cfg.advantage == "gae" else 0.0,
            value_clip=cfg.gae.value_clip,
            temperature=cfg.rollout.temperature,
            update_without_signal=cfg.updates.update_without_signal,
            trainable=lora_training.trainable(cfg.lora, "rl"),
            packing=self.shapes.train,
        )
        # The routing record the training rollouts keep: R3 replays all of it; an MoE
        # model's mismatch metrics compare the response tokens' with the trainer's.
        self.routing = offpolicy.routing_record(cfg, trainer.model_cfg)
        self.collector = Collector(trainer, self.routing)  # stages 1-3 (gspo_jax.collect)
        # The reference policy is where RL starts; copied, as the state is donated, and
        # held in the compute dtype (the same logits; docs/memory.md). With LoRA: the
        # frozen base itself, the adapters off (gspo_jax.lora_training), and no copy.
        self.lora = self.step_cfg.trainable != "all"
        self.ref_routers = None
        if self.lora:
            params, self.base = lora_training.rl_start(trainer, params, self.step_cfg.trainable)
            trained_routers = cfg.lora.train_router and trainer.kl_coef
            self.ref_routers = lora_training.routers(params) if trained_routers else None
        kl = trainer.kl_coef and not self.lora
        self.ref_params = inference_params(params, trainer.model_cfg) if kl else None
        # What a checkpoint records of pi_ref, so that a resume, which rebuilds it from
        # its source, trains against the same one (LoRA: the base's identity, self.base).
        source = lora_training.source(trainer)
        self.reference = checkpoint.identity(source, self.ref_params) if kl else None
        self.state = trainer.new_state(params, self.optimizer, self.step_cfg.trainable)
        self.train_fn = trainer.jit_step(
            step.train_step,
            self.state,
            optimizer=self.optimizer,
            schedule=self.sched,
            cfg=self.step_cfg,
        )
        # Stages 4-6, one program (gspo_jax.prepare): pi_old's and pi_ref's passes, the
        # advantages, the rollout correction and the step's diagnostics.
        ref = "lora" if self.lora and trainer.kl_coef else "full" if kl else "none"
        self.prepare_cfg = PrepareConfig.of(cfg, trainer.model_cfg, ref, self.shapes)
        self.prepare_fn = on_mesh(
            jax.jit(
                functools.partial(prepare_batch, graphdef=trainer.graphdef, cfg=self.prepare_cfg)
            ),
            trainer.mesh,
        )
        # Off-policy (gspo_jax.offpolicy): the queue of scored batches, the parameters
        # the sampler reads, and which policy the trust region is around.
        self.queue = offpolicy.BatchQueue(cfg)
        self.sampler_params = None  # on the sampler's devices, when it has its own
        # The mini-batches: the permutation and the gather on the devices.
        n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        self.perm_fn = jax.jit(functools.partial(_permutations, n=n, epochs=cfg.updates.num_epochs))
        self.minibatch_fn = jax.jit(
            functools.partial(_minibatch, size=n // cfg.updates.num_minibatches),
            out_shardings=NamedSharding(trainer.mesh, P(BATCH_AXES)),
        )

    def prepare(self, queued: offpolicy.QueuedBatch, s: int):
        """Stages 4-6 (`gspo_jax.prepare.prepare_batch`, one program): the device batch
        with pi_old's (and the reference's) log-probs, routing records, advantages and
        the rollout correction; and the step's train-inference mismatch and staleness
        metrics. ``queued``: the batch `collect_batch` made (on the devices, but for the
        host ``rewards`` of its rows); ``s``: this step.

        ``updates.trust_region`` (docs/offpolicy.md): 'decoupled' recomputes pi_old at
        the step's parameters (the proximal policy) in the old pass, and the rollout
        correction weighs pi_old / pi_behaviour; 'behaviour' takes pi_old to be the
        sampler's own log-probs and routing (`gspo_jax.prepare.BEHAVIOUR_REFERENCES`),
        and the old pass runs only for what nothing else gives: the critic's values,
        R2's routing. Nothing here waits for the devices: the host's rewards go to
        them, and everything else is computed there, nothing coming back."""
        dev = self.t.put_batch(queued.device)
        rewards = self.t.put_rows(np.asarray(queued.rewards, np.float32).reshape(-1))
        ref = {"none": None, "full": self.ref_params, "lora": self.ref_routers}
        return self.prepare_fn(
            self.state.params, ref[self.prepare_cfg.reference], dev, rewards, np.int32(s)
        )

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

    # ---- as a phase of the run's loop (gspo_jax.loop.Phase) -------------------

    name = "rl"

    def run_step(self, s: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """`step`, its updates' records written (``updates.jsonl``, when
        ``update_writer`` is set); the summary metrics are also the health check's."""
        m, updates = self.step(s)
        for u in updates:
            if self.update_writer is not None:
                tb_step = s * self.updates_per_step + u["k"]
                self.update_writer.write(s + 1, "rl", u, tb_step=tb_step)
        return m, m

    def finish_step(self, s: int, m: dict[str, Any]) -> dict[str, Any] | None:
        """The held-out evaluation every ``eval_every`` steps and at the last; the record
        every ``log_every`` steps, at an evaluation and at the last."""
        last = s + 1 == self.steps
        if (s + 1) % self.cfg.eval_every == 0 or last:
            m.update(heldout.evaluate(self.t, self.state.params))
        if (s + 1) % self.cfg.log_every == 0 or "eval_reward_mean" in m or last:
            return m
        return None

    def postfix(self, m: dict[str, Any], record) -> dict[str, str]:
        return {
            "reward": f"{m.get('reward_mean', float('nan')):.3f}",
            "clip": f"{m['clip_frac']:.3f}",
            "flip": f"{m.get('flip_frac', 0.0):.3f}",
        }

    def close(self) -> None:
        if self.update_writer is not None:
            self.update_writer.close()

    def step(self, s: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One RL step: collect step s + k's batch (k = ``rollout.staleness``), train on
        step s's (sampled k steps ago; `gspo_jax.offpolicy`). Serially, the batch is
        collected first and then trained on (k = 0: the on-policy loop); with
        ``rollout.overlap`` the updates are dispatched first and the next batch is
        sampled and scored on the sampler's devices while they run. Returns the step's
        summary metrics and one record per optimizer update (``k``: its index within
        the rollout)."""
        cfg = self.cfg
        rng = jax.random.fold_in(jax.random.key(self.cfg.seed + 1), s)
        self.queue.fill(s, self.collect_batch)
        t0 = time.perf_counter()
        if cfg.rollout.overlap:
            queued = self.queue.popleft()
            batch, pinfo = self.prepare(queued, s)
            ms, where = self.updates(batch, rng)
            t_dispatched = time.perf_counter()  # the sampler side runs now
            self.queue.append(self.collect_batch(self.queue.collected_at(s), version=s))
            t1 = t2 = time.perf_counter()  # rollout_time: collecting; old_logp_time: 0
        else:
            self.queue.append(self.collect_batch(self.queue.collected_at(s), version=s))
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
            m.update(collect_time=t1 - t_dispatched, train_wait_time=t3 - t1)
        return m, updates

    def _behaviour_metrics(self, pinfo, first_update) -> dict[str, float]:
        """KL(pi_behaviour || pi_proximal) (k3 estimate) and F(2), the share of tokens
        whose ratio is outside [1/2, 2]: from the old pass over the whole batch
        ('decoupled'), or from the first update's forward, at the step's parameters, over
        its mini-batch ('behaviour', which runs no old pass)."""
        if self.prepare_cfg.behaviour:
            return {
                "behaviour_kl": first_update["kl_k3"],
                "behaviour_f2": first_update["frac_ratio_gt_2"],
            }
        return {"behaviour_kl": pinfo["mismatch_kl"], "behaviour_f2": pinfo["mismatch_f2"]}

    # ---- the queue of scored batches (gspo_jax.offpolicy) --------------------

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
            rng = jax.random.fold_in(jax.random.key(self.cfg.seed + 1), j)
            collected, info = self.collect(self.sampling_params(), j, rng, version)
        return self.queued(collected, info, step=j, version=version)

    def queued(self, collected, info, *, step: int, version: int) -> offpolicy.QueuedBatch:
        """`collect`'s batch as the queue holds it: on the training mesh (device to
        device if the sampler has its own), each row marked with ``version``."""
        collected = dict(collected)
        rewards = collected.pop("rewards")
        device = self.t.sampler_devices.to_training(collected)
        if "policy_version" not in device:  # partial rollouts mark each token (collect)
            device["policy_version"] = self.t.put_rows(np.full(len(rewards), version, np.int32))
        return offpolicy.QueuedBatch(device, rewards, info, step=step, version=version)

    def checkpoint_items(self) -> tuple[Any, dict[str, Any]]:
        """What an RL checkpoint holds (`CHECKPOINT_LAYOUT`): the tree and the JSON record
        of this phase's state."""
        meta: dict[str, Any] = {"layout": CHECKPOINT_LAYOUT}
        if self.lora:  # the frozen base's identity
            meta["lora_base"] = self.base
        if self.reference is not None:  # the KL term's pi_ref, in full fine-tuning
            meta["reference"] = self.reference
        meta["queue"] = [b.meta() for b in self.queue]
        tree = {"train": self._saved_state(), "queue": [b.device for b in self.queue]}
        pool = self.collector.pool
        if pool is not None:  # partial rollouts: the responses carried to the next step
            meta["partial"], tree["partial"] = pool.meta(), pool.device
        return tree, meta

    def checkpoint_target(self):
        """The restore target of `checkpoint_items`' tree (`checkpoint_target`)."""
        return checkpoint_target(self.t, self._saved_state(), self.collector.pool)

    def _saved_state(self):
        """The train state as a checkpoint holds it: with LoRA, its trainable part."""
        if not self.lora:
            return self.state
        return lora_training.saved_state(self.state, self.step_cfg.trainable)

    def load_checkpoint(self, tree, meta: dict[str, Any]) -> None:
        """Restore what `checkpoint_items` saved (tree onto `checkpoint_target`): with
        LoRA onto the frozen base rebuilt from its source, checked against its checksum;
        pi_ref checked against the one the checkpoint trained with; the queue re-padded
        to this run's rollout.max_prompt_len."""
        state, queue = unpack_checkpoint(tree, meta)
        if self.collector.pool is not None and "partial" in meta:
            self.collector.pool.load(tree["partial"], meta["partial"])
        check_reference(meta.get("reference"), self.reference)
        if self.lora:
            state = lora_training.loaded_state(
                state, meta, self.state, self.step_cfg.trainable, self.base
            )
        self.state = state
        self.queue.clear()
        pad_id = self.t.tokenizer.pad_id
        for device, record in zip(queue, meta.get("queue", [])):
            device = offpolicy.fit_queue(device, self.t.max_prompt_len, pad_id)
            self.queue.append(offpolicy.QueuedBatch.from_checkpoint(device, record))
        self.sampler_params = None

    def collect(
        self, params, step_idx: int, rng, version: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stages 1-3 for batch ``step_idx`` (`gspo_jax.collect.Collector.collect`)."""
        return self.collector.collect(params, step_idx, rng, version)
