"""The experiment config: its defaults, command-line arguments and validation.

Every file in ``configs/`` defines ``get_config(arg)`` by starting from
:func:`base_config` and changing what its experiment family needs. ``arg`` is a
comma-separated list of ``key=value`` items and flags, for example
``configs/default.py:objective=gspo,smoke``; :func:`parse_arg` reads it.

:func:`validate` checks a config before anything is built or compiled and raises
:class:`ConfigError` (a ``ValueError``) naming the offending field by its path
(``config.optimizer.lr: must be finite and > 0, got inf``); its docstring tables
every field's domain. :func:`unknown_key_message` turns a misspelt key into one line
with the closest known key (:func:`closest_key`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import sys
from typing import Any

import ml_collections
import numpy as np

GROUP_ADVANTAGES = ("group", "group_no_std", "rloo")
ADVANTAGES = GROUP_ADVANTAGES + ("gae",)
REPLAY_MODES = ("none", "R2", "R3")
TASKS = ("countdown", "arithmetic", "gsm8k", "file")
FILE_VERIFIERS = ("numeric", "countdown", "exact_match", "boxed_math")
BAD_ROWS = ("skip", "refuse")
LONG_PROMPTS = ("refuse", "truncate")
SCHEDULES = ("constant", "cosine", "linear")
MESH_AXES = ("data", "fsdp", "expert", "tensor")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DISTRIBUTED_MODES = ("auto", "on", "off")


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
    c.task.eval_pass_k = (1, 4)  # the k of eval/pass@k and eval/maj@k, each <= eval_samples
    c.task.format_reward = 0.0  # weight of the optional format reward
    # Task "file": a user's prompts and answers (gspo_jax/data/user_file.py; configs/file_task.py).
    c.task.file = ""  # the train rows: a .jsonl or .parquet file
    c.task.test_file = ""  # the test rows; "" = hold out test_fraction of task.file
    c.task.test_fraction = 0.1  # held-out fraction of task.file's valid rows without test_file
    c.task.prompt_column = "prompt"
    c.task.answer_column = "answer"  # the reference answer (countdown: the target integer)
    c.task.messages_column = ""  # "" = off; else a list of {role, content} in place of the prompt
    c.task.solution_column = ""  # "" = none (no warm start); else the SFT completion, verbatim
    c.task.verifier = "numeric"  # one of FILE_VERIFIERS, or a reward function "module:function"
    c.task.bad_rows = "skip"  # "skip" (each logged once) or "refuse" (the first raises)

    c.tokenizer = "char"  # "char" or a checkpoint directory holding tokenizer.json

    # The policy.
    c.model = ml_collections.ConfigDict()
    c.model.pretrained = ""  # a Hugging Face checkpoint directory, or "" to init
    # Runtime settings, for an initialised and a loaded model alike.
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.moe_backend = "auto"  # blocked on CPU, ragged on GPU/TPU; or one of them, or dense
    # Rows per block of the 'blocked' dispatch (an upper bound): each block gathers its
    # expert's weights, so larger blocks copy less (512 on a GPU or TPU: docs/memory.md).
    c.model.moe_block_size = 64
    c.model.scan_layers = True
    # Rematerialisation of each layer group's activations in the backward pass:
    # none, full, dots, dots_no_batch, dots_no_scores (docs/memory.md).
    c.model.remat_policy = "none"
    # Attention of the full forward: auto (cuDNN flash on an NVIDIA GPU where it
    # applies, else XLA), xla or cudnn.
    c.model.attention_impl = "auto"
    # Token log-probs take the [B, c, V] f32 logits c positions at a time (0 = the
    # whole sequence at once): a 152k vocabulary needs it (docs/memory.md).
    c.model.logits_chunk_size = 0
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
    # Every prompt is left-padded to max_prompt_len tokens: one shape for the sampler,
    # the log-prob passes and the train step (and SFT) over the whole run, so no batch
    # recompiles them. 64 fits Countdown's and arithmetic's compact prompts (at most 52
    # characters with BOS, at every difficulty). A longer prompt is refused (an error
    # naming this field and its length) with long_prompts "refuse", or with "truncate"
    # cut to its last max_prompt_len tokens (the end holds the question's end, the
    # answer format and the chat template's assistant turn) and counted in the RL
    # step's ``prompts_truncated`` (``eval_prompts_truncated``, SFT's too).
    c.rollout.max_prompt_len = 64
    c.rollout.long_prompts = "refuse"

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
    # The old-policy (and reference) log-prob passes run the rollout batch in this many
    # strided pieces, one after another: their activations and logits are those of
    # rollout rows / logprob_micro_batches at a time (docs/memory.md).
    c.updates.logprob_micro_batches = 1
    c.updates.routing_replay = "none"
    # Deprecated: RSPO's floor is objective.hparams.gamma_min. A value set here is moved
    # there, with a notice (`move_deprecated`).
    c.updates.gamma_min = ml_collections.config_dict.placeholder(float)
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
    # Storage of Adam's first moment: "bfloat16" halves it (docs/memory.md); the second
    # moment and the master parameters stay in float32.
    c.optimizer.mu_dtype = "float32"

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
    # Weights & Biases, beside TensorBoard and the JSONL files (pip install -e '.[wandb]').
    # mode "auto": online when credentials are set and the server answers, else offline;
    # name "" = the workdir's name; dir "" = the workdir (runs go to <dir>/wandb).
    c.wandb = ml_collections.ConfigDict(
        dict(enabled=False, project="gspo_jax", entity="", name="", mode="auto", dir="")
    )
    # Several processes (hosts) in one run: `gspo_jax.train.maybe_initialize_distributed`.
    # mode "auto": start jax.distributed when a coordinator is named (here or in
    # JAX_COORDINATOR_ADDRESS) or the environment is a multi-process srun or Open MPI
    # job or a TPU pod; "on": always (JAX detects what is not given); "off": never.
    # num_processes 0 and process_id -1: detected.
    c.distributed = ml_collections.ConfigDict(
        dict(mode="auto", coordinator_address="", num_processes=0, process_id=-1)
    )
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


def move_deprecated(c: ml_collections.ConfigDict) -> None:
    """Moves a value set at a deprecated path to its new one, with a one-line notice on
    stderr; the old path is then None (so a config reads the same either way):

      updates.gamma_min -> objective.hparams.gamma_min (RSPO's floor; under another
                           objective, which takes no floor, the value is dropped)

    Called by `validate`, and before a resume compares a config with the saved one."""
    old = c.updates.gamma_min
    if old is None:
        return
    _finite(c, "updates.gamma_min", low=0, high=1, low_open=True)
    if "gamma_min" in c.objective.hparams:
        from gspo_jax import objectives  # local: keeps config import light

        new = c.objective.hparams.gamma_min
        if new not in (old, objectives.get("rspo").defaults["gamma_min"]):
            raise _err(
                "updates.gamma_min",
                f"{old!r} conflicts with config.objective.hparams.gamma_min={new!r}; "
                "set only the latter (updates.gamma_min is deprecated)",
            )
        c.objective.hparams.gamma_min = float(old)
        where = f"now config.objective.hparams.gamma_min={float(old)!r}"
    else:
        where = f"dropped: objective {c.objective.name!r} takes no floor (RSPO's hyperparameter)"
    print(
        "gspo_jax: config.updates.gamma_min is deprecated; use "
        f"config.objective.hparams.gamma_min ({where})",
        file=sys.stderr,
    )
    c.updates.gamma_min = None


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
    c.task.eval_pass_k = (1, 2)
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


# --------------------------------------------------------------------------
# Unknown keys.


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every key of a ConfigDict, groups and leaves, as dotted paths."""
    out = []
    for key, value in node.items():
        out.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            out += _paths(value, f"{prefix}{key}.")
    return out


