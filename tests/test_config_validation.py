"""`config.validate`: every field's domain and every cross-field constraint, each
error naming its ``config.`` path; `closest_key` / `unknown_key_message`; and every
config file with its documented arguments still validating."""

import dataclasses
import importlib
import math
import pathlib
import re

import ml_collections
import pytest

from gspo_jax import config as config_lib
from gspo_jax import objectives
from gspo_jax.models.config import ModelConfig
from gspo_jax.objectives.hparams import field_types

REPO = pathlib.Path(__file__).resolve().parents[1]
from configs import default as default_config  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _set(c, path, value):
    """Set ``config.<path>``, type safety off (a config file, or ml_collections' int
    field taking True, can put any value there)."""
    *groups, last = path.split(".")
    node = c
    for g in groups:
        node = node[g]
    with c.ignore_type():
        node[last] = value
    return c


def _smoke(objective="gspo"):
    return default_config.get_config(f"objective={objective},smoke")


def _raises(c, path, *, num_devices=8, **kw):
    """validate(c) raises a ConfigError whose message starts with ``config.<path>:``."""
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.validate(c, num_devices, **kw)
    assert str(e.value).startswith(f"config.{path}:"), str(e.value)
    assert "\n" not in str(e.value)
    return str(e.value)


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --------------------------------------------------------------------------
# The bad values the issue lists: each passed validation and ruined a run.


@pytest.mark.parametrize(
    "path, value",
    [
        ("optimizer.lr", INF),
        ("optimizer.lr", NAN),
        ("optimizer.lr", 0.0),
        ("sft.lr", -1.0),  # gradient ascent
        ("sft.lr", INF),
        ("task.format_reward", NAN),
        ("task.format_reward", -0.5),
        ("entropy_coef", NAN),
        ("entropy_coef", -0.01),
        ("updates.z_loss_coef", NAN),
        ("updates.aux_loss_coef", -0.1),
        ("sft.aux_loss_coef", -0.1),
        ("sft.b1", 1.0),
        ("sft.b2", 1.5),
        ("sft.grad_clip", 0.0),
        ("sft.end_lr_ratio", 1.5),
        ("sft.weight_decay", -0.01),
        ("optimizer.end_lr_ratio", -0.1),
        ("optimizer.end_lr_ratio", 1.5),
        ("optimizer.b1", 1.5),
        ("optimizer.b1", 1.0),  # Adam's bias correction divides by 1 - b1^t = 0
        ("optimizer.b2", -0.1),
        ("optimizer.weight_decay", -0.01),
        ("optimizer.grad_clip", 0.0),  # used to turn clipping off silently
        ("optimizer.grad_clip", -1.0),
        ("optimizer.grad_clip", INF),
        ("optimizer.mu_dtype", "float16"),
        ("total_rl_steps", -1),
        ("sft.steps", -1),
        ("optimizer.warmup_steps", -1),
        ("sft.warmup_steps", -1),
        ("rollout.temperature", INF),
        ("rollout.temperature", 0.0),
        ("seed", 2**32),
        ("seed", -1),
        ("sft.steps", 1.5),  # ints must be ints
        ("total_rl_steps", True),  # a bool is not a count
        ("keep_checkpoints", True),
        ("keep_checkpoints", 0),
        ("eval_every", 0),
        ("updates.max_consecutive_skips", -1),
        ("updates.num_epochs", 0),
        ("dapo.max_sampling_rounds", 0),
        ("dapo.overlong_cache_len", 0),
        ("gae.gamma", 1.5),
        ("gae.value_clip", -0.2),
        ("gae.value_coef", -0.5),
        ("rollout.router_noise_std", NAN),
        ("rollout.top_p", NAN),
        ("rollout_correction.cap", NAN),
        ("rollout_correction.c_high", 0.5),
        ("objective.hparams.eps_high", NAN),
        ("objective.hparams.kl_coef", -1.0),
        ("progress_bar", 1),  # bools must be bools
        ("wandb.enabled", "yes"),
        ("wandb.mode", "sometimes"),
        ("wandb.project", None),
        ("dapo.soft_overlong", "false"),
        ("task.bad_rows", "ignore"),
        ("task.reward_fn_timeout", -1.0),
        ("task.reward_fn_timeout", NAN),
        ("task.reward_fn_all_failed", "ignore"),
        ("task.test_fraction", 1.0),
        ("task.test_fraction", -0.1),
        ("task.verifier", ""),
        ("updates.update_without_signal", None),
        ("model.scan_layers", "yes"),
        ("model.dtype", "float64"),
        ("model.param_dtype", "int8"),
        ("model.remat_policy", "everything"),
        ("model.attention_impl", "flash"),
        ("model.logits_chunk_size", -1),
        ("model.logits_chunk_size", 2.5),
        ("model.logits_chunk_size", None),  # 0 is "off"
        ("model.moe_backend", "capacity"),
        ("compilation_cache_dir", None),
        ("tokenizer", ""),
        ("mesh.data", 1.5),
        ("mesh.tensor", 0),
        ("mesh.expert", True),
        ("model.fields.vocab_size", -1),
        ("model.fields.d_model", 0),
        ("model.fields.head_dim", 15),  # rotary embedding pairs dimensions
        ("model.fields.num_experts", -1),
        ("model.fields.moe_d_ff", 0),  # an MoE model needs expert widths
        ("model.fields.top_k", 0),
    ],
)
def test_bad_value_is_refused_naming_the_field(path, value):
    _raises(_set(_smoke(), path, value), path)


