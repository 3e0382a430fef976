"""The experiment config: its defaults, command-line arguments and validation.

Every file in ``configs/`` defines ``get_config(arg)`` by starting from
:func:`base_config` and changing what its experiment family needs. ``arg`` is a
comma-separated list of ``key=value`` items and flags, for example
``configs/default.py:objective=gspo,smoke``; :func:`parse_arg` reads it.

Each section of the config is a frozen dataclass declared by the module that uses it,
every field once: its default, type, range, doc and whether it may change on resume
(`gspo_jax.config_fields`; the tree is `gspo_jax.run_config.RunConfig`). From those
declarations come :func:`base_config`, the checks of each value in :func:`validate`,
the table of docs/config.md (:func:`docs_table`), the fields that may change on
resume (:func:`resumable_fields`) and the typed sections of a validated config
(:func:`typed`).

:func:`load` turns the command line's config into the frozen `RunConfig` a run reads
(once, validated: the objective's hyperparameters become its dataclass there).
:func:`validate` checks a config before anything is built or compiled and raises
:class:`ConfigError` (a ``ValueError``) naming the offending field by its path
(``config.optimizer.lr: must be finite and > 0, got inf``). :func:`unknown_key_message`
turns a misspelt key into one line with the closest known key (:func:`closest_key`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

import ml_collections

from gspo_jax import config_fields
from gspo_jax.config_fields import ConfigError
from gspo_jax.config_fields import err as _err
from gspo_jax.old_keys import REMOVED_KEYS, move_deprecated, removed_key

__all__ = ["ConfigError"]

# Names this module re-exports from the modules that declare them (imported on first
# use: those modules import JAX).
_EXPORTS = {
    "MODEL_RUNTIME_FIELDS": ("gspo_jax.models.config", "RUNTIME_FIELDS"),
    "MESH_AXES": ("gspo_jax.models.config", "MESH_AXES"),
    "ADVANTAGES": ("gspo_jax.run_config", "ADVANTAGES"),
    "GROUP_ADVANTAGES": ("gspo_jax.run_config", "GROUP_ADVANTAGES"),
    "REPLAY_MODES": ("gspo_jax.step", "REPLAY_MODES"),
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _declaration() -> type:
    from gspo_jax.run_config import RunConfig  # local: the sections' modules import JAX

    return RunConfig


def base_config() -> ml_collections.ConfigDict:
    """The defaults every experiment family starts from: a tiny MoE on CPU (each
    section's declared defaults; the objective's by `set_objective`)."""
    c = config_fields.defaults(_declaration())
    set_objective(c, "gspo")
    return c


def typed(c: ml_collections.ConfigDict):
    """The frozen `RunConfig` of a validated config: ``typed(c).rollout.group_size`` is
    an int, ``typed(c).objective.hparams`` the objective's hyperparameters (its dataclass)."""
    return config_fields.build(_declaration(), c)


def docs_table() -> str:
    """docs/config.md: every field's path, default, domain, resume rule and doc."""
    from gspo_jax.models.config import ModelConfig

    return (
        "# The experiment config\n\n"
        "Generated from the sections' declarations by `gspo_jax.config.docs_table()` "
        "(tests/test_config_declarations.py checks that this file matches). "
        '"finite": a real number, not a bool, not nan or +-inf; "int": not a bool, not 1.5. '
        '"may change": the field may differ when a run resumes from its checkpoints.\n\n'
        + config_fields.docs_table(_declaration())
        + "\n## config.model.fields\n\nThe architecture of an initialised model: "
        "`ModelConfig`'s fields (gspo_jax/models/config.py), checked one by one as declared "
        "there, then across fields by ModelConfig itself; the runtime settings above are "
        "set on config.model, and num_valid_tokens and moe_groups are the trainer's. Every "
        "field below is in the default config.model.fields (above), so each can be set on the "
        "command line: `--config.model.fields.rope_theta=1e6`.\n\n"
        + config_fields.docs_table(ModelConfig, "config.model.fields.")
    )


