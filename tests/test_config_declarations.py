"""The config's declarations: `base_config`, the resume rule and docs/config.md are
derived from the sections' frozen dataclasses (`gspo_jax.config_fields`), and give what the
hand-written config gave."""

import pathlib

import pytest

from gspo_jax import config as config_lib
from gspo_jax import config_fields, old_keys, safety
from gspo_jax.run_config import RunConfig, TaskConfig

REPO = pathlib.Path(__file__).resolve().parents[1]

# base_config().to_dict() as the hand-written base_config made it (before the sections
# were declared): the same keys, defaults and types; less rollout.top_p (1.0) and
# rollout.top_k (0), removed since (`old_keys.REMOVED_KEYS`); model.fields with every
# documented ModelConfig field, added since (the hand-written one held ten).
BASE_CONFIG = {'advantage': 'group',
 'checkpoint_every': 20,
 'compilation_cache_dir': '~/.cache/gspo_jax/xla',
 'dapo': {'dynamic_sampling': False,
          'max_sampling_rounds': 3,
          'overlong_cache_len': 8,
          'overlong_filter': False,
          'soft_overlong': False},
 'distributed': {'coordinator_address': '',
                 'mode': 'auto',
                 'num_processes': 0,
                 'process_id': -1},
 'entropy_coef': 0.0,
 'eval_every': 10,
 'gae': {'gamma': 1.0, 'lam': 0.95, 'value_clip': 0.2, 'value_coef': 0.5},
 'keep_checkpoints': 3,
 'log_every': 1,
 'log_write_timeout': 60.0,
 'lora': {'alpha': 16.0,
          'base_quantization': 'none',
          'rank': 0,
          'targets': ('q', 'k', 'v', 'o', 'gate', 'up', 'down', 'expert_gate', 'expert_up',
                      'expert_down'),
          'train_router': False, 'peft_adapter': ''},
 'mesh': {'data': -1, 'expert': 1, 'fsdp': 1, 'tensor': 1},
 'model': {'attention_impl': 'auto',
           'dtype': 'float32',
           'fields': {'d_ff': 256,
                      'd_model': 128,
                      'head_dim': 32,
                      'moe_d_ff': 128,
                      'num_experts': 8,
                      'num_heads': 4,
                      'num_kv_heads': 2,
                      'num_layers': 2,
                      'top_k': 2,
                      'vocab_size': 0,
                      # ModelConfig's other documented fields, at its defaults: present
                      # since, so that the command line can set them.
                      'moe_every': 1,
                      'first_dense_layers': 0,
                      'dense_layers': (),
                      'renormalize_topk': True,
                      'qk_norm': True,
                      'qkv_bias': False,
                      'tie_embeddings': False,
                      'rope_theta': 10000.0,
                      'norm_eps': 1e-06,
                      'init_std': 0.02},
           'logits_chunk_size': 0,
           'moe_backend': 'auto',
           'moe_block_size': 64,
           'param_dtype': 'float32',
           'pretrained': '',
           'remat_policy': 'none',
           'scan_layers': True},
 'objective': {'hparams': {'eps_high': 0.0004,
                           'eps_low': 0.0003,
                           'kl_coef': 0.0,
                           'kl_estimator': 'k3'},
               'hparams_of': 'gspo',
               'name': 'gspo'},
 'optimizer': {'b1': 0.9,
               'b2': 0.99,
               'end_lr_ratio': 0.1,
               'grad_clip': 1.0,
               'lr': 0.0002,
               'mu_dtype': 'float32',
               'schedule': 'constant',
               'warmup_steps': 5,
               'weight_decay': 0.0},
 'progress_bar': True,
 'rollout': {'decode_slots': 0,
             'group_size': 8,
             'long_prompts': 'refuse',
             'max_new_tokens': 24,
             'max_prompt_len': 64,
             # partial rollouts (docs/partial.md)
             'partial_budget': 0,
             'prompts_per_step': 64,
             'refill_chunk': 8,
             'router_noise_std': 0.0,
             # the sampler's own precision (gspo_jax.models.precision.SamplerPrecision)
             'sampler_dtype': '',
             'sampler_quantization': 'none',
             'temperature': 1.0,
             # off-policy (docs/offpolicy.md)
             'staleness': 0,
             'devices': 0,
             'overlap': False},
 'rollout_correction': {'c_high': 2.0,
                        'c_low': 2.0,
                        'cap': 2.0,
                        'mode': 'none',
                        'seq_ratio': 'geometric'},
 'seed': 0,
 'sft': {'aux_loss_coef': 0.01,
         'b1': 0.9,
         'b2': 0.99,
         'batch_size': 64,
         'end_lr_ratio': 0.1,
         'grad_clip': 1.0,
         'lr': 0.003,
         'steps': 300,
         'warmup_steps': 20,
         'weight_decay': 0.0},
 'task': {'answer_column': 'answer',
          'bad_rows': 'skip',
          'data_dir': '',
          'difficulty': 'small',
          'eval_pass_k': (1, 4),
          'eval_samples': 4,
          'eval_size': 128,
          'file': '',
          'format_reward': 0.0,
          'gsm8k_files': '',
          'messages_column': '',
          'name': 'countdown',
          'prompt_column': 'prompt',
          'reward_fn_all_failed': 'stop',
          'reward_fn_timeout': 5.0,
          'solution_column': '',
          'style': 'compact',
          'test_file': '',
          'test_fraction': 0.1,
          'verifier': 'numeric'},
 'tokenizer': 'char',
 'total_rl_steps': 60,
 'updates': {'aux_loss_coef': 0.0,
             'gamma_min': None,  # deprecated: objective.hparams.gamma_min (RSPO's floor)
             'logprob_micro_batches': 1,
             'max_consecutive_skips': 8,
             'micro_batch_tokens': 0,
             'micro_batches': 1,
             'num_epochs': 1,
             'num_minibatches': 2,
             'pack_length': 0,
             'packing': True,
             'routing_replay': 'none',
             'trust_region': 'decoupled',
             'update_without_signal': False,
             'z_loss_coef': 0.0},
 'wandb': {'dir': '',
           'enabled': False,
           'entity': '',
           'mode': 'auto',
           'name': '',
           'project': 'gspo_jax'}}