def test_message_style():
    msg = _raises(_set(_smoke(), "optimizer.lr", INF), "optimizer.lr")
    assert msg == "config.optimizer.lr: must be finite and > 0, got inf"
    msg = _raises(_set(_smoke(), "sft.steps", 1.5), "sft.steps")
    assert msg == "config.sft.steps: must be an int >= 0, got 1.5"
    msg = _raises(_set(_smoke(), "progress_bar", 1), "progress_bar")
    assert msg == "config.progress_bar: must be a bool (True or False), got 1"


def test_the_edges_of_each_range_are_accepted():
    c = _smoke()
    for path, value in [
        ("optimizer.end_lr_ratio", 0.0),
        ("optimizer.end_lr_ratio", 1.0),
        ("optimizer.b1", 0.0),
        ("optimizer.b2", 0.999),
        ("optimizer.weight_decay", 0.0),
        ("optimizer.warmup_steps", 0),
        ("sft.warmup_steps", 0),
        ("sft.steps", 0),
        ("total_rl_steps", 0),
        ("seed", 2**32 - 1),
        ("gae.gamma", 0.0),
        ("gae.lam", 1.0),
        ("updates.gamma_min", 1.0),
        ("updates.max_consecutive_skips", 0),
        ("task.format_reward", 0.1),
        ("entropy_coef", 0.01),
        ("rollout.temperature", 1e-3),
        ("optimizer.grad_clip", 1e9),  # a large value: clipping in name only
    ]:
        config_lib.validate(_set(_smoke(), path, value), 8)
    assert config_lib.validate(c, 8)["data"] == 8


def test_rspo_floor_is_an_objective_hyperparameter():
    c = _smoke("rspo")
    assert c.objective.hparams.gamma_min == 0.5 and c.updates.gamma_min is None
    config_lib.validate(_set(_smoke("rspo"), "objective.hparams.gamma_min", 1.0), 8)
    for bad in (0.0, 1.5, -0.1):
        _raises(_set(_smoke("rspo"), "objective.hparams.gamma_min", bad), "objective.hparams.gamma_min")
    msg = _raises(_set(_smoke("gspo"), "objective.hparams.gamma_min", 0.3), "objective.hparams.gamma_min")
    assert "gspo takes no such hyperparameter" in msg


def test_a_workdir_saved_before_the_floor_moved_resumes():
    """A config.json written when RSPO's floor was updates.gamma_min compares equal to
    today's config of the same run, and a different floor is still refused."""
    from gspo_jax import old_keys, safety

    for name in ("gspo", "rspo"):
        c = _smoke(name)
        config_lib.validate(c, 8)
        saved = safety.config_record(c)
        old = {**saved, "updates": {**saved["updates"], "gamma_min": 0.5}}
        if name == "rspo":
            old["objective"] = {**saved["objective"], "hparams": {
                k: v for k, v in saved["objective"]["hparams"].items() if k != "gamma_min"}}
        assert safety.config_differences(old_keys.move_deprecated_record(old), saved) == []
    old["updates"]["gamma_min"] = 0.7
    diffs = safety.config_differences(old_keys.move_deprecated_record(old), saved)
    assert diffs == ["config.objective.hparams.gamma_min: 0.7 -> 0.5"]


