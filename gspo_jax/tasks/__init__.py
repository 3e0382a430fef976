"""Tasks by name: each one's examples, prompt format, verifier and answer comparison.

A task is one :class:`Task` record, registered under its name and found with
:func:`get`, as objectives are (:mod:`gspo_jax.objectives`). Each built-in task is one
module of this package, its examples and its reward together, and registers itself when
the registry is first asked for a task:

  countdown.py   Countdown: make a target from given numbers (generated in memory; its
                 expression verifier)
  arithmetic.py  integer arithmetic: compute an expression (generated in memory; numeric
                 answers)
  gsm8k.py       GSM8K word problems (TFDS's builder, prepared on disk; numeric answers,
                 worked solutions for the warm start)
  user_file.py   "file": a user's prompts and answers (checked rows prepared on disk), one
                 of `gspo_jax.verifiers` by name

What they share: :mod:`~gspo_jax.tasks.prompts` (`Example`, the prompt styles),
:mod:`~gspo_jax.tasks.synthetic` (seeded splits generated in memory),
:mod:`~gspo_jax.tasks.data_dir` (data sets prepared on disk with TFDS: the lock, read-only
data dirs); the answer format and the shared answer reading are in :mod:`gspo_jax.answers`,
the batch scoring in :mod:`gspo_jax.rewards`, the batches of a task in
:class:`gspo_jax.data.PromptSource`. Nothing here imports :mod:`gspo_jax.data`.

A new task is one module that calls :func:`register` (a new file in this package, or
any module a config file imports); docs/tasks.md walks through one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable, Mapping, Sequence

from gspo_jax import answers
from gspo_jax.answers import Limits, Verdict
from gspo_jax.registry import Registry


class TaskConfigError(ValueError):
    """A task's setting that cannot work; ``path`` is its place under ``config.``."""

    def __init__(self, path: str, message: str):
        super().__init__(f"config.{path}: {message}")
        self.path, self.message = path, message


def _no_options(task_config) -> dict[str, Any]:
    return {}


def _no_check(config) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task.

    Attributes:
      name: the ``config.task.name`` that selects it.
      prepare: ``prepare(data_dir, **options)`` -> the task's examples: a :class:`Splits`,
        or a prepared TFDS builder (read through ``builder.as_data_source(split)`` for
        each split of ``builder.info.splits``); ``options`` are the task's own keywords
        of :class:`~gspo_jax.data.PromptSource`.
      example: ``example(record, index, style)`` -> a :class:`~gspo_jax.tasks.prompts.Example`:
        the prompt format (``style``: "compact" or "instruct"), the verifier's
        ``meta`` and the warm start's reference completion of one record.
      check_meta: ``check_meta(meta)`` raises ValueError naming what an example's
        ``meta`` lacks (a caller's bug, never the model's).
      verify: ``verify(text, meta, limits)`` -> :class:`~gspo_jax.answers.Verdict` of
        one response; never raises for any ``text``.
      levels: the names of the difficulty levels (``config.task.difficulty``), or
        None when the task has none (then the difficulty must be "").
      options: ``options(config.task)`` -> ``prepare``'s keywords from the config.
      check_config: ``check_config(config)`` raises :class:`TaskConfigError` for a
        setting of this task that cannot work (run by `gspo_jax.config.validate`).
      answer_kind: ``answer_kind(config.task)`` -> how evaluation compares final
        answers for maj@k (`gspo_jax.heldout.ANSWER_KINDS`): "numeric" (the
        values read) or "tag" (the answer tag's content).
    """

    name: str
    prepare: Callable[..., Any]
    example: Callable[[Mapping[str, Any], int, str], Any]
    check_meta: Callable[[Mapping[str, Any]], None]
    verify: Callable[[str, Mapping[str, Any], Limits], Verdict]
    levels: Callable[[], list[str]] | None = None
    options: Callable[[Any], dict[str, Any]] = _no_options
    check_config: Callable[[Any], None] = _no_check
    answer_kind: Callable[[Any], str] = lambda task_config: "tag"


@dataclasses.dataclass(frozen=True)
class Splits:
    """A task's examples, as its ``prepare`` gives them.

    Attributes:
      names: the split names ("train", "test", ...).
      records: ``records(split)`` -> that split's records, in a fixed order with random
        access (``len`` and ``[i]``; a list, or a sequence that makes a record when it
        is read); ``Task.example`` turns one into an Example.
      config_name: the difficulty level or configuration the records are of, or None.
    """

    names: tuple[str, ...]
    records: Callable[[str], Sequence[Any]]
    config_name: str | None = None

    @classmethod
    def of(cls, prepared) -> Splits:
        """``prepared`` (what a ``prepare`` returned) as Splits: itself, or a prepared
        TFDS builder (anything with ``info.splits``, ``builder_config`` and
        ``as_data_source(split)``), read through ``as_data_source``."""
        if isinstance(prepared, cls):
            return prepared
        config = getattr(prepared, "builder_config", None)
        return cls(
            tuple(prepared.info.splits), prepared.as_data_source, config.name if config else None
        )


def numeric_task(name: str, **fields) -> Task:
    """A task whose answer is one number: its examples' ``meta`` is ``{"answer"}``, the
    verifier :func:`~gspo_jax.answers.verify_numeric`, answers compared by value."""
    return Task(
        name=name,
        check_meta=functools.partial(answers.check_numeric_meta, name),
        verify=answers.verify_numeric_meta,
        answer_kind=lambda task_config: "numeric",
        **fields,
    )


def _discover() -> None:
    """Import every module of this package: the built-in tasks register themselves."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


# Every task by name (config.task.name); names sorted, the same whatever imported a task
# first. The built-in ones register when the registry is first asked.
REGISTRY: Registry[Task] = Registry("task", discover=_discover, sort=True)


def register(task: Task) -> Task:
    """Add ``task`` under its name (once; a second task of the same name is refused)."""
    return REGISTRY.register(task.name, task)


def unregister(name: str) -> None:
    """Remove the task registered as ``name`` (for tests)."""
    REGISTRY.unregister(name)


def names() -> tuple[str, ...]:
    """Every registered task name, sorted."""
    return REGISTRY.names()


def get(name: str) -> Task:
    """The task registered as ``name`` (see `names`)."""
    return REGISTRY.get(name)


def check_config(config) -> None:
    """The task's part of config validation: its difficulty level, then its own checks.
    Raises TaskConfigError (an unknown ``config.task.name`` included)."""
    name = config.task.name
    if name not in names():
        raise TaskConfigError("task.name", f"unknown task {name!r}; known: {names()}")
    task = get(name)
    difficulty = config.task.difficulty
    if task.levels is None:
        if difficulty:
            raise TaskConfigError(
                "task.difficulty",
                f"{name} has no difficulty levels; set it to '' (got {difficulty!r})",
            )
    elif difficulty not in task.levels():
        raise TaskConfigError(
            "task.difficulty", f"{name} has no level {difficulty!r}; known: {task.levels()}"
        )
    task.check_config(config)