def _deepest_group(c: ml_collections.ConfigDict, parts: list[str]) -> tuple[str, Any]:
    """The deepest existing group along ``parts``: (its dotted path, the group)."""
    node, found = c, []
    for part in parts:
        if isinstance(node, ml_collections.ConfigDict) and part in node:
            child = node[part]
            if not isinstance(child, ml_collections.ConfigDict):
                break
            node = child
            found.append(part)
        else:
            break
    return ".".join(found), node


def closest_key(path: str, c: ml_collections.ConfigDict) -> str | None:
    """The key of ``c`` nearest to a misspelt ``path`` (``"config.optimzer.lr"`` or
    ``"optimzer.lr"``), as ``"config.optimizer.lr"``; None when nothing is close.

    Looks first under the deepest group of ``path`` that exists (``sft.lrr`` ->
    ``config.sft.lr``), then for a key of the same or a similar name anywhere
    (``config.lr`` -> ``config.sft.lr``). ``path`` itself is never the answer.
    """
    key = path.removeprefix("config.")
    parts = key.split(".")
    paths = [p for p in _paths(c) if p != key]
    group, _ = _deepest_group(c, parts[:-1])
    if group:
        rest = key[len(group) + 1 :]
        local = [p[len(group) + 1 :] for p in paths if p.startswith(group + ".")]
    else:
        rest, local = key, paths
    match = difflib.get_close_matches(rest, local, n=1, cutoff=0.6)
    if match:
        return "config." + (f"{group}.{match[0]}" if group else match[0])
    by_leaf: dict[str, list[str]] = {}
    for p in paths:
        by_leaf.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    match = difflib.get_close_matches(parts[-1], list(by_leaf), n=1, cutoff=0.8)
    if not match:
        return None
    best = max(by_leaf[match[0]], key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    return "config." + best


def unknown_key_message(path: str, c: ml_collections.ConfigDict) -> str:
    """One line for a key that ``c`` does not have, e.g.
    ``config.optimizer.lrr: unknown config key; did you mean config.optimizer.lr?``,
    or, with nothing close, the keys its group does have."""
    key = path.removeprefix("config.")
    suggestion = closest_key(key, c)
    if suggestion:
        return f"config.{key}: unknown config key; did you mean {suggestion}?"
    group, node = _deepest_group(c, key.split(".")[:-1])
    name = f"config.{group}" if group else "config"
    return f"config.{key}: unknown config key; {name} has: {', '.join(sorted(node.keys()))}"


# Groups whose keys are not base_config()'s: checked against their own schema.
_OPEN_GROUPS = ("objective.hparams", "model.fields")


def _check_keys(
    c: ml_collections.ConfigDict,
    base: ml_collections.ConfigDict,
    root: ml_collections.ConfigDict | None = None,
    prefix: str = "",
) -> None:
    """``c`` has exactly base_config()'s groups and keys (a typo in a config file
    would otherwise be a silently ignored new key). ``root``: the whole config, for
    the did-you-mean of a nested key."""
    root = c if root is None else root
    for key in c.keys():
        if key not in base:
            raise ConfigError(unknown_key_message(prefix + key, root))
    for key, default in base.items():
        path = prefix + key
        if key not in c:
            raise _err(path, "missing config key (base_config() defines it)")
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(c[key], ml_collections.ConfigDict):
                raise _err(path, f"must be a group of keys (a ConfigDict), got {c[key]!r}")
            if path not in _OPEN_GROUPS:
                _check_keys(c[key], default, root, path + ".")


# --------------------------------------------------------------------------
# Field domains.


def _get(c: ml_collections.ConfigDict, path: str) -> Any:
    node = c
    for part in path.split("."):
        node = node[part]
    return node


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _range(low=None, high=None, low_open=False, high_open=False) -> str:
    """`` >= 0``, `` > 0``, `` in [0, 1)`` ... (with a leading space), or ``""``."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def _in_range(v, low, high, low_open, high_open) -> bool:
    if low is not None and (v <= low if low_open else v < low):
        return False
    return high is None or (v < high if high_open else v <= high)


def _finite(
    c, path: str, *, low=None, high=None, low_open=False, high_open=False, why: str = ""
) -> float:
    """``config.<path>`` is a finite real number (not a bool, not None) in the range:
    ``_finite(c, "optimizer.lr", low=0, low_open=True)`` is lr in (0, inf)."""
    v = _get(c, path)
    if not (_is_real(v) and math.isfinite(v) and _in_range(v, low, high, low_open, high_open)):
        domain = _range(low, high, low_open, high_open)
        raise _err(path, f"must be finite{' and' + domain if domain else ''}{why}, got {v!r}")
    return float(v)


def _int(c, path: str, *, low=None, high=None, why: str = "") -> int:
    """``config.<path>`` is an int (not a bool, not 1.5) in [low, high]."""
    v = _get(c, path)
    if not (_is_int(v) and _in_range(v, low, high, False, False)):
        raise _err(path, f"must be an int{_range(low, high)}{why}, got {v!r}")
    return int(v)


def _bool(c, path: str) -> bool:
    v = _get(c, path)
    if not isinstance(v, (bool, np.bool_)):
        raise _err(path, f"must be a bool (True or False), got {v!r}")
    return bool(v)


def _str(c, path: str, *, choices: tuple[str, ...] | None = None, nonempty=False) -> str:
    v = _get(c, path)
    if not isinstance(v, str):
        raise _err(path, f"must be a string, got {v!r}")
    if choices is not None and v not in choices:
        raise _err(path, f"must be one of {choices}, got {v!r}")
    if nonempty and not v:
        raise _err(path, "must not be empty")
    return v


def _check_domains(c: ml_collections.ConfigDict) -> None:
    """Each field on its own: type, finiteness, sign and range (`validate`'s table)."""
    _int(c, "seed", low=0, high=2**32 - 1, why=" (it seeds numpy's RandomState)")
    _int(c, "total_rl_steps", low=0)
    _str(c, "tokenizer", nonempty=True)
    _str(c, "advantage")
    _finite(c, "entropy_coef", low=0)
    for path in ("eval_every", "log_every", "checkpoint_every", "keep_checkpoints"):
        _int(c, path, low=1)
    _bool(c, "progress_bar")
    _str(c, "compilation_cache_dir")
    _bool(c, "wandb.enabled")
    for path in ("wandb.project", "wandb.entity", "wandb.name", "wandb.dir"):
        _str(c, path)
    _str(c, "wandb.mode", choices=WANDB_MODES)
    _str(c, "distributed.mode", choices=DISTRIBUTED_MODES)
    _str(c, "distributed.coordinator_address")
    _int(c, "distributed.num_processes", low=0)
    _int(c, "distributed.process_id", low=-1)

    for path in ("task.name", "task.difficulty", "task.data_dir", "task.style"):
        _str(c, path)
    _str(c, "task.gsm8k_files")
    _int(c, "task.eval_size", low=1)
    _int(c, "task.eval_samples", low=1)
    _check_pass_k(c)
    _finite(c, "task.format_reward", low=0)
    for path in ("file", "test_file", "prompt_column", "answer_column", "messages_column"):
        _str(c, "task." + path)
    _str(c, "task.solution_column")
    _str(c, "task.verifier", nonempty=True)
    _str(c, "task.bad_rows", choices=BAD_ROWS)
    _finite(c, "task.test_fraction", low=0, high=1, high_open=True)

    _str(c, "model.pretrained")
    _check_model_runtime(c)
    _check_model_fields(c)
    for axis in c.mesh.keys():
        _mesh_axis(c, axis)

    for path in ("prompts_per_step", "group_size", "max_new_tokens"):
        _int(c, "rollout." + path, low=1)
    _finite(
        c,
        "rollout.temperature",
        low=0,
        low_open=True,
        why=" (RL samples, and trains on softmax(logits / temperature))",
    )
    _finite(c, "rollout.top_p", low=0, high=1, low_open=True)
    _int(c, "rollout.top_k", low=0)
    _finite(c, "rollout.router_noise_std", low=0)
    _int(c, "rollout.max_prompt_len", low=1)
    _str(c, "rollout.long_prompts", choices=LONG_PROMPTS)

    for path in ("objective.name", "objective.hparams_of"):
        _str(c, path)
    _finite(c, "gae.gamma", low=0, high=1)
    _finite(c, "gae.lam", low=0, high=1)
    _finite(c, "gae.value_clip", low=0)
    _finite(c, "gae.value_coef", low=0)

    for path in ("dynamic_sampling", "overlong_filter", "soft_overlong"):
        _bool(c, "dapo." + path)
    _int(c, "dapo.max_sampling_rounds", low=1)
    _int(c, "dapo.overlong_cache_len", low=1)

    for path in ("num_minibatches", "num_epochs", "micro_batches", "logprob_micro_batches"):
        _int(c, "updates." + path, low=1)
    _str(c, "updates.routing_replay")
    _finite(c, "updates.aux_loss_coef", low=0)
    _finite(c, "updates.z_loss_coef", low=0)
    _bool(c, "updates.update_without_signal")
    _int(c, "updates.max_consecutive_skips", low=0)

    _finite(c, "optimizer.lr", low=0, low_open=True)
    _str(c, "optimizer.schedule")
    _int(c, "optimizer.warmup_steps", low=0)
    _finite(c, "optimizer.end_lr_ratio", low=0, high=1)
    _finite(c, "optimizer.weight_decay", low=0)
    _finite(c, "optimizer.b1", low=0, high=1, high_open=True)
    _finite(c, "optimizer.b2", low=0, high=1, high_open=True)
    _finite(c, "optimizer.grad_clip", low=0, low_open=True, why=" (clipping is always on)")
    _str(c, "optimizer.mu_dtype", choices=("float32", "bfloat16"))

    _int(c, "sft.steps", low=0)
    _int(c, "sft.batch_size", low=1)
    _finite(c, "sft.lr", low=0, low_open=True)
    _int(c, "sft.warmup_steps", low=0)
    _finite(c, "sft.aux_loss_coef", low=0)


def _check_pass_k(c: ml_collections.ConfigDict) -> None:
    """``task.eval_pass_k``: the k of pass@k and maj@k, each in [1, task.eval_samples]."""
    ks, n = c.task.eval_pass_k, c.task.eval_samples
    if not (isinstance(ks, (list, tuple)) and ks and all(_is_int(k) for k in ks)):
        raise _err("task.eval_pass_k", f"must be a non-empty tuple of ints, got {ks!r}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise _err(
            "task.eval_pass_k",
            f"{bad} not in [1, task.eval_samples={n}] (pass@k and maj@k need k <= the samples)",
        )


def _mesh_axis(c: ml_collections.ConfigDict, axis: str) -> int:
    if axis not in MESH_AXES:
        raise _err(f"mesh.{axis}", f"unknown mesh axis; axes are {MESH_AXES}")
    v = _get(c, f"mesh.{axis}")
    if not (_is_int(v) and (v >= 1 or v == -1)):
        raise _err(f"mesh.{axis}", f"size must be an int >= 1, or -1 (the rest), got {v!r}")
    return int(v)


# Set on config.model, not config.model.fields (train.model_config copies them over).
MODEL_RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "moe_backend",
    "moe_block_size",
    "scan_layers",
    "remat_policy",
    "attention_impl",
    "logits_chunk_size",
)
# ModelConfig fields without a default: an initialised model needs them.
_MODEL_REQUIRED = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads")
_MODEL_REQUIRED += ("head_dim", "d_ff")
_MODEL_POSITIVE_INTS = _MODEL_REQUIRED[1:] + ("moe_every",)
_MODEL_NONNEGATIVE_INTS = ("vocab_size", "moe_d_ff", "num_experts", "top_k", "first_dense_layers")
# Derived by train.model_config from the tokenizer (the padding rows of a vocab_size
# larger than the tokenizer's); set here it could mask real tokens.
# ModelConfig fields the trainer sets, and from what.
_MODEL_DERIVED = {
    "num_valid_tokens": "derived from the tokenizer's vocabulary",
    "moe_groups": "set by the trainer to the mesh's batch shards",
}
_MODEL_POSITIVE_REALS = ("rope_theta", "norm_eps", "init_std")
_MODEL_NONNEGATIVE_REALS = ("aux_loss_coef", "z_loss_coef")
_MODEL_BOOLS = ("renormalize_topk", "qk_norm", "qkv_bias", "tie_embeddings", "value_head")


def _check_model_runtime(c: ml_collections.ConfigDict) -> None:
    from gspo_jax.models.config import ATTENTION_IMPLS, DTYPES, MOE_BACKENDS, REMAT_POLICIES

    _str(c, "model.dtype", choices=DTYPES)
    _str(c, "model.param_dtype", choices=DTYPES)
    _str(c, "model.moe_backend", choices=MOE_BACKENDS)
    _str(c, "model.remat_policy", choices=REMAT_POLICIES)
    _str(c, "model.attention_impl", choices=ATTENTION_IMPLS)
    _bool(c, "model.scan_layers")
    _int(c, "model.logits_chunk_size", low=0, why=" (0 = off)")
    _int(c, "model.moe_block_size", low=1)
    if c.model.attention_impl == "cudnn" and c.model.dtype == "float32":
        raise _err(
            "model.attention_impl",
            "'cudnn' (flash attention) needs model.dtype bfloat16 or float16, got float32; "
            "use 'auto' or 'xla'",
        )


def _check_model_fields(c: ml_collections.ConfigDict) -> None:
    """Every ModelConfig field present in config.model.fields, on its own."""
    from gspo_jax.models.config import ModelConfig

    f = c.model.fields
    known = [x.name for x in dataclasses.fields(ModelConfig)]
    for key in f.keys():
        path = f"model.fields.{key}"
        if key in MODEL_RUNTIME_FIELDS:
            raise _err(path, f"a runtime setting: set config.model.{key} (this one is ignored)")
        if key in _MODEL_DERIVED:
            raise _err(path, f"{_MODEL_DERIVED[key]}; leave it out")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean config.model.fields.{near[0]}?" if near else ""
            raise _err(path, f"not a ModelConfig field{hint}")
    if not c.model.pretrained:
        for key in _MODEL_REQUIRED:
            if key not in f:
                raise _err(f"model.fields.{key}", "missing (an initialised model needs it)")
    present = set(f.keys())
    for key in present & set(_MODEL_POSITIVE_INTS):
        _int(c, f"model.fields.{key}", low=1)
    for key in present & set(_MODEL_NONNEGATIVE_INTS):
        _int(c, f"model.fields.{key}", low=0)
    for key in present & set(_MODEL_POSITIVE_REALS):
        _finite(c, f"model.fields.{key}", low=0, low_open=True)
    for key in present & set(_MODEL_NONNEGATIVE_REALS):
        _finite(c, f"model.fields.{key}", low=0)
    for key in present & set(_MODEL_BOOLS):
        _bool(c, f"model.fields.{key}")
    if "dense_layers" in f:
        layers = f.dense_layers
        if not (isinstance(layers, (list, tuple)) and all(_is_int(i) for i in layers)):
            raise _err("model.fields.dense_layers", f"must be a list of ints, got {layers!r}")


def _check_model(c: ml_collections.ConfigDict, tokenizer_vocab_size: int | None) -> None:
    """An initialised model's fields against each other and the tokenizer, then
    ModelConfig's own checks (every error names config.model.fields.<x>)."""

    f = c.model.fields
    experts = int(f.get("num_experts", 0))
    if experts > 0:
        if not 1 <= int(f.get("top_k", 0)) <= experts:
            raise _err(
                "model.fields.top_k", f"must be in [1, num_experts={experts}], got {f.get('top_k')}"
            )
        if int(f.get("moe_d_ff", 0)) < 1:
            raise _err("model.fields.moe_d_ff", f"must be >= 1 with num_experts={experts}")
    if int(f.num_heads) % int(f.num_kv_heads):
        raise _err("model.fields.num_kv_heads", f"must divide num_heads={f.num_heads}")
    if int(f.head_dim) % 2:
        raise _err("model.fields.head_dim", f"must be even (rotary embedding), got {f.head_dim}")
    bad = [i for i in f.get("dense_layers", ()) if not 0 <= i < int(f.num_layers)]
    if bad:
        raise _err("model.fields.dense_layers", f"{bad} not in [0, num_layers={f.num_layers})")
    vocab = int(f.vocab_size)
    if tokenizer_vocab_size is not None and vocab and vocab < tokenizer_vocab_size:
        raise _err(
            "model.fields.vocab_size",
            f"{vocab} is smaller than the tokenizer's vocabulary of {tokenizer_vocab_size} "
            "(set it to 0 to take the tokenizer's)",
        )
    # ModelConfig's own checks, on the config the trainer will build.
    try:
        model_config(c, tokenizer_vocab_size or vocab or 1)
    except (TypeError, ValueError) as e:
        raise _from_dataclass_error(e, "ModelConfig", "model.fields", dict(f)) from None


def model_config(c: ml_collections.ConfigDict, tokenizer_vocab_size: int):
    """The ModelConfig of an initialised policy: ``model.fields`` with the runtime
    settings of ``config.model``; vocab_size 0 takes the tokenizer's, and a larger one
    marks the rows past the tokenizer's as padding (never sampled). Call `validate`
    first: its errors name the config fields."""
    from gspo_jax.models.config import ModelConfig  # local: keeps config import light

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in c.model.fields.items()}
    fields.update({k: c.model[k] for k in MODEL_RUNTIME_FIELDS})
    if c.advantage == "gae":
        fields["value_head"] = True
    if not fields.get("vocab_size"):
        fields["vocab_size"] = tokenizer_vocab_size
    elif fields["vocab_size"] > tokenizer_vocab_size:
        fields["num_valid_tokens"] = tokenizer_vocab_size
    return ModelConfig(**fields)