def test_deprecated_updates_gamma_min_moves_to_the_objective(capsys):
    """The old path is accepted with a one-line notice naming the new one, and the
    config then reads as if the new one had been set."""
    c = _set(_smoke("rspo"), "updates.gamma_min", 0.3)
    config_lib.validate(c, 8)
    assert c.objective.hparams.gamma_min == 0.3 and c.updates.gamma_min is None
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "config.updates.gamma_min is deprecated" in notice
    assert "config.objective.hparams.gamma_min" in notice
    new = _set(_smoke("rspo"), "objective.hparams.gamma_min", 0.3)
    config_lib.validate(new, 8)
    assert c.to_dict() == new.to_dict()  # a resumed run compares them alike
    # Under an objective without a floor the value only floored a diagnostic: dropped.
    c = _set(_smoke("gspo"), "updates.gamma_min", 0.3)
    config_lib.validate(c, 8)
    assert c.updates.gamma_min is None and "gamma_min" not in c.objective.hparams
    assert "dropped" in capsys.readouterr().err
    # Both paths set to different values: refused, naming both.
    c = _set(_set(_smoke("rspo"), "updates.gamma_min", 0.3), "objective.hparams.gamma_min", 0.2)
    msg = _raises(c, "updates.gamma_min")
    assert "config.objective.hparams.gamma_min=0.2" in msg
    _raises(_set(_smoke("rspo"), "updates.gamma_min", 1.5), "updates.gamma_min")


# --------------------------------------------------------------------------
# Sweeps: every numeric field of the config, and of every objective's
# hyperparameters, refuses nan, +inf and -inf naming exactly that field. No
# field is skipped: none takes inf legitimately (a cap, a clip or a count of
# infinity is always a mistake here; grad_clip must be finite, see validate).


def _numeric_fields():
    """(objective, path, type) of every int or float field: the smoke config's, and
    each objective's hyperparameters (None defaults included, by their annotation)."""
    c = _smoke()
    out = [
        ("gspo", path, type(value))
        for path, value in _leaves(c)
        if _is_number(value) and not path.startswith("objective.hparams.")
    ]
    for name in objectives.names():
        for key, tp in field_types(objectives.get(name).hparams_class).items():
            if tp in (int, float):
                out.append((name, f"objective.hparams.{key}", tp))
    return out


NUMERIC = _numeric_fields()


def test_the_sweep_sees_every_group():
    paths = {p for _, p, _ in NUMERIC}
    groups = {p.split(".")[0] for p in paths if "." in p}
    assert groups >= {
        "task",
        "model",
        "mesh",
        "rollout",
        "rollout_correction",
        "objective",
        "gae",
        "dapo",
        "updates",
        "optimizer",
        "sft",
    }
    assert {"seed", "total_rl_steps", "entropy_coef", "keep_checkpoints"} <= paths
    assert "objective.hparams.dual_clip" in paths  # a None default, typed float
    assert "objective.hparams.norm_len" in paths


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("objective, path, tp", NUMERIC, ids=[f"{o}:{p}" for o, p, _ in NUMERIC])
def test_every_numeric_field_refuses_non_finite(objective, path, tp, value):
    _raises(_set(_smoke(objective), path, value), path)


@pytest.mark.parametrize("objective, path, tp", NUMERIC, ids=[f"{o}:{p}" for o, p, _ in NUMERIC])
def test_every_numeric_field_refuses_the_wrong_type(objective, path, tp):
    # True only for an int field: ml_collections stores True in a float field as 1.0.
    bad = ["1", [1]] + ([1.5, True] if tp is int else [])
    if not path.startswith("objective.hparams."):  # optional hyperparameters take None
        bad.append(None)
    for value in bad:
        _raises(_set(_smoke(objective), path, value), path)


BOOLS = [p for p, v in _leaves(_smoke()) if isinstance(v, bool)]
STRINGS = [p for p, v in _leaves(_smoke()) if isinstance(v, str)]


def test_sweeps_see_bools_and_strings():
    assert {"progress_bar", "model.scan_layers", "dapo.soft_overlong", "wandb.enabled"} <= set(BOOLS)
    assert {"tokenizer", "model.dtype", "objective.name", "rollout_correction.mode"} <= set(STRINGS)
    assert {"wandb.project", "wandb.entity", "wandb.name", "wandb.mode", "wandb.dir"} <= set(STRINGS)


@pytest.mark.parametrize("path", BOOLS)
def test_every_bool_field_refuses_a_non_bool(path):
    for value in (1, 0, "True", None):
        _raises(_set(_smoke(), path, value), path)


@pytest.mark.parametrize("path", STRINGS)
def test_every_string_field_refuses_a_non_string(path):
    _raises(_set(_smoke(), path, 3), path)


# --------------------------------------------------------------------------
# config.model.fields: every ModelConfig field it can hold, named by its config path.


