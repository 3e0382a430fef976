"""The RL trainer: the main job.

    python -m gspo_jax.train --config=configs/default.py --workdir=runs/default
    python -m gspo_jax.train --config=configs/default.py:objective=grpo,smoke \\
        --config.updates.routing_replay=R3 --workdir=/tmp/run

One RL step (``RLPhase.step``; steps 1-4 are the stages of ``Trainer.collect``):

1. sample: prompts from TFDS (:class:`gspo_jax.data.PromptSource`, a pure
   function of the data position, so a resumed run sees the same prompts), G
   samples per prompt (:class:`gspo_jax.rollout.Sampler`), with log-probs and
   the routing record its consumers need (the response tokens' for an MoE
   model's mismatch metrics, the whole R3 record under R3 replay);
2. score: rewards (:func:`gspo_jax.rewards.score`) of the decoded responses;
3. shape and filter: DAPO's soft overlong punishment, dynamic sampling (more
   rounds of 1-3 until the batch is full, within ``dapo.max_sampling_rounds``)
   and overlong filtering;
4. advantages (``vmap`` over groups);
5. old log-probs recomputed by the training model (with its routing record,
   the R2 replay), reference log-probs only when ``kl_coef`` is non-zero;
6. ``num_epochs x num_minibatches`` calls of the one compiled
   :func:`gspo_jax.step.train_step`, each accumulating ``micro_batches``.

Host traffic: the rollout stays on the devices. Only the response token ids,
lengths and truncation flags come to the host (to decode and score them, and for
the step's metrics); the batch is assembled on the devices from row indices
(dynamic sampling's selection, the fill), and the mini-batches are gathered there
too. Every prompt is left-padded to ``rollout.max_prompt_len`` (a longer one is
refused or truncated: ``rollout.long_prompts``), so one shape serves the whole
run: the sampler, the log-prob passes and the train step compile once.

Before RL, a supervised warm start (``sft``) on the data set's reference
solutions gives a policy that is sometimes right; it is a phase of its own,
with its own checkpoints. Everything is resumable: each phase restores its
latest checkpoint (parameters, optimizer state, step; the data position and
RNG are functions of the step), and ``metrics.jsonl`` is cut back to it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import advantages as adv_lib
from gspo_jax import config as config_lib
from gspo_jax import evaluation, multihost, objectives, rewards, safety, shaping, step
from gspo_jax import metrics as metrics_lib
from gspo_jax.checkpoint import PhaseCheckpointer
from gspo_jax.data import PromptSource
from gspo_jax.data.user_file import FileTask
from gspo_jax.metrics_log import MetricsWriter, open_wandb
from gspo_jax.models import from_pretrained, init_sharded
from gspo_jax.models.transformer import inference_params
from gspo_jax.objectives.correction import RolloutCorrection, rollout_correction
from gspo_jax.rollout import Sampler
from gspo_jax.tokenizers import CharTokenizer, HFTokenizer

# The mesh axes a batch's rows are split over: every axis but 'tensor' (the model's
# 'batch' rule; with an 'expert' axis, expert parallelism moves rows, not weights).
BATCH_AXES = ("data", "fsdp", "expert")


# --------------------------------------------------------------------------
# Building blocks.


def cluster_detected(environ=os.environ) -> str | None:
    """The multi-process launcher the environment shows, or None: a coordinator named in
    JAX_COORDINATOR_ADDRESS, an srun step or Open MPI job of more than one task, a TPU
    pod on GKE or a Cloud TPU VM. JAX finds the coordinator, process count and id in each."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    # srun's step, not the batch script's allocation (SLURM_NTASKS is set there too).
    if int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return "SLURM"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    try:  # JAX's own test (private): on a Cloud TPU VM initialize() needs no arguments
        from jax._src.clusters.cloud_tpu_cluster import running_in_cloud_tpu_vm
    except ImportError:
        running_in_cloud_tpu_vm = False
    return "Cloud TPU VM" if running_in_cloud_tpu_vm else None


# What XLA may preallocate of each GPU's memory. JAX's default is 75%, which leaves a
# quarter of an H200 (35 GiB) unused; the memory figures of docs/memory.md are against
# 95%. A user's own XLA_PYTHON_CLIENT_MEM_FRACTION (or PREALLOCATE=false) wins.
DEVICE_MEMORY_FRACTION = "0.95"


def claim_device_memory() -> str | None:
    """Set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to `DEVICE_MEMORY_FRACTION` where the user
    has not set it or turned preallocation off; call before anything touches a device.
    Returns the line to log when it set it (None otherwise)."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return None
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return None
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = DEVICE_MEMORY_FRACTION
    return (
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={DEVICE_MEMORY_FRACTION} (JAX's default is 0.75; "
        "set the variable to choose another)"
    )


def on_mesh(fn, mesh: Mesh):
    """``fn`` (jit-compiled) called, and so traced, with ``mesh`` set (`jax.set_mesh`):
    the model's full forward reads it to shard cuDNN attention's inputs by rows
    (`gspo_jax.models.layers._rows_sharded`). Only the programs are traced under it:
    creating parameters under a mesh would read their logical axis names as mesh axes."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    def lower(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn.lower(*args, **kwargs)

    call.lower = lower
    return call


def maybe_initialize_distributed(d: ml_collections.ConfigDict) -> bool:
    """Start multi-process JAX (`jax.distributed.initialize`) where the run has several
    processes; call before anything touches a device. ``d``: the config's
    ``distributed`` block (`gspo_jax.config`); JAX_NUM_PROCESSES and JAX_PROCESS_ID in
    the environment stand in for its counts. Returns whether it started. CPU processes
    exchange data through gloo (`docs/distributed.md`)."""
    address = str(d.coordinator_address) or None
    if d.mode == "off" or jax.distributed.is_initialized():
        return False
    if d.mode == "auto" and address is None and cluster_detected() is None:
        return False
    num = int(d.num_processes) or int(os.environ.get("JAX_NUM_PROCESSES", 0)) or None
    pid = int(d.process_id)
    pid = pid if pid >= 0 else int(os.environ.get("JAX_PROCESS_ID", -1))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num, process_id=pid if pid >= 0 else None
    )
    print(
        f"jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} of {jax.device_count()} devices",
        flush=True,
    )
    return True


