"""The run's parts: tokenizer, mesh, data, model and sampler, and what every phase does
with them (place batches on the mesh, compile a donated step, sample and score).

:class:`RunParts` holds them; the phases use them: the warm start (:mod:`gspo_jax.sft`),
one RL step (:mod:`gspo_jax.rl`) and evaluation (:func:`gspo_jax.heldout.evaluate`).
The run itself, its loop over phases, logs, checkpoints and resume, is
:mod:`gspo_jax.train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import config as config_lib
from gspo_jax import (
    heldout,
    lora_training,
    multihost,
    offpolicy,
    reward_plugins,
    rewards,
    safety,
    step,
    tasks,
)
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN
from gspo_jax.data import PromptSource
from gspo_jax.data.encoding import PromptCheck, encode_prompt, fit_prompts
from gspo_jax.models import from_pretrained, init_sharded, lora
from gspo_jax.models.precision import SamplerPrecision
from gspo_jax.models.sharding import BATCH_AXES, make_mesh, on_mesh
from gspo_jax.rollout import Sampler
from gspo_jax.tokenizers import CharTokenizer, HFTokenizer


def make_tokenizer(path: str):
    """``config.tokenizer``: "char", or a checkpoint directory holding tokenizer.json."""
    if path == "char":
        return CharTokenizer(words=(ANSWER_OPEN, ANSWER_CLOSE))
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise config_lib.ConfigError(f"config.tokenizer: no tokenizer.json in {path!r}")
    return HFTokenizer.from_dir(path)


class RunParts:
    """The run's parts (tokenizer, mesh, data, model, sampler); the math lives in
    :mod:`gspo_jax.step`, the phases in :mod:`gspo_jax.sft` and :mod:`gspo_jax.rl`."""

    def __init__(self, c: ml_collections.ConfigDict, workdir: str):
        """``c``: the command line's config, loaded here once (`gspo_jax.config.load`):
        the run's parts read the frozen `RunConfig` (``self.cfg``) alone."""
        self.workdir = workdir
        self.tokenizer = make_tokenizer(c.tokenizer)
        n = jax.device_count()
        self.cfg = cfg = config_lib.load(c, n, tokenizer_vocab_size=self.tokenizer.vocab_size)
        # The config as config.json and each checkpoint's record store it.
        self.record = safety.config_record(c)
        mesh_shape = config_lib.Context(cfg, n, self.tokenizer.vocab_size).mesh_shape
        if cfg.rollout.devices:  # the sampler on devices of its own (gspo_jax.offpolicy)
            train_devices, sampler_devices = offpolicy.split_devices(cfg.rollout.devices)
            self.mesh = make_mesh(mesh_shape, train_devices)
            self.sampler_mesh = offpolicy.sampler_mesh(self.mesh, sampler_devices)
        else:
            self.mesh = self.sampler_mesh = make_mesh(mesh_shape)
        os.makedirs(workdir, exist_ok=True)
        data_dir = cfg.task.data_dir or os.path.join(workdir, "data")
        options = tasks.get(cfg.task.name).options(cfg.task)  # the task's own PromptSource options
        check = PromptCheck(self.tokenizer, cfg.rollout.max_prompt_len, cfg.rollout.long_prompts)
        kw = dict(
            data_dir=data_dir, seed=cfg.seed, style=cfg.task.style, prompt_check=check, **options
        )
        # One process prepares a data set that is not on disk yet; the others then read it.
        if not multihost.is_primary():
            multihost.barrier("data prepared")
        self.train_data = PromptSource(cfg.task.name, "train", **kw)
        self.eval_data = PromptSource(cfg.task.name, "test", shuffle=False, **kw)
        if multihost.is_primary():
            multihost.barrier("data prepared")

        # The policy, created already sharded. Each batch shard dispatches its own
        # tokens to the experts (ModelConfig.moe_groups).
        moe_groups = int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        if cfg.model.pretrained:
            model = from_pretrained(
                cfg.model.pretrained,
                mesh=self.mesh,
                value_head=cfg.advantage == "gae",
                # Embedding rows past the tokenizer's vocabulary are padding: never sampled.
                num_valid_tokens=self.tokenizer.vocab_size,
                moe_groups=moe_groups,
                **{k: getattr(cfg.model, k) for k in config_lib.MODEL_RUNTIME_FIELDS},
            )
            self.model_cfg = model.cfg
            graphdef, params = nnx.split(model)
        else:
            self.model_cfg = dataclasses.replace(
                config_lib.model_config(cfg, self.tokenizer.vocab_size), moe_groups=moe_groups
            )
            model = init_sharded(self.model_cfg, self.mesh, seed=cfg.seed)
            graphdef, params = nnx.split(model)
        if cfg.lora.rank:  # adapters after the base (gspo_jax.lora_training)
            lora_training.attach(model, cfg.lora, cfg.seed, self.mesh, self.model_cfg)
            graphdef, params = nnx.split(model)
        non_params = nnx.split(model, nnx.Param, ...)[2]
        if jax.tree.leaves(non_params):
            raise ValueError(
                "the model holds non-Param variables; the trainer expects parameters only"
            )
        # A pretrained model's experts are known once it is loaded (an initialised one's
        # are checked with the config: UpdatesConfig.check_run).
        replay = cfg.updates.routing_replay != "none"
        if cfg.model.pretrained and replay and self.model_cfg.num_moe_layers == 0:
            raise ValueError(
                f"updates.routing_replay={cfg.updates.routing_replay!r} needs MoE layers; "
                "the model is dense (num_experts=0): use 'none'"
            )
        self.graphdef = graphdef
        # One prompt length for the whole run: one program per batch size.
        self.max_prompt_len = cfg.rollout.max_prompt_len
        # The sampler's precision, where it is not the trainer's (rollout.sampler_dtype,
        # rollout.sampler_quantization): its own graph, and a copy of the parameters.
        self.sampler_precision = SamplerPrecision(
            graphdef,
            params,
            self.model_cfg,
            cfg.rollout.sampler_dtype,
            cfg.rollout.sampler_quantization,
        )
        self.sampler = Sampler(
            self.sampler_precision.graphdef,
            params,
            vocab_size=self.model_cfg.vocab_size,
            mesh=self.sampler_mesh,
            prompt_len=self.max_prompt_len,
            slots=cfg.rollout.decode_slots,
            refill_chunk=cfg.rollout.refill_chunk,
        )
        # Where the sampler reads the parameters (a copy on its own devices, if any).
        self.sampler_devices = offpolicy.SamplerDevices(
            self.mesh, self.sampler_mesh, self.sampler_precision.cfg
        )
        self.init_params = params  # where the warm start (or RL, without one) starts
        # pi_ref is needed (a KL term): the RL step keeps it, a resume restores it.
        self.kl_coef = float(getattr(cfg.objective.hparams, "kl_coef", 0.0))
        # A plug-in reward's calls: their time limit, and a batch where each failed.
        self.reward_fns = reward_plugins.RewardFnCalls(
            cfg.task.reward_fn_timeout, cfg.task.reward_fn_all_failed
        )

    # ---- device placement and compiled steps --------------------------------

    def _batch_sharding(self, x) -> NamedSharding:
        return NamedSharding(self.mesh, P(BATCH_AXES, *([None] * (np.ndim(x) - 1))))

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The batch on the mesh, every array sharded over its first (row) axis."""
        return {k: jax.device_put(v, self._batch_sharding(v)) for k, v in batch.items()}

    def _state_shardings(self, state):
        return jax.tree.map(lambda x: x.sharding, state)

    def new_state(self, params, optimizer, trainable: str = "all") -> step.TrainState:
        """A fresh state whose every leaf lives on the mesh: parameters (and the
        optimizer moments that follow the ``trainable`` ones) sharded, scalars replicated."""
        moments = jax.jit(optimizer.init)(lora.partition(params, trainable)[0])
        state = step.TrainState.create(params, moments)
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
        :func:`gspo_jax.sft.sft_step`)."""
        shardings = self._state_shardings(state)
        jitted = jax.jit(
            functools.partial(fn, graphdef=self.graphdef, **static),
            in_shardings=(shardings, None, None),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        return on_mesh(jitted, self.mesh)

    def sampler_context(self):
        """Where the sampling side's small host-driven computations run (the RNG keys,
        DAPO's shaping): on a sampler device when the sampler has its own, so that they
        never wait behind the training programs queued on the first device."""
        if self.sampler_mesh is self.mesh:
            return contextlib.nullcontext()
        local = [
            d for d in self.sampler_mesh.devices.flat if d.process_index == jax.process_index()
        ]
        return jax.default_device(local[0])

    def put_rows(self, x: np.ndarray) -> jax.Array:
        """A host [rows, ...] array (the same on every process) on the mesh, sharded over
        its rows as `put_batch` does."""
        return jax.device_put(x, self._batch_sharding(x))

    # ---- sampling and scoring (the RL step and evaluation) -----------------

    def sources(self) -> dict[str, str]:
        """What each checkpoint records of the run's inputs that live outside the
        workdir and could change on disk under it (`safety.check_sources`): the
        tokenizer's fingerprint (its ids, chat template, BOS), hashed once."""
        return {"tokenizer": self._tokenizer_hash}

    @functools.cached_property
    def _tokenizer_hash(self) -> str:
        return hashlib.sha256(self.tokenizer.fingerprint().encode()).hexdigest()[:16]

    def fit_prompts(self, prompts, where: str = "a prompt") -> tuple[list[list[int]], int]:
        """`fit_prompts` with this run's ``rollout.max_prompt_len`` and ``long_prompts``."""
        cfg = self.cfg
        return fit_prompts(prompts, self.max_prompt_len, cfg.rollout.long_prompts, where)

    def rollout(
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
        cfg, tok = self.cfg, self.tokenizer
        ids, cut = self.fit_prompts([encode_prompt(tok, ex.prompt, ex.messages) for ex in examples])
        g = num_samples or cfg.rollout.group_size
        ro = self.sampler(
            ids,
            num_samples=g,
            max_new_tokens=cfg.rollout.max_new_tokens,
            rng=rng,
            temperature=0.0 if greedy else cfg.rollout.temperature,
            eos_id=list(tok.stop_ids),
            pad_id=tok.pad_id,
            prompt_ids=[ex.index for ex in examples] if prompt_ids is None else prompt_ids,
            state=self.sampler_devices.publish(self.sampler_precision.view(params)),
            router_noise_std=cfg.rollout.router_noise_std if router_noise else 0.0,
            routing=routing,
        )
        return ro, cut

    def texts(self, host: dict[str, np.ndarray]) -> list[str]:
        toks, lengths = host["tokens"], host["lengths"]
        return [self.tokenizer.decode(toks[i, : lengths[i]].tolist()) for i in range(len(toks))]

    def score(
        self,
        examples,
        ro,
        *,
        num_samples: int | None = None,
        answers: str | None = None,
        select: np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int], dict[str, np.ndarray]]:
        """Stage 2, score: the task's verifier on the decoded responses of rollout ``ro``
        (``num_samples`` per example; default: the group size).

        What of a rollout comes to the host is the response token ids, lengths and
        truncation flags; the rest stays on the devices. Each process decodes and
        verifies only the rows on its own devices; their per-row results are then
        gathered to every process (`gspo_jax.multihost`; in one process there is
        nothing to gather). ``answers``: also the final answers as `evaluation` reads
        them for this verifier kind, as codes (``components["answer_code"]``). ``select``:
        bool[n * G], only these rows are verified (and counted); the others' rewards and
        components are 0 (partial rollouts' unfinished responses, `gspo_jax.partial`).

        Returns (rewards [n * G], their components, verifier failure counts, and
        ``{"lengths", "truncated"}`` of every row), the same on every process.
        """
        cfg = self.cfg
        g = num_samples or cfg.rollout.group_size
        rows, host = multihost.local_rows(
            {"tokens": ro.tokens, "lengths": ro.lengths, "truncated": ro.truncated}
        )
        texts = self.texts(host)
        metas = [ex.meta for ex in examples for _ in range(g)][rows]
        pick = np.arange(len(texts)) if select is None else np.flatnonzero(select[rows])
        r, components, fails = rewards.score(
            cfg.task.name,
            [texts[i] for i in pick],
            [metas[i] for i in pick],
            format_weight=cfg.task.format_reward,
            reward_fns=self.reward_fns,
        )
        if select is not None:  # back to every row, 0 where not verified
            r, components = (
                _spread(r, pick, len(texts)),
                {k: _spread(v, pick, len(texts)) for k, v in components.items()},
            )
        per_row = dict(components, reward=r, lengths=host["lengths"], truncated=host["truncated"])
        if answers is not None:
            per_row["answer_code"] = multihost.answer_codes(heldout.final_answers(answers, texts))
        per_row = {k: multihost.gather_rows(v, ro.tokens) for k, v in per_row.items()}
        fails = multihost.sum_counts(fails, ro.tokens)
        r = per_row.pop("reward")
        host = {k: per_row.pop(k) for k in ("lengths", "truncated")}
        return r, per_row, fails, host


def _spread(x: np.ndarray, pick: np.ndarray, n: int) -> np.ndarray:
    """``x``'s values at rows ``pick`` of n rows, 0 elsewhere."""
    out = np.zeros((n,) + x.shape[1:], x.dtype)
    out[pick] = x
    return out


# The old name, kept with the old module path (gspo_jax.trainer) for one release.
Trainer = RunParts