@pytest.mark.parametrize(
    "key, bad, good",
    [
        ("moe_every", 0, 2),
        ("moe_every", 1.5, 1),
        ("first_dense_layers", -1, 1),
        ("rope_theta", INF, 1e6),
        ("rope_theta", 0.0, 500.0),
        ("norm_eps", NAN, 1e-5),
        ("norm_eps", 0.0, 1e-6),
        ("init_std", -0.02, 0.02),
        ("renormalize_topk", 1, False),
        ("qk_norm", "no", False),
        ("qkv_bias", None, True),
        ("tie_embeddings", 0, True),
        ("dense_layers", [5], [1]),  # smoke: 2 layers
        ("dense_layers", [0.5], []),
        ("axis_rules", (("embed", "model"),), (("embed", "fsdp"),)),
    ],
)
def test_every_model_config_field_is_checked(key, bad, good):
    c = _smoke()
    c.model.fields[key] = good
    config_lib.validate(c, 8)
    c = _smoke()  # type safety off: a config file's own model.fields dict holds anything
    _set(c, f"model.fields.{key}", bad)
    msg = _raises(c, f"model.fields.{key}")
    assert "ModelConfig" not in msg


def test_the_sweep_covers_every_model_config_field():
    """A field added to ModelConfig gets a case above or a domain in validate."""
    checked = {
        "moe_every",
        "first_dense_layers",
        "rope_theta",
        "norm_eps",
        "init_std",
        "renormalize_topk",
        "qk_norm",
        "qkv_bias",
        "tie_embeddings",
        "dense_layers",
        "axis_rules",
    }
    in_base = set(_smoke().model.fields.keys())
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    # Set by the trainer or kept from a Hugging Face checkpoint, refused in the config
    # (test_model_fields_that_training_does_not_read_are_refused).
    from gspo_jax.models.config import DERIVED_FIELDS

    derived = set(DERIVED_FIELDS)
    assert fields == checked | in_base | derived | set(config_lib.MODEL_RUNTIME_FIELDS)


def _command_line(*overrides, config="configs/default.py:smoke"):
    """The config ``python -m gspo_jax.train --config=<config> <overrides>`` runs: locked,
    then overridden by ml_collections' absl flag; an unknown key is the trainer's one-line
    message (`gspo_jax.train.unknown_override`), raised as a ConfigError."""
    from absl import flags
    from ml_collections import config_flags

    from gspo_jax.train import unknown_override

    argv = ["gspo_jax.train", f"--config={REPO / config.split(':')[0]}:{config.split(':')[1]}"]
    argv += list(overrides)
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "", flag_values=values, lock_config=True, sys_argv=argv
    )
    try:
        values(argv)
    except (AttributeError, KeyError, flags.Error) as e:
        raise config_lib.ConfigError(unknown_override(argv) or str(e).splitlines()[0]) from None
    return values.config


def _documented_model_fields():
    """The config.model.fields.<key> rows of docs/config.md."""
    import re

    text = (REPO / "docs" / "config.md").read_text()
    return re.findall(r"^\| `config\.model\.fields\.(\w+)` \|", text, re.M)


# A value other than the smoke config's for every documented model field, valid with the
# smoke model's others (2 layers, 2 heads of 16, 4 experts top-2).
MODEL_FIELD_VALUES = {
    "vocab_size": ("128", 128),
    "d_model": ("48", 48),
    "num_layers": ("3", 3),
    "num_heads": ("4", 4),
    "num_kv_heads": ("2", 2),
    "head_dim": ("8", 8),
    "d_ff": ("96", 96),
    "moe_d_ff": ("24", 24),
    "num_experts": ("6", 6),
    "top_k": ("1", 1),
    "moe_every": ("2", 2),
    "first_dense_layers": ("1", 1),
    "dense_layers": ("(0,)", (0,)),
    "renormalize_topk": ("False", False),
    "qk_norm": ("False", False),
    "qkv_bias": ("True", True),
    "tie_embeddings": ("True", True),
    "rope_theta": ("1e6", 1e6),
    "norm_eps": ("1e-5", 1e-5),
    "init_std": ("0.01", 0.01),
}


def test_the_warm_starts_optimizer_is_its_config(monkeypatch):
    """config.sft's AdamW settings reach the warm start's optimizer (they were written
    into sft.py), each settable on the command line."""
    from gspo_jax import optim, sft

    seen = {}
    monkeypatch.setattr(optim, "make_optimizer", lambda **kw: seen.update(kw))
    c = _command_line("--config.sft.b1=0.8", "--config.sft.b2=0.95", "--config.sft.grad_clip=0.5",
                      "--config.sft.end_lr_ratio=0.2", "--config.sft.weight_decay=0.01")
    config_lib.validate(c, 8)
    sft.sft_optimizer(config_lib.typed(c))
    assert seen == dict(lr=c.sft.lr, schedule="cosine", total_steps=c.sft.steps,
                        warmup_steps=c.sft.warmup_steps, end_lr_ratio=0.2, weight_decay=0.01,
                        b1=0.8, b2=0.95, grad_clip=0.5)


