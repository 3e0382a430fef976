"""The experiment config's declaration: `RunConfig`, the tree of every section.

Each section is a frozen dataclass declared by the module that uses it (`gspo_jax.config_fields`
says how); the sections whose users are the trainer's (the task, the optimizer, the
warm start, and the run's own settings) are declared here. `gspo_jax.config` derives
the defaults, the checks, docs/config.md and the resume rule from `RunConfig`.
"""

from __future__ import annotations

import dataclasses

from gspo_jax import reward_plugins
from gspo_jax.advantages import GROUP_ESTIMATORS, GaeConfig
from gspo_jax.config_fields import err, is_int, section, setting
from gspo_jax.lora_training import LoRAConfig
from gspo_jax.metrics_log import WandbConfig
from gspo_jax.models.config import ModelSection
from gspo_jax.models.sharding import MeshConfig
from gspo_jax.multihost import DistributedConfig
from gspo_jax.objectives.correction import RolloutCorrection
from gspo_jax.objectives.registry import ObjectiveConfig
from gspo_jax.rollout import RolloutConfig
from gspo_jax.shaping import DapoConfig
from gspo_jax.step import UpdatesConfig

GROUP_ADVANTAGES = GROUP_ESTIMATORS.names()
ADVANTAGES = GROUP_ADVANTAGES + ("gae",)


def _task_names() -> tuple[str, ...]:
    from gspo_jax import tasks  # local: the registry imports every task module on first use

    return tasks.names()


