"""Task "file": a user's prompts and reference answers from a JSONL or Parquet file.

The rows are read, checked and prepared by :mod:`gspo_jax.data.user_file`; each is
scored by the verifier ``config.task.verifier`` names (:mod:`gspo_jax.verifiers`,
or a plug-in ``module:function``, :mod:`gspo_jax.reward_plugins`). The prompts are
the file's own, so the task has no prompt styles and no difficulty levels.
"""

from __future__ import annotations

from typing import Any, Mapping

from gspo_jax import reward_plugins, tasks, verifiers
from gspo_jax.answers import Limits, Verdict
from gspo_jax.data import user_file as user_file_data
from gspo_jax.tasks import TaskConfigError


def _check_meta(meta: Mapping[str, Any]) -> None:
    if not isinstance(meta.get("verifier"), str) or "answer" not in meta:
        raise ValueError(f"file meta needs 'verifier' and 'answer', got keys {sorted(meta)}")
    verifiers.get(meta["verifier"])


def _verify(text: str, meta: Mapping[str, Any], limits: Limits) -> Verdict:
    return verifiers.get(meta["verifier"]).verify(text, meta, limits)


def _check_config(c) -> None:
    """The fields that make a user's file usable (the file is read later)."""
    t = c.task
    if not t.file:
        raise TaskConfigError(
            "task.file", "task 'file' needs the path of a .jsonl or .parquet file"
        )
    for path in ("file", "test_file"):
        value = getattr(t, path)
        if value and not value.endswith((".jsonl", ".parquet")):
            raise TaskConfigError(f"task.{path}", f"must end in .jsonl or .parquet, got {value!r}")
    if not t.test_file and not t.test_fraction > 0:
        raise TaskConfigError(
            "task.test_fraction", "must be > 0 without task.test_file (the test split)"
        )
    if not t.messages_column and not t.prompt_column:
        raise TaskConfigError(
            "task.prompt_column", "must name a column (or set task.messages_column)"
        )
    if not t.answer_column:
        raise TaskConfigError("task.answer_column", "must name a column")
    if int(c.sft.steps) > 0 and not t.solution_column:
        raise TaskConfigError(
            "task.solution_column",
            f"the warm start (sft.steps={c.sft.steps}) trains on reference solutions: "
            "name the column holding them, or set sft.steps=0",
        )
    if reward_plugins.is_reward_fn(t.verifier):
        try:
            reward_plugins.load_reward_fn(t.verifier)
        except ValueError as e:
            raise TaskConfigError("task.verifier", " ".join(str(e).split())) from None
    elif t.verifier not in verifiers.names():
        raise TaskConfigError(
            "task.verifier",
            f"unknown verifier {t.verifier!r}; known: {verifiers.names()} or 'module:function'",
        )


TASK = tasks.register(
    tasks.Task(
        name="file",
        prepare=lambda data_dir, file_task, prompt_check=None: user_file_data.prepare(
            file_task, data_dir, prompt_check
        ),
        example=lambda record, index, style: user_file_data.from_record(record, index),
        check_meta=_check_meta,
        verify=_verify,
        options=lambda task_config: {"file_task": user_file_data.FileTask.from_config(task_config)},
        check_config=_check_config,
        answer_kind=lambda task_config: verifiers.get(task_config.verifier).answer_kind,
    )
)