def test_every_documented_model_field_can_be_set_from_the_command_line():
    """Every config.model.fields.<key> docs/config.md documents exists in the config, so
    ``--config.model.fields.<key>=<value>`` sets it (a locked ConfigDict takes no new
    key: only the ten of the default tiny MoE could be set once), with its type checked,
    and the model is built with it; a misspelt key is still refused, with the nearest."""
    from gspo_jax import run_parts

    documented = _documented_model_fields()
    assert set(documented) == set(MODEL_FIELD_VALUES)  # a new field gets a case here
    vocab = run_parts.make_tokenizer(_smoke().tokenizer).vocab_size
    for key in documented:
        text, value = MODEL_FIELD_VALUES[key]
        c = _command_line(f"--config.model.fields.{key}={text}")
        assert c.model.fields[key] == value, key
        config_lib.validate(c, 8, tokenizer_vocab_size=vocab)
        assert getattr(config_lib.model_config(c, vocab), key) == value, key
    # The type of each is checked where it is parsed ...
    for bad in ("qk_norm=maybe", "moe_every=1.5", "rope_theta=fast"):
        with pytest.raises(config_lib.ConfigError):
            _command_line(f"--config.model.fields.{bad}")
    # ... and its domain by validate.
    _raises(_command_line("--config.model.fields.rope_theta=0"), "model.fields.rope_theta")
    with pytest.raises(config_lib.ConfigError, match=(
        r"^config\.model\.fields\.rope_thetta: unknown config key; "
        r"did you mean config\.model\.fields\.rope_theta\?$"
    )):
        _command_line("--config.model.fields.rope_thetta=1e6")


@pytest.mark.parametrize("key, names", [
    ("aux_loss_coef", r"config\.updates\.aux_loss_coef \(RL\) and config\.sft\.aux_loss_coef"),
    ("z_loss_coef", r"config\.updates\.z_loss_coef"),
    ("value_head", r"config\.advantage='gae'"),
])
def test_model_fields_that_training_does_not_read_are_refused(key, names):
    """ModelConfig's router loss weights (a Hugging Face checkpoint's, kept for export)
    and its value head (the trainer's, for GAE) are not run settings: set in
    config.model.fields they would do nothing, so they are refused, naming what does."""
    c = _smoke()
    c.model.fields[key] = 0.01 if "coef" in key else True
    assert re.search(names, _raises(c, f"model.fields.{key}"))
    with pytest.raises(config_lib.ConfigError, match="unknown config key"):
        _command_line(f"--config.model.fields.{key}=0.01")


def test_a_run_saved_with_ten_model_fields_compares_at_the_others_defaults():
    """config.json of a run saved when config.model.fields held ten keys: the model ran
    the others at ModelConfig's defaults, the defaults they have now, so a resume,
    evaluation or export compares alike; another value differs, naming the field."""
    import json

    from gspo_jax import safety

    ten = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
           "d_ff", "moe_d_ff", "num_experts", "top_k")
    c = _smoke()
    saved = json.loads(json.dumps(safety.config_record(c)))  # as config.json holds it
    assert safety.config_differences(saved, safety.config_record(c)) == []
    saved["model"]["fields"] = {k: saved["model"]["fields"][k] for k in ten}
    assert safety.config_differences(saved, safety.config_record(c)) == []
    c.model.fields.rope_theta, c.model.fields.dense_layers = 1e6, (1,)
    assert safety.config_differences(saved, safety.config_record(c)) == [
        "config.model.fields.dense_layers: '<absent>' -> [1]",
        "config.model.fields.rope_theta: '<absent>' -> 1000000.0",
    ]


def test_model_fields_keys():
    c = _smoke()
    c.model.fields.d_modle = 32
    msg = _raises(c, "model.fields.d_modle")
    assert "did you mean config.model.fields.d_model?" in msg
    c = _smoke()
    c.model.fields.dtype = "bfloat16"  # config.model_config would overwrite it
    assert "config.model.dtype" in _raises(c, "model.fields.dtype")