def _from_dataclass_error(e: Exception, name: str, group: str, keys) -> ConfigError:
    """``"<name>.key: msg"`` or ``"<name>: key msg"`` -> ``config.<group>.key: msg``."""
    msg = str(e)
    for sep in (".", ": "):
        head = f"{name}{sep}"
        if msg.startswith(head):
            key, _, rest = msg[len(head) :].partition(":" if sep == "." else " ")
            if key in keys:
                if group == "model.fields" and key in MODEL_RUNTIME_FIELDS:
                    return _err(f"model.{key}", rest.strip())
                return _err(f"{group}.{key}", rest.strip())
    return _err(group, msg)


# --------------------------------------------------------------------------
# The mesh.


def mesh_shape(c: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Resolve the mesh sizes (at most one -1) against the device count."""
    sizes = {}
    for axis in MESH_AXES:
        if axis not in c.mesh:
            raise _err(f"mesh.{axis}", "missing mesh axis")
    for axis in c.mesh.keys():
        sizes[axis] = _mesh_axis(c, axis)
    sizes = {a: sizes[a] for a in MESH_AXES}
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


def _check_file_task(c: ml_collections.ConfigDict) -> None:
    """Task "file": the fields that make a user's file usable (the file is read later)."""
    t = c.task
    if not t.file:
        raise _err("task.file", "task 'file' needs the path of a .jsonl or .parquet file")
    for path in ("file", "test_file"):
        if t[path] and not t[path].endswith((".jsonl", ".parquet")):
            raise _err(f"task.{path}", f"must end in .jsonl or .parquet, got {t[path]!r}")
    if not t.test_file and not t.test_fraction > 0:
        raise _err("task.test_fraction", "must be > 0 without task.test_file (the test split)")
    if not t.messages_column and not t.prompt_column:
        raise _err("task.prompt_column", "must name a column (or set task.messages_column)")
    if not t.answer_column:
        raise _err("task.answer_column", "must name a column")
    if int(c.sft.steps) > 0 and not t.solution_column:
        raise _err(
            "task.solution_column",
            f"the warm start (sft.steps={c.sft.steps}) trains on reference solutions: "
            "name the column holding them, or set sft.steps=0",
        )
    if ":" in t.verifier:
        from gspo_jax import rewards  # local: keeps config import light

        try:
            rewards.load_reward_fn(t.verifier)
        except ValueError as e:
            raise _err("task.verifier", " ".join(str(e).split())) from None
    elif t.verifier not in FILE_VERIFIERS:
        raise _err(
            "task.verifier",
            f"unknown verifier {t.verifier!r}; known: {FILE_VERIFIERS} or 'module:function'",
        )


# --------------------------------------------------------------------------
# Validation.


def validate(
    c: ml_collections.ConfigDict, num_devices: int, tokenizer_vocab_size: int | None = None
) -> dict[str, int]:
    """Check a config before anything compiles; return the resolved mesh shape.

    Raises ConfigError naming the first invalid field as its ``config.`` path, e.g.
    ``config.optimizer.lr: must be finite and > 0, got inf``. Three passes: the keys
    are base_config()'s (a misspelt key gets a did-you-mean); every field is in its
    domain (below); then the constraints between fields, the device count and the
    tokenizer.

    ``tokenizer_vocab_size``, where known, checks ``model.fields.vocab_size`` of an
    initialised model: 0 takes the tokenizer's, a smaller one is refused, a larger
    one is allowed (as real checkpoints pad the embedding; the sampler masks the
    padding rows).

    Domains ("finite": a real number, not a bool, not nan or +-inf; "int": not a bool,
    not 1.5; no field takes inf, which would always be a mistake here):

    =====================================================  ==================================
    seed                                                   int in [0, 2**32 - 1]
    total_rl_steps, sft.steps                              int >= 0
    optimizer.warmup_steps, sft.warmup_steps               int >= 0 (optimizer updates)
    eval_every, log_every, checkpoint_every,               int >= 1
    keep_checkpoints
    progress_bar, wandb.enabled                            bool
    wandb.project, entity, name, dir                       str ("" = default)
    wandb.mode                                             auto, online, offline, disabled
    distributed.mode                                       auto, on, off
    distributed.coordinator_address                        str ("" = detected)
    distributed.num_processes / .process_id                int >= 0 / >= -1 (0, -1 = detected)
    tokenizer                                              "char" or a directory (non-empty)
    compilation_cache_dir, task.data_dir,                  str ("" = off / default)
    task.gsm8k_files, model.pretrained
    advantage                                              one of ADVANTAGES; 'gae' only with
                                                           objective 'ppo'
    entropy_coef                                           finite >= 0
    task.name / .difficulty / .style                       TASKS / the task's levels /
                                                           compact, instruct
    task.eval_size, task.eval_samples                      int >= 1
    task.eval_pass_k                                       non-empty tuple of ints in
                                                           [1, task.eval_samples]
    task.format_reward                                     finite >= 0
    task.file, test_file, prompt_column, answer_column,    str; with task 'file': file set,
    messages_column, solution_column                       prompt/answer columns non-empty,
                                                           solution_column set if sft.steps > 0
    task.verifier                                          one of FILE_VERIFIERS or an
                                                           importable 'module:function'
    task.bad_rows                                          skip, refuse
    task.test_fraction                                     finite in [0, 1); > 0 with task
                                                           'file' and no test_file
    model.dtype, model.param_dtype                         float32, bfloat16, float16
    model.moe_backend                                      auto, blocked, ragged, dense
    model.remat_policy                                     none, full, dots, dots_no_batch,
                                                           dots_no_scores
    model.attention_impl                                   auto, xla, cudnn (cudnn: a
                                                           bf16/f16 model.dtype)
    model.logits_chunk_size                                int >= 0 (0 = off)
    model.moe_block_size                                   int >= 1
    model.scan_layers                                      bool
    model.fields.vocab_size                                int >= 0 (0 = the tokenizer's;
                                                           >= the tokenizer's)
    model.fields.d_model, num_layers, num_heads,           int >= 1
    num_kv_heads, head_dim, d_ff, moe_every
    model.fields.num_experts, top_k, moe_d_ff,             int >= 0; with num_experts > 0:
    first_dense_layers                                     top_k in [1, num_experts],
                                                           moe_d_ff >= 1
    model.fields.num_kv_heads, head_dim                    divides num_heads; even
    model.fields.rope_theta, norm_eps, init_std            finite > 0
    model.fields.aux_loss_coef, z_loss_coef                finite >= 0
    model.fields.renormalize_topk, qk_norm, qkv_bias,      bool
    tie_embeddings, value_head
    model.fields.dense_layers                              ints in [0, num_layers)
    model.fields.num_valid_tokens                          not set: the trainer derives it
    model.fields.axis_rules, other ModelConfig fields      ModelConfig's own checks
    mesh.data, fsdp, expert, tensor                        int >= 1 or -1 (one at most);
                                                           their product = the devices
    rollout.prompts_per_step, max_new_tokens               int >= 1
    rollout.group_size                                     int >= 1; >= 2 for group
                                                           advantages, dynamic sampling
    rollout.temperature                                    finite > 0
    rollout.top_p                                          1 (finite in (0, 1]; < 1 would
                                                           bias the gradient)
    rollout.top_k                                          0 (int >= 0; likewise)
    rollout.router_noise_std                               finite >= 0; 0 for a dense model
    rollout.max_prompt_len                                 int >= 1
    rollout.long_prompts                                   refuse, truncate
    rollout_correction.mode, cap, c_low, c_high,           RolloutCorrection's checks (cap,
    seq_ratio                                              c_low, c_high finite >= 1)
    objective.name, objective.hparams.*                    a registered objective and its
                                                           hyperparameter dataclass
    gae.gamma, gae.lam                                     finite in [0, 1]
    gae.value_clip                                         finite >= 0
    gae.value_coef                                         finite >= 0; > 0 with 'gae' (the
                                                           critic must learn)
    dapo.dynamic_sampling, overlong_filter, soft_overlong  bool
    dapo.max_sampling_rounds                               int >= 1
    dapo.overlong_cache_len                                int >= 1; < rollout.max_new_tokens
                                                           with soft_overlong
    updates.num_minibatches, micro_batches                 int >= 1, dividing the rollout
                                                           batch and the mini-batch
    updates.logprob_micro_batches                          int >= 1, dividing the rollout
                                                           batch into pieces that split
                                                           over the batch shards
    updates.num_epochs                                     int >= 1
    updates.routing_replay                                 none, R2, R3 (R2/R3: MoE only)
    updates.gamma_min                                      deprecated: None, or finite in
                                                           (0, 1], moved to objective.
                                                           hparams.gamma_min (RSPO's floor)
    updates.aux_loss_coef, z_loss_coef, sft.aux_loss_coef  finite >= 0
    updates.update_without_signal                          bool
    updates.max_consecutive_skips                          int >= 0
    optimizer.lr, sft.lr                                   finite > 0
    optimizer.schedule                                     constant, cosine, linear
    optimizer.end_lr_ratio                                 finite in [0, 1]
    optimizer.weight_decay                                 finite >= 0
    optimizer.b1, optimizer.b2                             finite in [0, 1)
    optimizer.grad_clip                                    finite > 0: clipping is always on
                                                           (a large value makes it a no-op)
    optimizer.mu_dtype                                     float32, bfloat16
    sft.batch_size                                         int >= 1; divisible by data*fsdp*expert
    =====================================================  ==================================
    """
    from gspo_jax import objectives  # local: keeps config import light

    _check_keys(c, base_config())
    move_deprecated(c)
    _check_domains(c)

    # The objective and its hyperparameters.
    _check_objective_name(c.objective.name)
    if c.objective.hparams_of != c.objective.name:
        raise _err(
            "objective.name",
            f"is {c.objective.name!r} but objective.hparams hold "
            f"{c.objective.hparams_of!r}'s; pick the objective with the config's argument "
            "(configs/default.py:objective=<name>) or config.set_objective",
        )
    objective = objectives.get(c.objective.name)
    hparams = dict(c.objective.hparams)
    for key in hparams:
        if key not in objective.defaults:
            near = difflib.get_close_matches(key, list(objective.defaults), n=1)
            hint = f"; did you mean config.objective.hparams.{near[0]}?" if near else ""
            raise _err(
                f"objective.hparams.{key}",
                f"{c.objective.name} takes no such hyperparameter{hint} "
                f"(it takes {sorted(objective.defaults)})",
            )
    try:
        objective.validate_hyperparameters(hparams)
    except (TypeError, ValueError) as e:
        raise _from_dataclass_error(e, c.objective.name, "objective.hparams", hparams) from None

    # The task.
    if c.task.name not in TASKS:
        raise _err("task.name", f"unknown task {c.task.name!r}; known: {TASKS}")
    if c.task.name in ("gsm8k", "file"):
        if c.task.difficulty:
            raise _err(
                "task.difficulty",
                f"{c.task.name} has no difficulty levels; set it to '' (got {c.task.difficulty!r})",
            )
        if c.task.name == "file":
            _check_file_task(c)
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

    # Advantages.
    if c.advantage not in ADVANTAGES:
        raise _err("advantage", f"unknown advantage estimator {c.advantage!r}; known: {ADVANTAGES}")
    if c.advantage == "gae" and c.objective.name != "ppo":
        raise _err("advantage", "'gae' needs a critic; it is used with objective 'ppo'")
    if c.advantage == "gae" and not c.gae.value_coef > 0:
        raise _err(
            "gae.value_coef",
            "must be > 0 with advantage 'gae' (0 would leave the critic untrained), "
            f"got {c.gae.value_coef!r}",
        )
    g = int(c.rollout.group_size)
    if c.advantage in GROUP_ADVANTAGES and g < 2:
        raise _err(
            "rollout.group_size",
            f"group advantages ({c.advantage!r}) need a group of at least 2, got {g}",
        )
    if c.dapo.dynamic_sampling and g < 2:
        raise _err("rollout.group_size", "dynamic sampling needs a group of at least 2")

    # Sampling: RL trains on the log-probs of softmax(logits / temperature).
    if c.rollout.top_p != 1:
        raise _err(
            "rollout.top_p",
            f"{c.rollout.top_p} truncates the sampling distribution, whose log-probs "
            "the trainer does not compute (the gradient would be biased); RL needs "
            'top_p = 1 (docs/objectives.md, "Conventions")',
        )
    if c.rollout.top_k != 0:
        raise _err(
            "rollout.top_k",
            f"{c.rollout.top_k} truncates the sampling distribution, whose log-probs "
            "the trainer does not compute (the gradient would be biased); RL needs "
            'top_k = 0 (docs/objectives.md, "Conventions")',
        )
    from gspo_jax.objectives.correction import RolloutCorrection

    rc = dict(c.rollout_correction)
    try:
        RolloutCorrection(**rc)
    except (TypeError, ValueError) as e:
        raise _from_dataclass_error(e, "rollout_correction", "rollout_correction", rc) from None
    if c.dapo.soft_overlong and not c.dapo.overlong_cache_len < c.rollout.max_new_tokens:
        raise _err(
            "dapo.overlong_cache_len",
            f"must be < rollout.max_new_tokens={c.rollout.max_new_tokens} with soft_overlong, "
            f"got {c.dapo.overlong_cache_len}",
        )

    # The model.
    if c.updates.routing_replay not in REPLAY_MODES:
        raise _err(
            "updates.routing_replay",
            f"unknown mode {c.updates.routing_replay!r}; known: {REPLAY_MODES}",
        )
    if c.model.pretrained and c.tokenizer == "char":
        raise _err(
            "tokenizer",
            "a pretrained model needs its own tokenizer: set it to the checkpoint directory",
        )
    if not c.model.pretrained:
        _check_model(c, tokenizer_vocab_size)
        if int(c.model.fields.get("num_experts", 0)) == 0:
            if c.updates.routing_replay != "none":
                raise _err(
                    "updates.routing_replay",
                    f"{c.updates.routing_replay!r} needs MoE layers; "
                    "model.fields.num_experts=0 is a dense model: use 'none'",
                )
            if c.rollout.router_noise_std > 0:
                raise _err(
                    "rollout.router_noise_std",
                    f"{c.rollout.router_noise_std} needs MoE layers; "
                    "model.fields.num_experts=0 is a dense model",
                )

    # Batches against the mesh.
    shape = mesh_shape(c, num_devices)
    batch_shards = shape["data"] * shape["fsdp"] * shape["expert"]  # train.BATCH_AXES
    n = int(c.rollout.prompts_per_step) * g
    mb = int(c.updates.num_minibatches)
    if n % mb:
        raise _err(
            "updates.num_minibatches",
            f"{mb} does not divide the rollout batch prompts_per_step*group_size = {n}",
        )
    micro = int(c.updates.micro_batches)
    if (n // mb) % micro:
        raise _err(
            "updates.micro_batches",
            f"{micro} does not divide the mini-batch of {n // mb} sequences",
        )
    if (n // mb // micro) % batch_shards:
        raise _err(
            "mesh",
            f"the micro-batch of {n // mb // micro} sequences is not divisible by the "
            f"data*fsdp*expert = {batch_shards} batch shards",
        )
    lp = int(c.updates.logprob_micro_batches)
    if n % lp or (n // lp) % batch_shards:
        raise _err(
            "updates.logprob_micro_batches",
            f"{lp} pieces of the rollout batch of {n} sequences: each must be a whole number "
            f"of sequences divisible by the data*fsdp*expert = {batch_shards} batch shards",
        )
    if int(c.sft.steps) > 0 and int(c.sft.batch_size) % batch_shards:
        raise _err(
            "sft.batch_size",
            f"{c.sft.batch_size} is not divisible by data*fsdp*expert = {batch_shards}",
        )
    if c.optimizer.schedule not in SCHEDULES:
        raise _err(
            "optimizer.schedule", f"unknown schedule {c.optimizer.schedule!r}; known: {SCHEDULES}"
        )
    return shape
