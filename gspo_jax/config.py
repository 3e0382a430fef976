"""The experiment config: its defaults, command-line arguments and validation.

Every file in ``configs/`` defines ``get_config(arg)`` by starting from
:func:`base_config` and changing what its experiment family needs. ``arg`` is a
comma-separated list of ``key=value`` items and flags, for example
``configs/default.py:objective=gspo,smoke``; :func:`parse_arg` reads it.

:func:`validate` checks a config before anything is built or compiled and raises
:class:`ConfigError` (a ``ValueError``) naming the offending field.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

GROUP_ADVANTAGES = ("group", "group_no_std", "rloo")
ADVANTAGES = GROUP_ADVANTAGES + ("gae",)
REPLAY_MODES = ("none", "R2", "R3")
TASKS = ("countdown", "arithmetic", "gsm8k")
SCHEDULES = ("constant", "cosine", "linear")
MESH_AXES = ("data", "fsdp", "expert", "tensor")


class ConfigError(ValueError):
    """An invalid experiment config; the message names the field."""


def base_config() -> ml_collections.ConfigDict:
    """The defaults every experiment family starts from: a tiny MoE on CPU."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_rl_steps = 60

    # Prompts.
    c.task = ml_collections.ConfigDict()
    c.task.name = "countdown"
    c.task.difficulty = "small"  # 3 numbers in 1..9, target 1..30
    c.task.data_dir = ""  # "" = <workdir>/data
    c.task.style = (
        "compact"  # prompt style: "compact" (character models) or "instruct" (chat models)
    )
    c.task.gsm8k_files = ""  # folder with GSM8K's jsonl files where TFDS cannot download them
    c.task.eval_size = 128  # held-out prompts scored every eval_every steps
    c.task.eval_samples = 4  # samples per held-out prompt (plus one greedy)
    c.task.format_reward = 0.0  # weight of the optional format reward

    c.tokenizer = "char"  # "char" or a checkpoint directory holding tokenizer.json

    # The policy.
    c.model = ml_collections.ConfigDict()
    c.model.pretrained = ""  # a Hugging Face checkpoint directory, or "" to init
    # Runtime settings, for an initialised and a loaded model alike.
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.moe_backend = "blocked"  # 'blocked' (CPU), 'ragged' (TPU/GPU grouped matmul), 'dense'
    c.model.scan_layers = True
    c.model.remat_policy = "none"
    # Architecture of an initialised model (ModelConfig fields); vocab_size 0 = the tokenizer's.
    c.model.fields = ml_collections.ConfigDict(
        dict(
            vocab_size=0,
            d_model=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            d_ff=256,
            moe_d_ff=128,
            num_experts=8,
            top_k=2,
        )
    )

    # Device mesh: sizes per axis; -1 takes the remaining devices.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))

    # Rollout.
    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 64
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 24
    c.rollout.temperature = 1.0
    # RL trains on the log-probs of the distribution that sampled: softmax(logits /
    # temperature). top_p < 1 or top_k > 0 would sample from a truncated distribution
    # whose log-probs the trainer does not compute, so RL refuses them (`validate`).
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    # Gaussian noise of this standard deviation on the sampler's router logits (never
    # the trainer's): a controlled train-inference routing mismatch for CPU studies
    # (experiments/router_noise.md).
    c.rollout.router_noise_std = 0.0

    # Rollout correction: importance weights pi_old / pi_sampler on the per-token
    # loss (docs/objectives.md, "Rollout correction"). mode: none, token_tis,
    # seq_tis, token_mask, seq_mask.
    c.rollout_correction = ml_collections.ConfigDict(
        dict(mode="none", cap=2.0, c_low=2.0, c_high=2.0, seq_ratio="geometric")
    )

    # Objective: name and every hyperparameter it takes (`set_objective`).
    c.objective = ml_collections.ConfigDict()
    set_objective(c, "gspo")

    c.advantage = "group"
    c.gae = ml_collections.ConfigDict(dict(gamma=1.0, lam=0.95, value_clip=0.2, value_coef=0.5))
    c.entropy_coef = 0.0

    # DAPO's data-side techniques.
    c.dapo = ml_collections.ConfigDict()
    c.dapo.dynamic_sampling = False
    c.dapo.max_sampling_rounds = 3  # rollouts per step at most, to fill the batch
    c.dapo.overlong_filter = False
    c.dapo.soft_overlong = False
    c.dapo.overlong_cache_len = 8

    # Updates per rollout (the off-policy regime where MoE instability shows).
    c.updates = ml_collections.ConfigDict()
    c.updates.num_minibatches = 2  # optimizer steps per rollout and epoch
    c.updates.num_epochs = 1
    c.updates.micro_batches = 1  # gradient accumulation inside a mini-batch
    c.updates.routing_replay = "none"
    c.updates.gamma_min = 0.5  # RSPO's floor on the router-shift weight
    # Router losses in RL: off by default (the warm start keeps its own, sft.*). When
    # on, the load-balancing loss's expert load is the free router's, even under replay.
    c.updates.aux_loss_coef = 0.0
    c.updates.z_loss_coef = 0.0
    # A mini-batch whose advantages are all zero carries no RL signal; by default it
    # makes no update (router losses, KL or entropy alone would drive one). Counted
    # as ``no_signal_minibatches``.
    c.updates.update_without_signal = False
    # Non-finite losses or gradients skip the update; more than this many in a row
    # stop the run with an error.
    c.updates.max_consecutive_skips = 8

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.lr = 2e-4
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 5
    c.optimizer.end_lr_ratio = 0.1
    c.optimizer.weight_decay = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.99
    c.optimizer.grad_clip = 1.0

    # Supervised warm start on generated solutions (0 steps = skip).
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 300
    c.sft.batch_size = 64
    c.sft.lr = 3e-3
    c.sft.warmup_steps = 20
    c.sft.aux_loss_coef = 0.01  # the warm start's load-balancing loss

    c.eval_every = 10
    c.log_every = 1
    c.checkpoint_every = 20
    c.keep_checkpoints = 3
    c.progress_bar = True
    # Persistent XLA compilation cache: a restarted or resumed job (and every
    # later job with the same programs) loads its executables instead of
    # compiling them again.  "" turns it off; a JAX_COMPILATION_CACHE_DIR set in
    # the environment takes precedence.
    c.compilation_cache_dir = "~/.cache/gspo_jax/xla"
    return c