def test_moe_block_size_is_a_runtime_setting():
    """config.model.moe_block_size reaches initialised and pretrained models alike (it
    lays out the blocked dispatch's rows, changing no number): checked there, refused in
    model.fields, resumable."""
    c = _smoke()
    c.model.moe_block_size = 512
    config_lib.validate(c, 8)
    assert config_lib.model_config(c, 64).moe_block_size == 512
    c.model.moe_block_size = 0
    _raises(c, "model.moe_block_size")
    c = _smoke()
    c.model.fields.moe_block_size = 512
    assert "config.model.moe_block_size" in _raises(c, "model.fields.moe_block_size")
    from gspo_jax import safety

    assert safety.config_differences(
        {"model": {"moe_block_size": 64}}, {"model": {"moe_block_size": 512}}
    ) == []


def test_model_runtime_memory_fields():
    """logits_chunk_size and attention_impl are runtime settings (config.model), given to
    initialised and pretrained models alike; 0 turns the logits chunking off."""
    assert {"logits_chunk_size", "attention_impl"} <= set(config_lib.MODEL_RUNTIME_FIELDS)
    c = _smoke()
    assert config_lib.model_config(c, 40).logits_chunk_size is None  # default 0 = off
    c.model.logits_chunk_size = 128
    c.model.attention_impl = "xla"
    config_lib.validate(c, 8)
    cfg = config_lib.model_config(c, 40)
    assert (cfg.logits_chunk_size, cfg.attention_impl) == (128, "xla")
    c = _smoke()
    c.model.fields.logits_chunk_size = 8  # the old place: refused, pointing to the new one
    assert "config.model.logits_chunk_size" in _raises(c, "model.fields.logits_chunk_size")
    c = _smoke()
    c.model.attention_impl = "cudnn"  # flash attention needs a 16-bit compute dtype
    assert "bfloat16" in _raises(c, "model.attention_impl")
    c.model.dtype = "bfloat16"
    config_lib.validate(c, 8)


def test_cross_field_model_constraints():
    _raises(_set(_smoke(), "model.fields.num_kv_heads", 3), "model.fields.num_kv_heads")
    _raises(_set(_smoke(), "model.fields.top_k", 5), "model.fields.top_k")  # 4 experts
    c = _set(_smoke(), "model.fields.num_experts", 0)
    c.model.fields.top_k = 0
    c.model.fields.moe_d_ff = 0
    config_lib.validate(c, 8)  # a dense model
    _raises(_set(c, "rollout.router_noise_std", 0.1), "rollout.router_noise_std")
    c.rollout.router_noise_std = 0.0
    _raises(_set(c, "updates.routing_replay", "R2"), "updates.routing_replay")


# --------------------------------------------------------------------------
# The tokenizer's vocabulary.


def test_vocab_size_against_the_tokenizer():
    c = _set(_smoke(), "model.fields.vocab_size", 10)
    msg = _raises(c, "model.fields.vocab_size", tokenizer_vocab_size=20)
    assert "10" in msg and "20" in msg
    for vocab in (0, 20, 32):  # 0: the tokenizer's; larger: a padded embedding
        c = _set(_smoke(), "model.fields.vocab_size", vocab)
        config_lib.validate(c, 8, tokenizer_vocab_size=20)
    c = _set(_smoke(), "model.fields.vocab_size", 10)
    config_lib.validate(c, 8)  # the tokenizer not known yet: nothing to compare


def test_num_valid_tokens_is_the_trainers():
    c = _set(_smoke(), "model.fields.vocab_size", 32)
    c.model.fields.num_valid_tokens = 20  # fewer would mask real tokens
    _raises(c, "model.fields.num_valid_tokens", tokenizer_vocab_size=20)


def test_moe_groups_is_the_trainers():
    c = _smoke()
    c.model.fields.moe_groups = 2
    assert "mesh's batch shards" in _raises(c, "model.fields.moe_groups")


def test_vocab_size_of_a_pretrained_model_is_the_checkpoints():
    c = _set(_smoke(), "model.fields.vocab_size", 10)
    c.model.pretrained = c.tokenizer = "/ckpt"
    config_lib.validate(c, 8, tokenizer_vocab_size=20)  # model.fields are not used


def test_char_tokenizer_default_validates():
    from gspo_jax import run_parts

    c = _smoke()
    tok = run_parts.make_tokenizer(c.tokenizer)
    config_lib.validate(c, 8, tokenizer_vocab_size=tok.vocab_size)
    assert config_lib.model_config(c, tok.vocab_size).vocab_size == tok.vocab_size


# --------------------------------------------------------------------------
# Other cross-field constraints.


def test_gae_needs_a_critic_that_learns():
    c = default_config.get_config("objective=ppo,smoke")
    c.advantage = "gae"
    config_lib.validate(c, 8)
    c.gae.value_coef = 0.0
    _raises(c, "gae.value_coef")