@functools.cache
def resumable_fields() -> tuple[str, ...]:
    """The fields that may change when a run resumes (``section.*``: all of it)."""
    return config_fields.resumable(_declaration())


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
    by_leaf: dict[str, list[str]] = {}
    for p in paths:
        by_leaf.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    # A top-level key that is exactly a nested key's name (``config.lr``) is that key
    # misplaced, before it is a misspelt top-level one (``config.lora``).
    exact = len(parts) == 1 and parts[0] in by_leaf
    match = [] if exact else difflib.get_close_matches(rest, local, n=1, cutoff=0.6)
    if match:
        return "config." + (f"{group}.{match[0]}" if group else match[0])
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
    if key in REMOVED_KEYS:
        return f"config.{key}: removed ({REMOVED_KEYS[key][1]}); drop it"
    suggestion = closest_key(key, c)
    if suggestion:
        return f"config.{key}: unknown config key; did you mean {suggestion}?"
    group, node = _deepest_group(c, key.split(".")[:-1])
    name = f"config.{group}" if group else "config"
    return f"config.{key}: unknown config key; {name} has: {', '.join(sorted(node.keys()))}"


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
    open_groups = config_fields.open_groups(_declaration())
    for key in c.keys():
        if key not in base and prefix + key in REMOVED_KEYS:
            removed_key(prefix + key, c[key])
        elif key not in base:
            raise ConfigError(unknown_key_message(prefix + key, root))
    for key, default in base.items():
        path = prefix + key
        if key not in c:
            raise _err(path, "missing config key (base_config() defines it)")
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(c[key], ml_collections.ConfigDict):
                raise _err(path, f"must be a group of keys (a ConfigDict), got {c[key]!r}")
            if path not in open_groups:
                _check_keys(c[key], default, root, path + ".")


# --------------------------------------------------------------------------
# Loading: the typed config, validated.


class Context:
    """What the rules across fields need besides the config (`config_fields.check_across`): the
    device count, the tokenizer's vocabulary, and the training mesh they resolve."""

    def __init__(self, run, num_devices: int, tokenizer_vocab_size: int | None):
        self.run, self.num_devices = run, int(num_devices)
        self.tokenizer_vocab_size = tokenizer_vocab_size

    @functools.cached_property
    def mesh_shape(self) -> dict[str, int]:
        """The training mesh's sizes: ``config.mesh`` (at most one -1) resolved over the
        devices the sampler's own (``rollout.devices``) leave."""
        from gspo_jax.models.sharding import mesh_shape as resolve

        sizes = dataclasses.asdict(self.run.mesh)
        return resolve(sizes, self.num_devices - self.run.rollout.devices)

    @property
    def batch_shards(self) -> int:
        shape = self.mesh_shape
        return shape["data"] * shape["fsdp"] * shape["expert"]  # models.sharding.BATCH_AXES


def validate(
    c: ml_collections.ConfigDict, num_devices: int, tokenizer_vocab_size: int | None = None
) -> dict[str, int]:
    """Check a config before anything compiles; return the resolved mesh shape.

    Raises ConfigError naming the first invalid field as its ``config.`` path, e.g.
    ``config.optimizer.lr: must be finite and > 0, got inf``. Three passes: the keys
    are base_config()'s (a misspelt key gets a did-you-mean); every field is in its
    declared domain (docs/config.md tables them: "finite" is a real number, not a bool,
    not nan or +-inf; "int" not a bool, not 1.5; no field takes inf), and each open
    group as its section checks it; then each section's rules across fields, the device
    count and the tokenizer, beside the section's declaration (`config_fields.check_across`).

    ``tokenizer_vocab_size``, where known, checks ``model.fields.vocab_size`` of an
    initialised model: 0 takes the tokenizer's, a smaller one is refused, a larger
    one is allowed (as real checkpoints pad the embedding; the sampler masks the
    padding rows).
    """
    return _load(c, num_devices, tokenizer_vocab_size)[1]


def load(c: ml_collections.ConfigDict, num_devices: int, tokenizer_vocab_size: int | None = None):
    """The run's config, validated (`validate`) and frozen: the `RunConfig` every part
    of a run reads, made once from the command line's ConfigDict (deprecated keys
    moved, with their notice)."""
    return _load(c, num_devices, tokenizer_vocab_size)[0]


def _load(c, num_devices, tokenizer_vocab_size):
    _check_keys(c, base_config())
    move_deprecated(c)
    config_fields.check(_declaration(), c)
    run = typed(c)
    ctx = Context(run, num_devices, tokenizer_vocab_size)
    config_fields.check_across(run, ctx)
    return run, ctx.mesh_shape


def model_config(c, tokenizer_vocab_size: int):
    """The ModelConfig of an initialised policy (`ModelSection.model_config`, PPO's value
    head with advantage 'gae'), from a loaded config (or a validated ConfigDict)."""
    run = typed(c) if isinstance(c, ml_collections.ConfigDict) else c
    return run.model.model_config(tokenizer_vocab_size, value_head=run.advantage == "gae")