def set_objective(
    c: ml_collections.ConfigDict, name: str, hparams: dict[str, Any] | None = None
) -> ml_collections.ConfigDict:
    """Selects objective ``name`` and writes every hyperparameter it takes into
    ``c.objective.hparams``: its defaults (its hyperparameter dataclass,
    docs/objectives.md), updated by ``hparams``.

    With all of them present, any one can be overridden from the command line
    (``--config.objective.hparams.eps_high=0.3``) although the config is locked.
    ``c.objective.hparams_of`` records ``name``: `validate` refuses a config whose
    objective was renamed afterwards, since its hyperparameters would be another
    objective's.
    """
    from gspo_jax import objectives  # local: keeps config import light
    from gspo_jax.objectives.hparams import field_types

    _check_objective_name(name)
    objective = objectives.get(name)
    defaults = objective.defaults
    # A None default becomes a typed placeholder (the field's annotated type), so that
    # the command line can still set it.
    types = field_types(objective.hparams_class)
    unknown = sorted(set(hparams or {}) - set(defaults))
    if unknown:
        raise _err(
            "objective.hparams",
            f"{name} takes no hyperparameter(s) {unknown}; it takes {sorted(defaults)}",
        )
    values = {**defaults, **(hparams or {})}
    fields = ml_collections.ConfigDict()
    for key, value in values.items():
        if value is None:
            fields[key] = ml_collections.config_dict.placeholder(types[key])
        else:
            fields[key] = value
    c.objective.name = name
    c.objective.hparams = fields
    c.objective.hparams_of = name
    return c


def _check_objective_name(name: str) -> None:
    from gspo_jax import objectives  # local: keeps config import light

    if name not in objectives.names():
        raise _err("objective.name", f"unknown objective {name!r}; known: {objectives.names()}")