def test_soft_overlong_cache_shorter_than_the_response():
    c = _smoke()
    c.dapo.soft_overlong = True
    c.dapo.overlong_cache_len = c.rollout.max_new_tokens
    _raises(c, "dapo.overlong_cache_len")
    c.dapo.overlong_cache_len = c.rollout.max_new_tokens - 1
    config_lib.validate(c, 8)


def test_the_samplers_own_devices_are_checked_before_anything_compiles():
    """rollout.devices gives the sampler a mesh of its own (`offpolicy.sampler_mesh`: the
    training mesh's fsdp, expert and tensor sizes, its other devices on data): they must
    hold whole copies of the model's shards, and the rollout batch, which is assembled
    over that mesh's data*fsdp*expert shards, must divide over them. Both are refused by
    `validate`, naming config.rollout.devices and the numbers (6 of 8 devices once ran the
    warm start and the step-0 evaluation, then failed inside JAX); so is a sweep's point,
    validated before any run."""
    from gspo_jax import sweep_grid

    c = _smoke()  # the rollout batch: 4 prompts * 4 samples = 16 rows
    c.rollout.devices = 6  # 2 training devices, a sampler mesh of 6 batch shards
    msg = _raises(c, "rollout.devices")
    assert "6 batch shards" in msg and "prompts_per_step*group_size = 16" in msg, msg
    c.rollout.devices = 4  # 16 rows over 4 sampler shards
    config_lib.validate(c, 8)
    c.mesh.tensor = 2  # 4 devices, 2 tensor shards each: 2 batch shards
    config_lib.validate(c, 8)

    # fsdp 3: the 6 training devices hold 2 copies of the model; 2 sampler devices, none.
    c = _smoke()
    c.mesh.fsdp, c.rollout.devices = 3, 2
    c.rollout.prompts_per_step, c.sft.batch_size = 6, 12  # 24 rows: 6 training shards
    assert "fsdp*expert*tensor = 3" in _raises(c, "rollout.devices")

    with pytest.raises(SystemExit, match=r"(?s)six: config\.rollout\.devices: 6 devices.*16"):
        sweep_grid.check_points(
            f"{REPO}/configs/default.py:smoke", {"six": {"rollout.devices": "6"}}, num_devices=8
        )


# --------------------------------------------------------------------------
# Keys.


def test_closest_key():
    c = _smoke()
    assert config_lib.closest_key("config.optimizer.lrr", c) == "config.optimizer.lr"
    assert config_lib.closest_key("optimzer.lr", c) == "config.optimizer.lr"
    assert config_lib.closest_key("config.rollout.temprature", c) == "config.rollout.temperature"
    assert config_lib.closest_key("config.seeed", c) == "config.seed"
    assert config_lib.closest_key("config.updates.z_los_coef", c) == "config.updates.z_loss_coef"
    assert config_lib.closest_key("config.lr", c) in ("config.sft.lr", "config.optimizer.lr")
    assert config_lib.closest_key("config.xyzzy", c) is None
    assert config_lib.closest_key("config.seed", c) != "config.seed"  # never itself


def test_unknown_key_message():
    c = _smoke()
    assert config_lib.unknown_key_message("config.optimizer.lrr", c) == (
        "config.optimizer.lrr: unknown config key; did you mean config.optimizer.lr?"
    )
    msg = config_lib.unknown_key_message("optimizer.xyzzy", c)
    assert msg.startswith("config.optimizer.xyzzy: unknown config key; config.optimizer has: ")
    assert "grad_clip" in msg and "\n" not in msg


def test_unknown_and_missing_keys_are_refused():
    c = _smoke()
    c.optimizer.lrr = 1e-3  # a typo in a config file: a new key nothing reads
    msg = _raises(c, "optimizer.lrr")
    assert msg.endswith("did you mean config.optimizer.lr?")
    c = _smoke()
    del c.optimizer.b1
    _raises(c, "optimizer.b1")
    c = _smoke()
    c.mesh.model = 1
    _raises(c, "mesh.model")
    c = _smoke()
    c.objective.hparams.eps_hi = 0.3
    assert "eps_high" in _raises(c, "objective.hparams.eps_hi")