# The fields that could change on resume before the declarations (safety.py's table).
RESUMABLE = {
    "total_rl_steps", "eval_every", "log_every", "log_write_timeout", "checkpoint_every",
    "keep_checkpoints",
    "progress_bar", "compilation_cache_dir", "wandb.*", "distributed.*", "task.data_dir",
    "task.gsm8k_files", "task.eval_size", "task.eval_samples", "task.eval_pass_k", "mesh.*",
    "model.moe_backend", "model.moe_block_size", "model.remat_policy",
    "model.logits_chunk_size", "model.attention_impl", "rollout.max_prompt_len",
    "rollout.long_prompts", "updates.max_consecutive_skips",
    "rollout.devices", "rollout.overlap",  # where and when the sampler runs, not what it samples
    "rollout.decode_slots", "rollout.refill_chunk",  # how many rows decode at once, likewise
    "task.reward_fn_timeout", "task.reward_fn_all_failed",  # how a plug-in's failures are met
}


def _leaves(d, prefix=""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def test_base_config_is_the_hand_written_one():
    got = config_lib.base_config().to_dict()
    assert got == BASE_CONFIG
    removed = {path: only for path, (only, _) in old_keys.REMOVED_KEYS.items()}
    assert removed == {"rollout.top_p": 1.0, "rollout.top_k": 0}  # their hand-written defaults
    typed_leaves = lambda d: {k: (type(v), repr(v)) for k, v in _leaves(d)}  # noqa: E731
    assert typed_leaves(got) == typed_leaves(BASE_CONFIG)


def test_the_resume_rule_is_the_old_table():
    assert set(config_lib.resumable_fields()) == RESUMABLE
    before = safety.config_record(config_lib.base_config())  # as config.json stores it
    after = config_lib.base_config()
    after.rollout.max_prompt_len = 128
    after.wandb.project = "other"
    after.model.dtype = "bfloat16"
    diffs = safety.config_differences(before, safety.config_record(after))
    assert diffs == ["config.model.dtype: 'float32' -> 'bfloat16'"]


def test_every_field_is_declared_once_with_a_doc():
    paths = [p for p, *_ in config_fields.entries(RunConfig)]
    assert len(paths) == len(set(paths))
    declared = set(paths)
    for path, _ in _leaves(BASE_CONFIG):
        group = path.rsplit(".", 1)[0]
        assert path in declared or group in declared, path  # open groups: their owners'
    assert all(f.metadata["doc"] for _, f, _, _ in config_fields.entries(RunConfig))


def test_docs_table_is_committed():
    """docs/config.md is `config.docs_table()`; regenerate it with
    ``python -c "from gspo_jax import config; print(config.docs_table(), end='')" > docs/config.md``."""
    assert (REPO / "docs" / "config.md").read_text() == config_lib.docs_table()


def test_typed_sections():
    c = config_lib.base_config()
    c.rollout.group_size = 4
    config_lib.validate(c, 1)
    t = config_lib.typed(c)
    assert t.rollout.group_size == 4 and t.task.eval_pass_k == (1, 4)
    assert t.model.fields["d_model"] == 128 and t.mesh.data == -1
    assert t.objective.hparams.eps_low == c.objective.hparams.eps_low
    with pytest.raises(Exception):
        t.rollout.group_size = 2  # frozen


def test_choices_come_from_their_owners():
    from gspo_jax import objectives, tasks

    c = config_lib.base_config()
    c.task.name = "sudoku"
    with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.name: .*countdown"):
        config_lib.validate(c, 1)
    assert config_fields.choices_of(TaskConfig.__dataclass_fields__["name"].metadata) == tasks.names()
    c = config_lib.base_config()
    c.objective.name = "nope"
    with pytest.raises(config_lib.ConfigError, match=r"^config\.objective\.name: "):
        config_lib.validate(c, 1)
    assert "nope" not in objectives.names()


def test_load_gives_the_frozen_run_with_the_objectives_dataclass():
    """`config.load`: the validated, frozen RunConfig; the objective's hyperparameters are
    its dataclass from there on (the train step reads that object)."""
    import dataclasses

    from gspo_jax import objectives

    c = config_lib.base_config()
    c.objective.hparams.eps_low = 1e-4
    run = config_lib.load(c, 1)
    assert type(run.objective.hparams) is objectives.get("gspo").hparams_class
    assert run.objective.hparams.eps_low == 1e-4
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.objective.hparams.eps_low = 0.1
    c.objective.hparams.eps_low = -1.0
    with pytest.raises(config_lib.ConfigError, match=r"config\.objective\.hparams\.eps_low"):
        config_lib.load(c, 1)


def test_the_objectives_hyperparameters_are_made_once_per_load(monkeypatch):
    """Loading a config makes the objective's hyperparameter dataclass once; the run reads
    that object (rl.RLPhase's StepConfig holds it, the objective's formula reads it)."""
    from gspo_jax import objectives

    cls = objectives.get("gspo").hparams_class
    made, post_init = [], cls.__post_init__
    monkeypatch.setattr(cls, "__post_init__", lambda self: made.append(1) or post_init(self))
    c = config_lib.base_config()
    made.clear()
    run = config_lib.load(c, 1)
    assert len(made) == 1 and type(run.objective.hparams) is cls