def parse_arg(arg: str | None, known: tuple[str, ...]) -> dict[str, Any]:
    """``"objective=gspo,smoke"`` -> ``{"objective": "gspo", "smoke": True}``.

    A bare item is a flag (True); ``key=true`` / ``key=false`` (any case) are
    booleans; other values stay strings. A key outside ``known`` raises
    ConfigError naming it, so a typo cannot silently fall back to a default.
    """
    out: dict[str, Any] = {}
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            key, value = (x.strip() for x in item.split("=", 1))
            lowered = value.lower()
            out[key] = True if lowered == "true" else False if lowered == "false" else value
        else:
            key = item
            out[key] = True
        if key not in known:
            raise ConfigError(
                f"config argument {key!r} is not one this config file takes; "
                f"it takes: {', '.join(known)}"
            )
    return out


def apply_smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrink a config so the whole job runs two SFT and two RL steps in seconds."""
    c.total_rl_steps = 2
    c.sft.steps = 2
    c.sft.batch_size = 8
    c.task.eval_size = 8
    c.task.eval_samples = 2
    c.eval_every = 2
    c.checkpoint_every = 1
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 16
    c.updates.num_minibatches = 2
    c.updates.micro_batches = 1
    c.model.fields.d_model = 32
    c.model.fields.num_layers = 2
    c.model.fields.num_heads = 2
    c.model.fields.num_kv_heads = 1
    c.model.fields.head_dim = 16
    c.model.fields.d_ff = 64
    c.model.fields.moe_d_ff = 32
    c.model.fields.num_experts = 4
    c.model.fields.top_k = 2
    c.progress_bar = False
    return c


def _err(field: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{field}: {msg}")


def mesh_shape(c: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Resolve the mesh sizes (at most one -1) against the device count."""
    sizes = {}
    for axis in MESH_AXES:
        if axis not in c.mesh:
            raise _err(f"mesh.{axis}", "missing mesh axis")
        v = int(c.mesh[axis])
        if v == 0 or v < -1:
            raise _err(f"mesh.{axis}", f"size must be positive or -1, got {v}")
        sizes[axis] = v
    extra = set(c.mesh.keys()) - set(MESH_AXES)
    if extra:
        raise _err(f"mesh.{sorted(extra)[0]}", f"unknown mesh axis; axes are {MESH_AXES}")
    free = [a for a, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise _err(f"mesh.{free[1]}", "only one mesh axis may be -1")
    fixed = 1
    for a, v in sizes.items():
        if v != -1:
            fixed *= v
    if free:
        if num_devices % fixed:
            raise _err(
                f"mesh.{free[0]}",
                f"the fixed axes multiply to {fixed}, which does not divide the {num_devices} devices",
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise _err(
            "mesh", f"axis sizes {sizes} multiply to {fixed}, but there are {num_devices} devices"
        )
    return sizes


def validate(c: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Check a config before anything compiles; return the resolved mesh shape.

    Raises ConfigError naming the first invalid field.
    """
    from gspo_jax import objectives  # local: keeps config import light

    _check_objective_name(c.objective.name)
    if c.objective.get("hparams_of", c.objective.name) != c.objective.name:
        raise _err(
            "objective.name",
            f"is {c.objective.name!r} but objective.hparams hold "
            f"{c.objective.hparams_of!r}'s; pick the objective with the config's argument "
            "(configs/default.py:objective=<name>) or config.set_objective",
        )
    try:
        objectives.get(c.objective.name).validate_hyperparameters(dict(c.objective.hparams))
    except ValueError as e:
        raise _err("objective.hparams", str(e)) from None

    if c.task.name not in TASKS:
        raise _err("task.name", f"unknown task {c.task.name!r}; known: {TASKS}")
    if c.task.name == "gsm8k":
        if c.task.difficulty:
            raise _err(
                "task.difficulty",
                f"gsm8k has no difficulty levels; set it to '' (got {c.task.difficulty!r})",
            )
    else:
        from gspo_jax.data import arithmetic, countdown  # local: TFDS is heavy

        builder = (
            countdown.GspoCountdown if c.task.name == "countdown" else arithmetic.GspoArithmetic
        )
        levels = [b.name for b in builder.BUILDER_CONFIGS]
        if c.task.difficulty not in levels:
            raise _err(
                "task.difficulty",
                f"{c.task.name} has no level {c.task.difficulty!r}; known: {levels}",
            )
    if c.task.style not in ("compact", "instruct"):
        raise _err("task.style", f"unknown prompt style {c.task.style!r}; known: compact, instruct")
    if c.advantage not in ADVANTAGES:
        raise _err("advantage", f"unknown advantage estimator {c.advantage!r}; known: {ADVANTAGES}")
    if c.advantage == "gae" and c.objective.name != "ppo":
        raise _err("advantage", "'gae' needs a critic; it is used with objective 'ppo'")
    for field in ("gamma", "lam"):
        if not 0.0 <= float(c.gae[field]) <= 1.0:
            raise _err(f"gae.{field}", f"must be in [0, 1], got {c.gae[field]}")
    if int(c.seed) < 0:
        raise _err("seed", f"must be >= 0 (it seeds numpy's RandomState), got {c.seed}")
    if int(c.sft.steps) > 0 and int(c.sft.batch_size) < 1:
        raise _err("sft.batch_size", f"must be >= 1, got {c.sft.batch_size}")
    g = int(c.rollout.group_size)
    if g < 1:
        raise _err("rollout.group_size", f"must be >= 1, got {g}")
    if c.advantage in GROUP_ADVANTAGES and g < 2:
        raise _err(
            "rollout.group_size",
            f"group advantages ({c.advantage!r}) need a group of at least 2, got {g}",
        )
    if c.dapo.dynamic_sampling and g < 2:
        raise _err("rollout.group_size", "dynamic sampling needs a group of at least 2")
    for field in ("prompts_per_step", "max_new_tokens"):
        if int(c.rollout[field]) < 1:
            raise _err(f"rollout.{field}", f"must be >= 1, got {c.rollout[field]}")
    temperature = float(c.rollout.temperature)
    if not (math.isfinite(temperature) and temperature > 0):
        raise _err(
            "rollout.temperature",
            f"must be finite and > 0 (RL samples, and trains on softmax(logits / "
            f"temperature)), got {c.rollout.temperature}",
        )
    if not 0 < c.rollout.top_p <= 1:
        raise _err("rollout.top_p", f"must be in (0, 1], got {c.rollout.top_p}")
    if c.rollout.top_p != 1:
        raise _err(
            "rollout.top_p",
            f"{c.rollout.top_p} truncates the sampling distribution, whose log-probs "
            "the trainer does not compute (the gradient would be biased); RL needs "
            'top_p = 1 (docs/objectives.md, "Conventions")',
        )
    if int(c.rollout.top_k) < 0:
        raise _err("rollout.top_k", f"must be >= 0, got {c.rollout.top_k}")
    if int(c.rollout.top_k) != 0:
        raise _err(
            "rollout.top_k",
            f"{c.rollout.top_k} truncates the sampling distribution, whose log-probs "
            "the trainer does not compute (the gradient would be biased); RL needs "
            'top_k = 0 (docs/objectives.md, "Conventions")',
        )
    noise = float(c.rollout.router_noise_std)
    if not (math.isfinite(noise) and noise >= 0):
        raise _err("rollout.router_noise_std", f"must be finite and >= 0, got {noise}")
    from gspo_jax.objectives.correction import RolloutCorrection

    try:
        RolloutCorrection(**dict(c.rollout_correction))
    except (TypeError, ValueError) as e:
        raise _err("rollout_correction", str(e)) from None
    for field in ("eval_size", "eval_samples"):
        if int(c.task[field]) < 1:
            raise _err(f"task.{field}", f"must be >= 1, got {c.task[field]}")
    if int(c.dapo.max_sampling_rounds) < 1:
        raise _err("dapo.max_sampling_rounds", "must be >= 1")
    if c.dapo.soft_overlong and not 0 < int(c.dapo.overlong_cache_len) < int(
        c.rollout.max_new_tokens
    ):
        raise _err("dapo.overlong_cache_len", "must be in (0, rollout.max_new_tokens)")

    f = c.model.fields
    if c.model.moe_backend not in ("blocked", "ragged", "dense"):
        raise _err(
            "model.moe_backend",
            f"unknown backend {c.model.moe_backend!r}; known: blocked, ragged, dense",
        )
    if c.model.pretrained and c.tokenizer == "char":
        raise _err(
            "tokenizer",
            "a pretrained model needs its own tokenizer: set it to the checkpoint directory",
        )
    if not c.model.pretrained:
        if int(f.num_experts) < 0:
            raise _err(
                "model.fields.num_experts", f"must be >= 0 (0: a dense model), got {f.num_experts}"
            )
        if int(f.num_experts) > 0:
            if int(f.top_k) > int(f.num_experts):
                raise _err(
                    "model.fields.top_k", f"top_k={f.top_k} exceeds num_experts={f.num_experts}"
                )
            if int(f.top_k) < 1:
                raise _err("model.fields.top_k", f"must be >= 1, got {f.top_k}")
        elif c.updates.routing_replay != "none":
            raise _err(
                "updates.routing_replay",
                f"{c.updates.routing_replay!r} needs MoE layers; "
                "model.fields.num_experts=0 is a dense model: use 'none'",
            )
        for field in ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff"):
            if int(f[field]) < 1:
                raise _err(f"model.fields.{field}", f"must be >= 1, got {f[field]}")
        if int(f.num_heads) % int(f.num_kv_heads):
            raise _err("model.fields.num_kv_heads", f"must divide num_heads={f.num_heads}")

    if c.updates.routing_replay not in REPLAY_MODES:
        raise _err(
            "updates.routing_replay",
            f"unknown mode {c.updates.routing_replay!r}; known: {REPLAY_MODES}",
        )
    if not c.model.pretrained and int(f.num_experts) == 0 and noise > 0:
        raise _err(
            "rollout.router_noise_std",
            f"{noise} needs MoE layers; model.fields.num_experts=0 is a dense model",
        )
    if int(c.updates.max_consecutive_skips) < 0:
        raise _err(
            "updates.max_consecutive_skips", f"must be >= 0, got {c.updates.max_consecutive_skips}"
        )
    if not 0 < c.updates.gamma_min <= 1:
        raise _err("updates.gamma_min", f"must be in (0, 1], got {c.updates.gamma_min}")

    shape = mesh_shape(c, num_devices)
    batch_shards = shape["data"] * shape["fsdp"]
    n = int(c.rollout.prompts_per_step) * g
    mb = int(c.updates.num_minibatches)
    if mb < 1 or n % mb:
        raise _err(
            "updates.num_minibatches",
            f"{mb} does not divide the rollout batch prompts_per_step*group_size = {n}",
        )
    micro = int(c.updates.micro_batches)
    if micro < 1 or (n // mb) % micro:
        raise _err(
            "updates.micro_batches",
            f"{micro} does not divide the mini-batch of {n // mb} sequences",
        )
    if (n // mb // micro) % batch_shards:
        raise _err(
            "mesh",
            f"the micro-batch of {n // mb // micro} sequences is not divisible by the "
            f"data*fsdp = {batch_shards} batch shards",
        )
    if int(c.sft.steps) > 0 and int(c.sft.batch_size) % batch_shards:
        raise _err(
            "sft.batch_size", f"{c.sft.batch_size} is not divisible by data*fsdp = {batch_shards}"
        )
    if int(c.updates.num_epochs) < 1:
        raise _err("updates.num_epochs", "must be >= 1")
    if c.optimizer.schedule not in SCHEDULES:
        raise _err(
            "optimizer.schedule", f"unknown schedule {c.optimizer.schedule!r}; known: {SCHEDULES}"
        )
    if not c.optimizer.lr > 0:
        raise _err("optimizer.lr", f"must be > 0, got {c.optimizer.lr}")
    for field in ("eval_every", "log_every", "checkpoint_every", "keep_checkpoints"):
        if int(c[field]) < 1:
            raise _err(field, f"must be >= 1, got {c[field]}")
    return shape