@pytest.mark.parametrize("path, old", [("rollout.top_p", 1.0), ("rollout.top_k", 0)])
def test_removed_keys_run_at_their_old_value_with_a_notice(path, old, capsys):
    """rollout.top_p / top_k are gone (the sampler draws from the whole tempered
    distribution): a config file that still sets the one value RL accepted runs, with a
    one-line notice; any other value is refused naming the key; a resumed run whose
    config.json holds the key is not a config change; a command-line override of it
    gets one line."""
    assert path.split(".")[1] not in config_lib.base_config().rollout
    c = _set(_smoke(), path, old)
    config_lib.validate(c, 8)
    err = capsys.readouterr().err
    assert err.startswith(f"config.{path}: removed") and err.count("\n") == 1, err
    for bad in ({1.0: 0.9, 0: 5}[old], NAN, True):
        assert "removed" in _raises(_set(_smoke(), path, bad), path)
    from gspo_jax import safety

    saved = safety.config_record(_set(_smoke(), path, old))
    assert safety.config_differences(saved, safety.config_record(_smoke())) == []
    msg = config_lib.unknown_key_message(path, _smoke())
    assert msg.startswith(f"config.{path}: removed") and "\n" not in msg


# --------------------------------------------------------------------------
# Every config file, with its documented arguments.

DOCUMENTED_ARGS = {
    "bench_rl_h200": ["", "layers=16", "tiny"],
    "cispo": [""],
    "file_task": ["file=/data/prompts.jsonl", "file=/data/prompts.parquet"],
    "default": [""] + [f"objective={n}" for n in objectives.names()],
    "gmpo_rspo": ["", "variant=gmpo", "variant=rspo,gamma_min=0.3,replay=R2", "replay=R3"],
    "grpo": ["", "variant=grpo", "variant=dr_grpo", "variant=dapo"],
    "gspo": ["", "variant=gspo_token", "eps=paper", "variant=gspo_token,eps=short"],
    "ppo": [""],
    "qwen3_moe_gsm8k": [
        "ckpt=/ckpt",
        "ckpt=/ckpt,gsm8k_files=/gsm8k,objective=grpo,replay=R3",
    ],
    "sapo": [""],
    "stability": ["", "variant=grpo_r2", "minibatches=4,lr=1e-3"]
    + [f"variant={v}" for v in ("grpo", "grpo_r3", "gspo", "rspo", "gmpo")],
}


def test_every_config_file_is_listed():
    files = {p.stem for p in (REPO / "configs").glob("*.py") if p.stem != "__init__"}
    assert files == set(DOCUMENTED_ARGS)


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize(
    "module, arg", [(m, a) for m, args in DOCUMENTED_ARGS.items() for a in args]
)
def test_config_files_validate(module, arg, num_devices):
    mod = importlib.import_module(f"configs.{module}")
    for a in (arg, f"{arg},smoke" if arg else "smoke"):
        c = mod.get_config(a)
        shape = config_lib.validate(c, num_devices)
        assert math.prod(shape.values()) == num_devices


# --------------------------------------------------------------------------
# Task "file": a user's prompts and verifier.


def _file_task(**fields):
    c = _smoke()
    c.task.name, c.task.difficulty, c.task.file, c.sft.steps = "file", "", "/d/p.jsonl", 0
    for k, v in fields.items():
        _set(c, k, v)
    return c


def test_file_task_fields():
    config_lib.validate(_file_task(), 8)
    config_lib.validate(_file_task(**{"task.verifier": "boxed_math"}), 8)
    config_lib.validate(_file_task(**{"task.verifier": "math:isclose"}), 8)  # importable
    assert "difficulty" in _raises(_file_task(**{"task.difficulty": "small"}), "task.difficulty")
    _raises(_file_task(**{"task.file": ""}), "task.file")
    _raises(_file_task(**{"task.file": "/d/p.csv"}), "task.file")
    _raises(_file_task(**{"task.test_file": "/d/t.txt"}), "task.test_file")
    _raises(_file_task(**{"task.test_fraction": 0.0}), "task.test_fraction")
    config_lib.validate(_file_task(**{"task.test_fraction": 0.0, "task.test_file": "/d/t.jsonl"}), 8)
    _raises(_file_task(**{"task.answer_column": ""}), "task.answer_column")
    _raises(_file_task(**{"task.prompt_column": ""}), "task.prompt_column")
    config_lib.validate(_file_task(**{"task.prompt_column": "", "task.messages_column": "m"}), 8)
    assert "sft.steps=0" in _raises(_file_task(**{"sft.steps": 2}), "task.solution_column")
    config_lib.validate(_file_task(**{"sft.steps": 2, "task.solution_column": "solution"}), 8)
    assert "known" in _raises(_file_task(**{"task.verifier": "regex"}), "task.verifier")
    assert "no_such_module" in _raises(
        _file_task(**{"task.verifier": "no_such_module:f"}), "task.verifier"
    )
    assert "no function" in _raises(_file_task(**{"task.verifier": "math:nope"}), "task.verifier")