def make_mesh(shape: dict[str, int]) -> Mesh:
    axes = config_lib.MESH_AXES
    devices = np.asarray(jax.devices()).reshape(tuple(shape[a] for a in axes))
    return Mesh(devices, axes)


def make_tokenizer(c: ml_collections.ConfigDict):
    if c.tokenizer == "char":
        return CharTokenizer(words=(rewards.ANSWER_OPEN, rewards.ANSWER_CLOSE))
    path = c.tokenizer
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise config_lib.ConfigError(f"config.tokenizer: no tokenizer.json in {path!r}")
    return HFTokenizer.from_dir(path)


def encode_prompt(tokenizer, text: str, messages=None) -> list[int]:
    """Prompt text -> ids: the chat template where the tokenizer has one. ``messages``
    (an Example's, from a user's messages column) replace the one user message of
    ``text`` in the template; without a template ``text`` (their joined contents) is used."""
    if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages] if messages else [{"role": "user", "content": text}],
            add_generation_prompt=True,
        )
        return tokenizer.encode(text)
    ids = tokenizer.encode(text)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def fit_prompts(
    prompts: Sequence[Sequence[int]], max_len: int, policy: str, where: str = "a prompt"
) -> tuple[list[list[int]], int]:
    """Prompts (token ids) that fit ``rollout.max_prompt_len`` = ``max_len``, and how
    many were truncated. ``policy`` (``rollout.long_prompts``): "refuse" raises a
    ConfigError naming the field and the prompt's length; "truncate" keeps a long
    prompt's last ``max_len`` tokens (its end holds the question's end, the answer
    format and the chat template's assistant turn; the start, a BOS or a system
    message, is what goes)."""
    out, cut = [], 0
    for i, p in enumerate(prompts):
        p = list(p)
        if len(p) > max_len:
            if policy != "truncate":
                raise config_lib.ConfigError(
                    f"config.rollout.max_prompt_len: {where} of {len(p)} tokens (number {i} "
                    f"of its batch) is longer than max_prompt_len={max_len}; raise it, or set "
                    "config.rollout.long_prompts='truncate' to keep each long prompt's last "
                    f"{max_len} tokens"
                )
            p, cut = p[-max_len:], cut + 1
        out.append(p)
    return out, cut


def pad_left(seqs: Sequence[Sequence[int]], length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    toks = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        if len(s):
            toks[i, length - len(s) :] = s
            mask[i, length - len(s) :] = 1
    return toks, mask


def pad_right(
    seqs: Sequence[Sequence[int]], length: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    toks = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return toks, mask


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


def summarize_updates(ms: list[dict]) -> dict:
    """One RL step's summary of its updates' metrics (``updates.jsonl`` has each).

    The mean over updates, but: the max of maxima and of the running skip counts, the
    min of minima, the learning rate of the last update, the count of mini-batches
    with no signal (``no_signal_minibatches``) and, for `DRIFT_METRICS`, the values
    of the first (``<name>_k0``), second (``<name>_k1``) and last (``<name>_klast``)
    update as well. An update's metrics are measured in its forward pass, at the
    parameters before it: k = 0 is at pi_old (nothing has drifted yet), k = 1 after one
    update.
    """
    out = {}
    for k in ms[0]:
        vals = [np.asarray(m[k], np.float64) for m in ms]
        if k.endswith("_max") or k in ("skipped_total", "skipped_in_a_row"):
            out[k] = np.max(vals, axis=0)
        elif k.endswith("_min"):
            out[k] = np.min(vals, axis=0)
        elif k == "lr":
            out[k] = vals[-1]
        elif k == "no_signal":
            out["no_signal_minibatches"] = np.sum(vals, axis=0)
        else:
            out[k] = np.mean(vals, axis=0)
        if k in DRIFT_METRICS:
            out[f"{k}_k0"], out[f"{k}_klast"] = vals[0], vals[-1]
            if len(vals) > 1:  # measured after one update (k = 0 is at pi_old itself)
                out[f"{k}_k1"] = vals[1]
    return out


# --------------------------------------------------------------------------
# The trainer.


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


# The Rollout's arrays the training batch is assembled from (`_assemble`); the
# routing record only where the sampler kept it.
_BATCH_FIELDS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "truncated", "logp_sampling")
_ROUTING_FIELDS = {"all": ("experts", "prompt_experts"), "response": ("experts",), "none": ()}


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
        "rollout_logp": take("logp_sampling"),
    }
    if "experts" in parts[0]:
        # The sampler's routing of the position that produced each response token:
        # positions P-1 ... P+T-2 of the replay array (prompt_experts[:, P-1] equals
        # experts[:, 0]).
        batch["sampler_topk"] = take("experts")
    if "prompt_experts" in parts[0]:
        batch["replay_r3"] = jnp.concatenate(
            [take("prompt_experts"), batch["sampler_topk"][:, 1:]], axis=1
        )
    return batch