def _pass_k(v) -> str | None:
    if isinstance(v, (list, tuple)) and v and all(is_int(k) for k in v):
        return None
    return f"must be a non-empty tuple of ints, got {v!r}"


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """``config.task``: the prompts, their answers and how they are scored."""

    name: str = setting("countdown", choices=_task_names, doc="the task")
    difficulty: str = setting(
        "small",
        doc="the task's level (countdown small: 3 numbers in 1..9, target 1..30); '' "
        "for gsm8k and file",
    )
    data_dir: str = setting("", resume=True, doc='where the datasets live ("" = <workdir>/data)')
    style: str = setting(
        "compact",
        choices=("compact", "instruct"),
        doc="prompt style: compact (character models) or instruct (chat models)",
    )
    gsm8k_files: str = setting(
        "", resume=True, doc="folder with GSM8K's jsonl files where TFDS cannot download them"
    )
    eval_size: int = setting(
        128, low=1, resume=True, doc="held-out prompts scored every eval_every steps"
    )
    eval_samples: int = setting(
        4, low=1, resume=True, doc="samples per held-out prompt (plus one greedy)"
    )
    eval_pass_k: tuple[int, ...] = setting(
        (1, 4),
        check=_pass_k,
        resume=True,
        domain="non-empty tuple of ints in [1, task.eval_samples]",
        doc="the k of eval/pass@k and eval/maj@k",
    )
    format_reward: float = setting(0.0, low=0, doc="weight of the optional format reward")
    # Task "file": a user's prompts and answers (gspo_jax/tasks/user_file.py; configs/file_task.py).
    file: str = setting("", doc="task 'file': the train rows, a .jsonl or .parquet file")
    test_file: str = setting("", doc='the test rows ("" = hold out test_fraction of task.file)')
    test_fraction: float = setting(
        0.1,
        low=0,
        high=1,
        high_open=True,
        doc="held-out fraction of task.file's valid rows without test_file (> 0 then)",
    )
    prompt_column: str = setting("prompt", doc="the prompt's column")
    answer_column: str = setting(
        "answer", doc="the reference answer's column (countdown: the target integer)"
    )
    messages_column: str = setting(
        "", doc='"" = off; else a list of {role, content} in place of the prompt'
    )
    solution_column: str = setting(
        "", doc='"" = none (no warm start); else the SFT completion, verbatim'
    )
    verifier: str = setting(
        "numeric",
        nonempty=True,
        domain="a gspo_jax.verifiers name or an importable 'module:function'",
        doc="task 'file': how a response is scored",
    )
    bad_rows: str = setting(
        "skip",
        choices=("skip", "refuse"),
        doc="an unusable row of task.file: skipped (each logged once) or refused",
    )
    reward_fn_timeout: float = setting(
        reward_plugins.DEFAULT_TIMEOUT,
        low=0,
        resume=True,
        doc="a plug-in reward: seconds one call may take, else it scores 0 (0 = no limit, "
        "called in the training thread; gspo_jax/reward_plugins.py)",
    )
    reward_fn_all_failed: str = setting(
        "stop",
        choices=reward_plugins.ALL_FAILED,
        resume=True,
        doc="a plug-in reward that failed on every response of a batch: stop the run, or "
        "continue (one summary per batch)",
    )

    def check_run(self, run, ctx) -> None:
        """``eval_pass_k`` within the samples; the task's difficulty against its levels,
        then the task's own checks (`gspo_jax.tasks.check_config`)."""
        from gspo_jax import tasks  # local: the registry imports every task module on first use

        bad = [k for k in self.eval_pass_k if not 1 <= k <= self.eval_samples]
        if bad:
            raise err(
                "task.eval_pass_k",
                f"{bad} not in [1, task.eval_samples={self.eval_samples}] (pass@k and maj@k "
                "need k <= the samples)",
            )
        try:
            tasks.check_config(run)
        except tasks.TaskConfigError as e:
            raise err(e.path, e.message) from None


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW's settings that the RL updates (``config.optimizer``) and the warm start
    (``config.sft``) each have, declared once."""

    end_lr_ratio: float = setting(0.1, low=0, high=1, doc="the final lr / lr of a decay")
    weight_decay: float = setting(0.0, low=0, doc="AdamW's decoupled weight decay")
    b1: float = setting(0.9, low=0, high=1, high_open=True, doc="Adam's beta1")
    b2: float = setting(0.99, low=0, high=1, high_open=True, doc="Adam's beta2")
    grad_clip: float = setting(
        1.0,
        low=0,
        low_open=True,
        why=" (clipping is always on)",
        doc="global-norm gradient clip (always on; a large value makes it a no-op)",
    )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(AdamWConfig):
    """``config.optimizer``: AdamW of the RL updates."""

    lr: float = setting(2e-4, low=0, low_open=True, doc="peak learning rate")
    schedule: str = setting("constant", choices=("constant", "cosine", "linear"), doc="decay")
    warmup_steps: int = setting(5, low=0, doc="linear warmup, in optimizer updates")
    mu_dtype: str = setting(
        "float32",
        choices=("float32", "bfloat16"),
        doc="Adam's first moment (bfloat16 halves it; the second moment and the master "
        "parameters stay float32; docs/memory.md)",
    )


@dataclasses.dataclass(frozen=True)
class SftConfig(AdamWConfig):
    """``config.sft``: the supervised warm start on generated solutions (AdamW with a
    cosine decay)."""

    steps: int = setting(300, low=0, doc="warm-start steps (0 = skip)")
    batch_size: int = setting(64, low=1, doc="sequences per step; divisible by the batch shards")
    lr: float = setting(3e-3, low=0, low_open=True, doc="learning rate")
    warmup_steps: int = setting(20, low=0, doc="linear warmup, in steps")
    aux_loss_coef: float = setting(0.01, low=0, doc="the warm start's load-balancing loss")

    def check_run(self, run, ctx) -> None:
        """The warm start's batch over the mesh's batch shards."""
        shards = ctx.batch_shards
        if self.steps > 0 and self.batch_size % shards:
            raise err(
                "sft.batch_size",
                f"{self.batch_size} is not divisible by data*fsdp*expert = {shards}",
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The whole experiment config (`gspo_jax.config.base_config`'s defaults)."""

    seed: int = setting(
        0,
        low=0,
        high=2**32 - 1,
        why=" (a 32-bit seed of the data order and the sampler's keys)",
        doc="the run's seed",
    )
    total_rl_steps: int = setting(60, low=0, resume=True, doc="RL steps of the run")
    task: TaskConfig = section(TaskConfig)
    tokenizer: str = setting(
        "char", nonempty=True, doc='"char" or a checkpoint directory holding tokenizer.json'
    )
    model: ModelSection = section(ModelSection)
    mesh: MeshConfig = section(MeshConfig, resume=True)
    rollout: RolloutConfig = section(RolloutConfig)
    rollout_correction: RolloutCorrection = section(RolloutCorrection, own_checks=True)
    objective: ObjectiveConfig = section(ObjectiveConfig)
    advantage: str = setting(
        "group", choices=ADVANTAGES, doc="the advantage estimator; 'gae' with objective 'ppo'"
    )
    gae: GaeConfig = section(GaeConfig)
    entropy_coef: float = setting(0.0, low=0, doc="weight of the entropy bonus")
    dapo: DapoConfig = section(DapoConfig)
    updates: UpdatesConfig = section(UpdatesConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    sft: SftConfig = section(SftConfig)
    lora: LoRAConfig = section(LoRAConfig)
    eval_every: int = setting(10, low=1, resume=True, doc="RL steps between evaluations")
    log_every: int = setting(1, low=1, resume=True, doc="RL steps between log lines")
    log_write_timeout: float = setting(
        60.0,
        low=0,
        low_open=True,
        resume=True,
        doc="seconds a TensorBoard or W&B write may take before that writer is switched off",
    )
    checkpoint_every: int = setting(20, low=1, resume=True, doc="RL steps between checkpoints")
    keep_checkpoints: int = setting(3, low=1, resume=True, doc="checkpoints kept per phase")
    progress_bar: bool = setting(True, resume=True, doc="a progress bar on the terminal")
    compilation_cache_dir: str = setting(
        "~/.cache/gspo_jax/xla",
        resume=True,
        doc='persistent XLA compilation cache ("" = off; JAX_COMPILATION_CACHE_DIR wins): a '
        "restarted job loads its executables instead of compiling them",
    )
    wandb: WandbConfig = section(WandbConfig, resume=True)
    distributed: DistributedConfig = section(DistributedConfig, resume=True)

    def check_run(self, run, ctx) -> None:
        """The advantage estimator against the objective and the group."""
        if self.advantage == "gae" and self.objective.name != "ppo":
            raise err("advantage", "'gae' needs a critic; it is used with objective 'ppo'")
        g = self.rollout.group_size
        if self.advantage in GROUP_ADVANTAGES and g < 2:
            raise err(
                "rollout.group_size",
                f"group advantages ({self.advantage!r}) need a group of at least 2, got {g}",
            )