class Trainer:
    """Holds the host-side pieces of a run; the math lives in :mod:`gspo_jax.step`."""

    def __init__(self, c: ml_collections.ConfigDict, workdir: str):
        self.c = c
        self.workdir = workdir
        self.tokenizer = make_tokenizer(c)
        mesh_shape = config_lib.validate(
            c, jax.device_count(), tokenizer_vocab_size=self.tokenizer.vocab_size
        )
        self.mesh = make_mesh(mesh_shape)
        os.makedirs(workdir, exist_ok=True)
        data_dir = c.task.data_dir or os.path.join(workdir, "data")
        difficulty = None if c.task.name in ("gsm8k", "file") else c.task.difficulty
        kw = dict(data_dir=data_dir, config=difficulty, seed=c.seed, style=c.task.style)
        if c.task.name == "gsm8k":
            kw["gsm8k_files"] = c.task.gsm8k_files or None
        if c.task.name == "file":
            kw["file_task"] = FileTask.from_config(c.task)
        # One process prepares a data set that is not on disk yet; the others then read it.
        if not multihost.is_primary():
            multihost.barrier("data prepared")
        self.train_data = PromptSource(c.task.name, "train", **kw)
        self.eval_data = PromptSource(c.task.name, "test", shuffle=False, **kw)
        if multihost.is_primary():
            multihost.barrier("data prepared")

        # The policy, created already sharded. Each batch shard dispatches its own
        # tokens to the experts (ModelConfig.moe_groups).
        moe_groups = int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        if c.model.pretrained:
            model = from_pretrained(
                c.model.pretrained,
                mesh=self.mesh,
                value_head=c.advantage == "gae",
                # Embedding rows past the tokenizer's vocabulary are padding: never sampled.
                num_valid_tokens=self.tokenizer.vocab_size,
                moe_groups=moe_groups,
                **{k: c.model[k] for k in config_lib.MODEL_RUNTIME_FIELDS},
            )
            self.model_cfg = model.cfg
            graphdef, params = nnx.split(model)
        else:
            self.model_cfg = dataclasses.replace(
                config_lib.model_config(c, self.tokenizer.vocab_size), moe_groups=moe_groups
            )
            model = init_sharded(self.model_cfg, self.mesh, seed=c.seed)
            graphdef, params = nnx.split(model)
        non_params = nnx.split(model, nnx.Param, ...)[2]
        if jax.tree.leaves(non_params):
            raise ValueError(
                "the model holds non-Param variables; the trainer expects parameters only"
            )
        if c.updates.routing_replay != "none" and self.model_cfg.num_moe_layers == 0:
            raise ValueError(
                f"updates.routing_replay={c.updates.routing_replay!r} needs MoE layers; "
                "the model is dense (num_experts=0): use 'none'"
            )
        self.graphdef = graphdef
        # One prompt length for the whole run: one program per batch size.
        self.max_prompt_len = int(c.rollout.max_prompt_len)
        self.sampler = Sampler(
            graphdef,
            params,
            vocab_size=self.model_cfg.vocab_size,
            mesh=self.mesh,
            prompt_buckets=(self.max_prompt_len,),
        )
        # The routing record the training rollouts keep: R3 replays all of it; an MoE
        # model's mismatch metrics compare the response tokens' with the trainer's.
        if c.updates.routing_replay == "R3":
            self.routing = "all"
        else:
            self.routing = "response" if self.model_cfg.num_moe_layers > 0 else "none"
        self._assemble = jax.jit(
            functools.partial(_assemble, overlong_filter=bool(c.dapo.overlong_filter)),
            out_shardings=NamedSharding(self.mesh, P(BATCH_AXES)),
        )
        self.init_params = params  # where SFT (or RL, without SFT) starts

        self.step_cfg = step.StepConfig(
            objective=c.objective.name,
            hparams=tuple(sorted(dict(c.objective.hparams).items())),
            micro_batches=int(c.updates.micro_batches),
            aux_loss_coef=float(c.updates.aux_loss_coef),
            z_loss_coef=float(c.updates.z_loss_coef),
            entropy_coef=float(c.entropy_coef),
            value_coef=float(c.gae.value_coef) if c.advantage == "gae" else 0.0,
            value_clip=float(c.gae.value_clip),
            temperature=float(c.rollout.temperature),
            update_without_signal=bool(c.updates.update_without_signal),
        )
        self.rollout_correction = RolloutCorrection(**dict(c.rollout_correction))
        self.kl_coef = float(
            objectives.get(c.objective.name)
            .validate_hyperparameters(dict(c.objective.hparams))
            .get("kl_coef", 0.0)
        )

    # ---- device placement and compiled steps (also used by RLPhase) --------

    def _batch_sharding(self, x) -> NamedSharding:
        return NamedSharding(self.mesh, P(BATCH_AXES, *([None] * (np.ndim(x) - 1))))

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The batch on the mesh, every array sharded over its first (row) axis."""
        return {k: jax.device_put(v, self._batch_sharding(v)) for k, v in batch.items()}

    def _state_shardings(self, state):
        return jax.tree.map(lambda x: x.sharding, state)

    def new_state(self, params, optimizer) -> step.TrainState:
        """A fresh state whose every leaf lives on the mesh: parameters (and the
        optimizer moments that follow them) sharded, scalars replicated."""
        state = step.TrainState.create(params, jax.jit(optimizer.init)(params))
        replicated = NamedSharding(self.mesh, P())

        def on_mesh(x):
            sh = x.sharding
            if isinstance(sh, NamedSharding) and sh.mesh == self.mesh:
                return x
            return jax.device_put(x, replicated)

        return jax.tree.map(on_mesh, state)

    def jit_step(self, fn, state, **static):
        """``fn(state, batch, rng, graphdef=..., **static)`` jit-compiled with the
        state's shardings kept and the state donated (:func:`gspo_jax.step.train_step`,
        :func:`gspo_jax.step.sft_step`)."""
        shardings = self._state_shardings(state)
        jitted = jax.jit(
            functools.partial(fn, graphdef=self.graphdef, **static),
            in_shardings=(shardings, None, None),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        return on_mesh(jitted, self.mesh)

    # ---- supervised warm start --------------------------------------------

    def sft_batch(self, position: int) -> dict[str, np.ndarray]:
        return self._sft_batch(position)[0]

    def _sft_batch(self, position: int) -> tuple[dict[str, np.ndarray], int]:
        """The warm start's batch at data position ``position`` and the number of its
        prompts truncated (`fit_prompts`)."""
        c, tok = self.c, self.tokenizer
        examples = self.train_data.batch(position, int(c.sft.batch_size))
        prompts, cut = self.fit_prompts(
            [encode_prompt(tok, ex.prompt, ex.messages) for ex in examples], "a warm-start prompt"
        )
        T = int(c.rollout.max_new_tokens)
        responses = []
        for ex in examples:
            if ex.reference is None:
                raise ValueError(
                    f"task {c.task.name!r} example {ex.index} has no reference solution for sft"
                )
            r = tok.encode(ex.reference) + [tok.eos_id]
            if len(r) > T:
                raise config_lib.ConfigError(
                    f"config.rollout.max_new_tokens: {T} is shorter than a reference solution ({len(r)} tokens)"
                )
            responses.append(r)
        pt, pm = pad_left(prompts, self.max_prompt_len, tok.pad_id)
        rt, rm = pad_right(responses, T, tok.pad_id)
        return {"prompt_tokens": pt, "prompt_mask": pm, "tokens": rt, "mask": rm}, cut

    def fit_prompts(self, prompts, where: str = "a prompt") -> tuple[list[list[int]], int]:
        """`fit_prompts` with this run's ``rollout.max_prompt_len`` and ``long_prompts``."""
        c = self.c
        return fit_prompts(prompts, self.max_prompt_len, str(c.rollout.long_prompts), where)

    def _sft_optimizer(self):
        c = self.c
        return step.make_optimizer(
            lr=c.sft.lr,
            schedule="cosine",
            total_steps=int(c.sft.steps),
            warmup_steps=c.sft.warmup_steps,
            end_lr_ratio=0.1,
            weight_decay=0.0,
            b1=0.9,
            b2=0.99,
            grad_clip=1.0,
        )

    def _restore_sft(self):
        """(checkpointer, optimizer, schedule, state, step) of the warm start, resumed
        from its newest checkpoint that restores (step 0: none)."""
        c = self.c
        ckpt = PhaseCheckpointer(
            self.workdir, "sft", every=int(c.checkpoint_every), keep=c.keep_checkpoints
        )
        optimizer, sched = self._sft_optimizer()
        state = self.new_state(self.init_params, optimizer)
        start = 0
        if ckpt.latest_step() is not None:
            state, _, start = ckpt.restore(state)
        return ckpt, optimizer, sched, state, start

    def warm_start_params(self):
        """The warm start's final parameters from its checkpoint, or None when that
        checkpoint is gone or does not restore (RL, once begun, never repeats it)."""
        ckpt, _, _, state, start = self._restore_sft()
        ckpt.close()
        return state.params if start >= int(self.c.sft.steps) else None

    def run_sft(self, open_log, guard: safety.RunGuard | None = None) -> Any:
        """The supervised warm start, resumed from its newest valid checkpoint. Returns
        (its final parameters, the metrics writer it logged to, or None when it had
        nothing left to do). ``open_log(phase, step)`` opens the log cut back to a step."""
        c = self.c
        steps = int(c.sft.steps)
        ckpt, optimizer, sched, state, start = self._restore_sft()
        if start >= steps:
            ckpt.close()
            return state.params, None
        writer = open_log("sft", start)
        fn = self.jit_step(
            step.sft_step,
            state,
            optimizer=optimizer,
            schedule=sched,
            micro_batches=1,
            aux_loss_coef=float(c.sft.aux_loss_coef),
        )
        bar = _progress(c, steps, start, "sft")
        base = jax.random.key(c.seed)
        for i in range(start, steps):
            t0 = time.perf_counter()
            host_batch, cut = self._sft_batch(i * int(c.sft.batch_size))
            batch = self.put_batch(host_batch)
            state, m = fn(state, batch, jax.random.fold_in(base, i))
            safety.check_health(
                jax.device_get({k: m[k] for k in ("params_finite", "skipped_in_a_row")}),
                c,
                f"sft step {i + 1}",
            )
            if (i + 1) % c.log_every == 0 or i + 1 == steps:
                m = jax.device_get(m)
                dt = time.perf_counter() - t0
                m["step_time"] = dt
                m["tokens_per_s"] = float(np.sum(host_batch["mask"])) / dt
                m["prompts_truncated"] = cut
                writer.write(i + 1, "sft", m)
                bar.set_postfix(nll=f"{m['sft_nll']:.3f}")
            bar.update(1)
            stop = guard is not None and guard.requested
            meta = {"phase": "sft", "step": i + 1, "config": safety.config_record(c)}
            ckpt.save(i + 1, state, meta, force=(i + 1 == steps) or stop)
            if stop:
                ckpt.close()
                writer.close()
                guard.exit(f"sft step {i + 1}")
            if guard is not None:
                guard.heartbeat()
        bar.close()
        ckpt.close()
        return state.params, writer

    # ---- RL ---------------------------------------------------------------

    def _rollout(
        self,
        params,
        examples,
        rng,
        *,
        greedy: bool = False,
        num_samples: int | None = None,
        prompt_ids=None,
        router_noise: bool = False,
        routing: str = "none",
    ):
        """Samples ``num_samples`` (default: the group size) per example. ``prompt_ids``
        (distinct, one per example) key each prompt's samples; default: the examples'
        split indices. ``router_noise``: add ``rollout.router_noise_std`` to the
        sampler's router logits (training rollouts; evaluation measures the policy
        itself). ``routing``: the routing record to keep (`gspo_jax.rollout.ROUTING`).
        Returns (the Rollout, on the devices; the number of prompts truncated)."""
        c, tok = self.c, self.tokenizer
        ids, cut = self.fit_prompts([encode_prompt(tok, ex.prompt, ex.messages) for ex in examples])
        g = num_samples or int(c.rollout.group_size)
        ro = self.sampler(
            ids,
            num_samples=g,
            max_new_tokens=int(c.rollout.max_new_tokens),
            rng=rng,
            temperature=0.0 if greedy else float(c.rollout.temperature),
            top_p=1.0 if greedy else float(c.rollout.top_p),
            top_k=0 if greedy else int(c.rollout.top_k),
            eos_id=list(tok.stop_ids),
            pad_id=tok.pad_id,
            prompt_ids=[ex.index for ex in examples] if prompt_ids is None else prompt_ids,
            state=params,
            router_noise_std=float(c.rollout.router_noise_std) if router_noise else 0.0,
            routing=routing,
        )
        return ro, cut

    def _texts(self, host: dict[str, np.ndarray]) -> list[str]:
        toks, lengths = host["tokens"], host["lengths"]
        return [self.tokenizer.decode(toks[i, : lengths[i]].tolist()) for i in range(len(toks))]

    def score(
        self, examples, ro, *, num_samples: int | None = None, answers: str | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int], dict[str, np.ndarray]]:
        """Stage 2, score: the task's verifier on the decoded responses of rollout ``ro``
        (``num_samples`` per example; default: the group size).

        What of a rollout comes to the host is the response token ids, lengths and
        truncation flags; the rest stays on the devices. Each process decodes and
        verifies only the rows on its own devices; their per-row results are then
        gathered to every process (`gspo_jax.multihost`; in one process there is
        nothing to gather). ``answers``: also the final answers as `evaluation` reads
        them for this verifier kind, as codes (``components["answer_code"]``).

        Returns (rewards [n * G], their components, verifier failure counts, and
        ``{"lengths", "truncated"}`` of every row), the same on every process.
        """
        c = self.c
        g = num_samples or int(c.rollout.group_size)
        rows, host = multihost.local_rows(
            {"tokens": ro.tokens, "lengths": ro.lengths, "truncated": ro.truncated}
        )
        texts = self._texts(host)
        metas = [ex.meta for ex in examples for _ in range(g)][rows]
        r, components, fails = rewards.score(
            c.task.name, texts, metas, format_weight=float(c.task.format_reward)
        )
        per_row = dict(components, reward=r, lengths=host["lengths"], truncated=host["truncated"])
        if answers is not None:
            per_row["answer_code"] = multihost.answer_codes(
                evaluation.final_answers(answers, texts)
            )
        per_row = {k: multihost.gather_rows(v, ro.tokens) for k, v in per_row.items()}
        fails = multihost.sum_counts(fails, ro.tokens)
        r = per_row.pop("reward")
        host = {k: per_row.pop(k) for k in ("lengths", "truncated")}
        return r, per_row, fails, host

    def evaluate(self, params, examples=None) -> dict[str, float]:
        """Held-out metrics on the first ``task.eval_size`` test prompts (or ``examples``).

        ``eval_reward_mean`` is the mean reward of ``task.eval_samples`` samples
        per prompt at the rollout's sampling settings: the RL objective itself,
        on prompts never trained on. ``eval_greedy_reward`` is greedy decoding's.
        Both use fixed keys, so every evaluation sees the same randomness. From the
        same samples, :func:`gspo_jax.evaluation.eval_metrics`: ``eval/pass@k`` and
        ``eval/maj@k`` for k in ``task.eval_pass_k``, ``eval/mean@n`` (n the samples
        per prompt) and ``eval/greedy``.
        """
        c = self.c
        if examples is None:
            examples = self.eval_data.first(int(c.task.eval_size))
        k = int(c.task.eval_samples)
        ro, cut = self._rollout(params, examples, jax.random.key(c.seed + 2), num_samples=k)
        # A user-file task's answers are read as its verifier reads them (numeric: values).
        kind = c.task.get("verifier", "") if c.task.name == "file" else c.task.name
        _, sampled, _, _ = self.score(examples, ro, num_samples=k, answers=kind)
        answers = multihost.codes_to_answers(sampled["answer_code"])
        ro, _ = self._rollout(params, examples, jax.random.key(0), greedy=True, num_samples=1)
        _, greedy, _, _ = self.score(examples, ro, num_samples=1)
        out = {
            "eval_reward_mean": float(np.mean(sampled["correct"])),
            "eval_greedy_reward": float(np.mean(greedy["correct"])),
            "eval_prompts_truncated": cut,
        }
        out.update(
            evaluation.eval_metrics(
                np.asarray(sampled["correct"]).reshape(len(examples), k),
                [answers[i * k : (i + 1) * k] for i in range(len(examples))],
                ks=[int(x) for x in c.task.eval_pass_k],
                greedy_correct=greedy["correct"],
            )
        )
        return out

    def collect(self, params, step_idx: int, rng) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Rollouts, rewards, advantages and DAPO's filters for one RL step.

        Rounds of sample -> score -> shape and filter, until the kept groups fill
        the batch (one round without dynamic sampling); then the batch is filled
        and given its advantages. Returns the batch (without old log-probs), on the
        devices, and host metrics. Of the rollouts only the response token ids,
        lengths and truncation flags came to the host (`score`).
        """
        c = self.c
        n_prompts = int(c.rollout.prompts_per_step)
        max_rounds = int(c.dapo.max_sampling_rounds) if c.dapo.dynamic_sampling else 1
        rounds: list[_Round] = []
        for rnd in range(max_rounds):
            # Round r of step s reads prompts at position (s * max_rounds + r) * n_prompts,
            # a pure function of the step: resume needs no extra data state.
            pos = (step_idx * max_rounds + rnd) * n_prompts
            examples, ro, cut, seconds = self.sample(params, pos, jax.random.fold_in(rng, rnd))
            r, components, fails, host = self.score(examples, ro)
            shaped, rows, groups_kept = self.shape_and_filter(host, r, components["correct"])
            rounds.append(
                _Round(ro, host, shaped, components, fails, rows, groups_kept, cut, seconds)
            )
            if sum(r.groups_kept for r in rounds) >= n_prompts:
                break
        batch = self.fill_batch(rounds)
        self.advantages(batch)
        return batch, self._collect_metrics(rounds)

    def sample(self, params, pos: int, rng):
        """Stage 1, sample: the ``prompts_per_step`` prompts at data position ``pos``
        and ``group_size`` responses to each. Returns (examples, the rollout on the
        devices, the number of prompts truncated, seconds spent sampling)."""
        n = int(self.c.rollout.prompts_per_step)
        examples = self.train_data.batch(pos, n)
        t0 = time.perf_counter()
        # Keyed by data stream id, not split index: a batch across an epoch boundary
        # may hold one example twice, and the sampler needs distinct ids.
        ro, cut = self._rollout(
            params,
            examples,
            rng,
            prompt_ids=self.train_data.stream_ids(pos, n).tolist(),
            router_noise=True,
            routing=self.routing,
        )
        jax.block_until_ready(ro)
        return examples, ro, cut, time.perf_counter() - t0

    def shape_and_filter(
        self, host, r: np.ndarray, correct: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Stage 3, shape and filter (DAPO), on one round (``host``: the row lengths
        `score` returns): the soft overlong punishment added to the rewards ``r``; dynamic
        sampling keeps only the groups whose correctness differs (``correct``, the
        verifier's 0/1 per response: DAPO filters on accuracy, not on the shaped
        reward, so a length penalty or a format reward cannot keep a group whose
        answers are all right or all wrong). Overlong filtering (the mask of truncated
        responses zeroed) happens on the devices, in `_assemble`. Returns (the shaped
        rewards of every response, the rows of the kept groups, the number of groups
        kept)."""
        c = self.c
        g, T = int(c.rollout.group_size), int(c.rollout.max_new_tokens)
        if c.dapo.soft_overlong:
            length = np.asarray(host["lengths"], np.float32)
            r = r + jax.device_get(
                shaping.soft_overlong_penalty(
                    jnp.asarray(length), max_len=T, cache_len=int(c.dapo.overlong_cache_len)
                )
            )
        keep = (
            jax.device_get(shaping.dynamic_sampling_keep(jnp.asarray(correct).reshape(-1, g)))
            if c.dapo.dynamic_sampling
            else np.ones(len(r) // g, bool)
        )
        rows = np.flatnonzero(np.repeat(keep, g))
        return r, rows, int(keep.sum())

    def fill_batch(self, rounds: list[_Round]) -> dict[str, Any]:
        """Stage 3, the batch: exactly ``prompts_per_step`` groups from the rounds'
        kept rows, assembled on the devices (`_assemble`; only row indices go there
        from the host). If dynamic sampling fell short, the missing groups are copies
        of the first kept one (of row 0 if none was kept) whose mask is 0 (they add
        nothing). ``rewards`` (host, shaped) are the batch rows' rewards, for
        `advantages`."""
        c = self.c
        n_rows = int(c.rollout.prompts_per_step) * int(c.rollout.group_size)
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
        max_rounds = int(c.dapo.max_sampling_rounds) if c.dapo.dynamic_sampling else 1
        fields = _BATCH_FIELDS + _ROUTING_FIELDS[self.routing]
        parts = [{k: getattr(r.rollout, k) for k in fields} for r in rounds]
        parts += [parts[0]] * (max_rounds - len(parts))
        batch = self._assemble(
            tuple(parts), src_round.astype(np.int32), src_row.astype(np.int32), valid
        )
        batch["rewards"] = reward
        return batch

    def advantages(self, batch: dict[str, Any]) -> None:
        """Stage 4, advantages: replaces the batch's ``rewards`` (host) by per-response
        ``advantages`` over each group (``config.advantage``), on the devices. For GAE
        they need the critic's values, computed with the old log-probs
        (:meth:`RLPhase.prepare`): zeros here, and the rewards are kept as
        ``seq_rewards``."""
        c = self.c
        rg = np.asarray(batch.pop("rewards")).reshape(-1, int(c.rollout.group_size))
        if c.advantage == "group":
            a = adv_lib.group(jnp.asarray(rg))
        elif c.advantage == "group_no_std":
            a = adv_lib.group_no_std(jnp.asarray(rg))
        elif c.advantage == "rloo":
            a = adv_lib.rloo(jnp.asarray(rg))
        else:  # gae
            a = jnp.zeros_like(jnp.asarray(rg))
            batch["seq_rewards"] = self._put_rows(rg.reshape(-1).astype(np.float32))
        batch["advantages"] = self._put_rows(np.asarray(a, np.float32).reshape(-1))

    def _put_rows(self, x: np.ndarray) -> jax.Array:
        """A host [rows, ...] array (the same on every process) on the mesh, sharded over
        its rows as `put_batch` does."""
        return jax.device_put(x, self._batch_sharding(x))

    def _collect_metrics(self, rounds: list[_Round]) -> dict[str, Any]:
        """Host metrics of one step's rounds (every sampled response, kept or not)."""
        c = self.c
        n_prompts, g = int(c.rollout.prompts_per_step), int(c.rollout.group_size)
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


def _progress(c, total: int, start: int, desc: str):
    if c.progress_bar and multihost.is_primary():
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    class _Null:
        def update(self, n): ...
        def set_postfix(self, **kw): ...
        def close(self): ...

    return _Null()


def _gae_batch(seq_rewards, values, mask, *, gamma: float, lam: float):
    """GAE over response tokens with the sequence reward on its last token."""
    mask = mask.astype(jnp.float32)
    last = jnp.sum(mask, axis=1).astype(jnp.int32) - 1  # -1 for an empty response: no reward
    t = jnp.arange(mask.shape[1])[None, :]
    token_rewards = jnp.where(t == last[:, None], seq_rewards[:, None], 0.0) * mask
    return adv_lib.gae(token_rewards, values, mask, gamma=gamma, lam=lam)


def _take(batch: dict[str, jax.Array], idx: np.ndarray) -> dict[str, jax.Array]:
    return {k: v[idx] for k, v in batch.items()}


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


class RLPhase:
    """The RL phase of a :class:`Trainer`: compiled functions and the step loop."""

    def __init__(self, trainer: Trainer, params):
        self.t = trainer
        c = trainer.c
        self.updates_per_step = int(c.updates.num_minibatches) * int(c.updates.num_epochs)
        self.optimizer, self.sched = step.make_optimizer(
            lr=c.optimizer.lr,
            schedule=c.optimizer.schedule,
            total_steps=int(c.total_rl_steps) * self.updates_per_step,
            warmup_steps=c.optimizer.warmup_steps,
            end_lr_ratio=c.optimizer.end_lr_ratio,
            weight_decay=c.optimizer.weight_decay,
            b1=c.optimizer.b1,
            b2=c.optimizer.b2,
            grad_clip=c.optimizer.grad_clip,
            mu_dtype=c.optimizer.mu_dtype,
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
            cfg=trainer.step_cfg,
        )
        replay = c.updates.routing_replay
        self.critic = c.advantage == "gae"
        self.moe = trainer.model_cfg.num_moe_layers > 0
        logp_pass = functools.partial(
            step.logprob_pass,
            graphdef=trainer.graphdef,
            values=self.critic,
            temperature=float(c.rollout.temperature),
            micro_batches=int(c.updates.logprob_micro_batches),
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
        self.gae_fn = jax.jit(
            functools.partial(_gae_batch, gamma=float(c.gae.gamma), lam=float(c.gae.lam))
        )
        self.correction_fn = jax.jit(
            functools.partial(rollout_correction, rc=trainer.rollout_correction)
        )
        self.mismatch_fn = jax.jit(step.mismatch_metrics)
        # The mini-batches: the permutation and the gather on the devices.
        n = int(c.rollout.prompts_per_step) * int(c.rollout.group_size)
        self.perm_fn = jax.jit(
            functools.partial(_permutations, n=n, epochs=int(c.updates.num_epochs))
        )
        self.minibatch_fn = jax.jit(
            functools.partial(_minibatch, size=n // int(c.updates.num_minibatches)),
            out_shardings=NamedSharding(trainer.mesh, P(BATCH_AXES)),
        )

    def prepare(self, collected: dict[str, Any]) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """Device batch with old (and reference) log-probs, routing records and the
        rollout correction; and the step's train-inference mismatch metrics.
        ``collected``: `Trainer.collect`'s batch (on the devices already; host arrays
        are placed)."""
        c = self.t.c
        dev = self.t.put_batch(collected)
        old = self.logp_fn(self.state.params, dev)
        batch = {
            k: dev[k] for k in ("prompt_tokens", "prompt_mask", "tokens", "mask", "advantages")
        }
        batch.update(
            old_logp=old["logp"],
            old_topk=old["topk_resp"],
            old_free_topk=old["free_topk_resp"],
            old_router_logp=old["router_logp"],
        )
        if self.moe:  # the sampler's routing at the response positions
            if "sampler_topk" in dev:
                batch["sampler_topk"] = dev["sampler_topk"]
            else:
                p, t = dev["prompt_tokens"].shape[1], dev["tokens"].shape[1]
                batch["sampler_topk"] = step.response_slice(dev["replay_r3"], p, t)
        if c.updates.routing_replay == "R2":
            batch["replay"] = old["topk"]
        elif c.updates.routing_replay == "R3":
            batch["replay"] = dev["replay_r3"]
        if self.critic:
            batch["advantages"], batch["returns"] = self.gae_fn(
                dev["seq_rewards"], old["values"], dev["mask"]
            )
            batch["old_values"] = old["values"]
        if self.ref_params is not None:
            batch["ref_logp"] = self.ref_logp_fn(self.ref_params, dev)["logp"]
        info = self.mismatch_fn(
            dev["rollout_logp"],
            old["logp"],
            dev["mask"],
            batch.get("sampler_topk"),
            old["free_topk_resp"] if self.moe else None,
        )
        if self.t.rollout_correction.mode != "none":
            weight, rc_metrics = self.correction_fn(old["logp"], dev["rollout_logp"], dev["mask"])
            batch["rc_weight"] = weight
            info.update(metrics_lib.compute_all(rc_metrics))
        return batch, info

    def step(self, s: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One RL step: collect, prepare, update. Returns the step's summary metrics
        and one record per optimizer update (``k``: its index within the rollout)."""
        t, c = self.t, self.t.c
        rng = jax.random.fold_in(jax.random.key(c.seed + 1), s)
        t0 = time.perf_counter()
        collected, info = t.collect(self.state.params, s, rng)
        t1 = time.perf_counter()
        batch, pinfo = self.prepare(collected)
        jax.block_until_ready(batch)
        t2 = time.perf_counter()
        perm = self.perm_fn(jax.random.fold_in(rng, 1_000_003))
        ms, where = [], []
        for epoch in range(int(c.updates.num_epochs)):
            for j in range(int(c.updates.num_minibatches)):
                mini = self.minibatch_fn(batch, perm, np.int32(epoch), np.int32(j))
                self.state, m = self.train_fn(
                    self.state, mini, jax.random.fold_in(rng, 7 + len(ms))
                )
                ms.append(m)
                where.append({"k": len(where), "epoch": epoch, "minibatch": j})
        ms, pinfo, mask_sum = jax.device_get((ms, pinfo, jnp.sum(batch["mask"])))
        t3 = time.perf_counter()
        updates = [dict(w, **u) for w, u in zip(where, ms)]
        m = summarize_updates(ms)
        m.update(info)
        m.update(pinfo)
        step_time = t3 - t0
        trained_tokens = float(mask_sum) * int(c.updates.num_epochs)
        m.update(
            step_time=step_time,
            rollout_time=t1 - t0,
            old_logp_time=t2 - t1,
            update_time=t3 - t2,
            tokens_per_s=(info["gen_tokens"] + trained_tokens) / step_time,
        )
        return m, updates


def enable_compilation_cache(path: str) -> str | None:
    """Turn on JAX's persistent compilation cache at `path` (every program,
    however fast it compiled), unless the environment already names a cache
    directory.  Returns the directory in use (None when off)."""
    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or None
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run; it only compiles every time
        print(
            f"config.compilation_cache_dir: cannot create {path!r} ({e}); running without "
            "the persistent compilation cache",
            flush=True,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # pick up the directory even after earlier compiles
    return path


def run(c: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Run (or resume) the whole job: supervised warm start, then RL.

    The workdir is locked for this trainer; a resume with a config that changes what
    its checkpoints mean is refused before anything is written; SIGTERM or SIGINT
    ends the run after the current step with a checkpoint (`gspo_jax.safety`).
    With several processes (`maybe_initialize_distributed`) every process calls this
    with the same config and workdir (a file system they share); only the first writes
    logs and the run's config (`gspo_jax.multihost`).
    """
    enable_compilation_cache(str(c.get("compilation_cache_dir", "")))
    os.makedirs(workdir, exist_ok=True)
    primary = multihost.is_primary()
    with safety.RunGuard(workdir, lock=primary) as guard:
        config_lib.move_deprecated(c)  # before the comparison with the saved config
        safety.check_resume_config(c, workdir)
        trainer = Trainer(c, workdir)  # validates the config
        multihost.barrier("resume config checked")  # by every process, before it is replaced
        if primary:
            safety.save_run_config(c, workdir)
        record = safety.config_record(c)
        with open_wandb(c.wandb, workdir, record, enabled=primary) as wb:
            return _run(trainer, guard, wb)


def _run(trainer: Trainer, guard: safety.RunGuard, wb=None) -> list[dict]:
    c, workdir = trainer.c, trainer.workdir
    rl_ckpt = PhaseCheckpointer(
        workdir, "rl", every=int(c.checkpoint_every), keep=int(c.keep_checkpoints)
    )
    resuming_rl = rl_ckpt.latest_step() is not None
    primary = multihost.is_primary()  # the one process that writes the logs

    def open_log(phase: str, step_: int) -> MetricsWriter:
        """metrics.jsonl cut back to (phase, step_): where this run resumes."""
        return MetricsWriter(
            workdir, resume_step=step_, resume_phase=phase, wandb=wb, enabled=primary
        )

    writer = None
    if int(c.sft.steps) > 0 and not resuming_rl:
        params, writer = trainer.run_sft(open_log, guard)
    elif int(c.sft.steps) > 0 and trainer.kl_coef:  # RL resumes; its KL term needs pi_ref
        params = _reference_for_resume(trainer)
    else:  # no warm start, or RL resumes from its own checkpoint and needs nothing else
        params = trainer.init_params

    rl = RLPhase(trainer, params)
    rl_start = 0
    if resuming_rl:  # the newest checkpoint that restores (checkpoint.PhaseCheckpointer)
        rl.state, _, rl_start = rl_ckpt.restore(rl.state)
    if writer is None:  # RL resumes at rl_start, or starts afresh (-1: no RL line kept)
        writer = open_log("rl", rl_start if resuming_rl else -1)
    # One record per optimizer update, cut back to the RL checkpoint like metrics.jsonl.
    update_writer = MetricsWriter(
        workdir,
        resume_step=rl_start,
        resume_phase="rl",
        filename="updates.jsonl",
        tb_prefix="updates",
        wandb=wb,
        enabled=primary,
    )
    records = []
    steps = int(c.total_rl_steps)
    if rl_start == 0:
        rec = writer.write(0, "rl", trainer.evaluate(rl.state.params))
        records.append(rec)
    bar = _progress(c, steps, rl_start, "rl")
    for s in range(rl_start, steps):
        m, updates = rl.step(s)
        for u in updates:
            update_writer.write(s + 1, "rl", u, tb_step=s * rl.updates_per_step + u["k"])
        safety.check_health(m, c, f"rl step {s + 1}")
        if (s + 1) % int(c.eval_every) == 0 or s + 1 == steps:
            m.update(trainer.evaluate(rl.state.params))
        if (s + 1) % int(c.log_every) == 0 or "eval_reward_mean" in m or s + 1 == steps:
            records.append(writer.write(s + 1, "rl", m))
        bar.set_postfix(
            reward=f"{m['reward_mean']:.3f}",
            clip=f"{m['clip_frac']:.3f}",
            flip=f"{m.get('flip_frac', 0.0):.3f}",
        )
        bar.update(1)
        meta = {"phase": "rl", "step": s + 1, "config": safety.config_record(c)}
        stop = guard.requested
        rl_ckpt.save(s + 1, rl.state, meta, force=(s + 1 == steps) or stop)
        if stop:
            rl_ckpt.close()
            update_writer.close()
            writer.close()
            guard.exit(f"rl step {s + 1}")
        guard.heartbeat()
    bar.close()
    rl_ckpt.close()
    update_writer.close()
    writer.close()
    return records


def _reference_for_resume(trainer: Trainer):
    """RL resumes and its KL term needs pi_ref, the warm start's final parameters: from
    the warm start's last checkpoint. The warm start is never repeated once RL has
    begun; if that checkpoint is gone (or does not restore), the run stops and says so.
    """
    params = trainer.warm_start_params()
    if params is None:
        c = trainer.c
        path = os.path.join(trainer.workdir, "checkpoints", "sft", str(c.sft.steps))
        raise FileNotFoundError(
            f"RL resumes from its checkpoint, but the warm start's last checkpoint ({path}) "
            f"is gone or does not restore, and the KL term (kl_coef={trainer.kl_coef}) needs "
            "the reference policy it holds. Restore that checkpoint to resume (a warm start "
            "is never repeated once RL has begun)."
        )
    return params


def main(argv: Sequence[str]) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    cfg = flags.FLAGS.config
    if cfg is None:
        raise config_lib.ConfigError("--config is required, e.g. --config=configs/default.py")
    claimed = claim_device_memory()
    maybe_initialize_distributed(cfg.distributed)
    if claimed and jax.default_backend() == "gpu":
        print(f"gspo_jax: {claimed}", file=sys.stderr)
    run(cfg, flags.FLAGS.workdir)


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string(
        "workdir", "runs/default", "Where checkpoints, metrics and TensorBoard events go."
    )


def unknown_override(argv: Sequence[str]) -> str | None:
    """The one-line message for the first ``--config.<key>=...`` of ``argv`` that names no
    field of the config ``--config=<file>[:arg]`` builds (None if every key exists)."""
    import runpy

    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    c = runpy.run_path(path)["get_config"](arg or None)
    for a in argv:
        if not a.startswith("--config."):
            continue
        key = a[len("--config.") :].split("=", 1)[0]
        node = c
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                return config_lib.unknown_key_message(key, c)
            node = node[part]
    return None


def _parse_flags(argv: Sequence[str]):
    """absl's flag parsing, but an unknown ``--config.<key>`` is one line naming it and
    its closest known key (ml_collections raises a long AttributeError)."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error):
        message = unknown_override(argv)
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main, flags_parser=_parse_flags)
