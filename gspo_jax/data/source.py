"""Deterministic, resumable prompt batches from the TFDS datasets.

The data position is one integer: the number of examples consumed so far.
Position ``p`` is example ``order(epoch)[p % n]`` with ``epoch = p // n``,
where ``order(epoch)`` is a permutation drawn from
``numpy.random.RandomState([seed, epoch])`` (the legacy generator, whose
stream numpy keeps stable across releases). So a batch is a pure function of
``(position, batch_size)``; the trainer derives the position from the step,
so a resumed run draws exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import inspect
import os
from typing import Any

import numpy as np
from etils import epath
from tensorflow_datasets.core.file_adapters import FileFormat

from gspo_jax import tasks
from gspo_jax.data import prompts


class DataDirNotWritable(OSError):
    """A dataset to prepare under a data dir this process cannot write (a read-only
    mount, another user's folder); nothing was written. The message names both."""


def is_prepared(builder) -> bool:
    """Whether ``builder``'s dataset is prepared under its data dir. TFDS writes a dataset
    into a folder of its own and renames it into place once complete, so a dataset seen
    prepared stays so: reading it needs no lock."""
    return (epath.Path(builder.data_dir) / "dataset_info.json").exists()


# What opening a file for writing raises in a folder this process may not write to.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def prepare_lock(builder):
    """Held while ``builder``'s dataset is prepared: one process (or thread) at a time
    per dataset and data dir, so that runs started together on a fresh data dir (a
    sweep's points, a study's two pinned processes) do not both generate it and fail
    renaming into the folder the other one made.

    A dataset already prepared (`is_prepared`) is read without the lock, writing
    nothing: a read-only data dir (a workdir's ``data/`` on an archive) serves as it is.
    One that is not, under a data dir that cannot be written, raises
    `DataDirNotWritable` naming both, before anything is written. A remote data dir
    (``gs://``) is not locked."""
    path = os.fspath(builder.data_dir).rstrip("/")
    if "://" in path or is_prepared(builder):
        yield
        return
    # Beside the data sets, not inside one: TFDS reads every entry of a data set's
    # folder as a version of it.
    root = os.fspath(builder.data_dir_root)
    locks = os.path.join(root, ".prepare_locks")
    name = os.path.relpath(path, root).replace(os.sep, "__")
    try:
        os.makedirs(locks, exist_ok=True)
        f = open(os.path.join(locks, name + ".lock"), "a")
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
        raise DataDirNotWritable(
            f"{name.replace('__', '/')} is not prepared under the data dir {root}, and "
            f"nothing can be written there to prepare it ({e.strerror}): prepare it in a "
            "data dir that can be written"
        ) from e
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


ARRAY_RECORD = FileFormat.ARRAY_RECORD


def prepared(builder):
    """``builder`` prepared as array_record: generated on first use, reused after."""
    with prepare_lock(builder):
        builder = current(builder)
        builder.download_and_prepare(file_format="array_record")
    return builder


def current(builder, make=None):
    """``builder``, or one made again (``make()``; by default as TFDS copies a builder,
    from its constructor's arguments) when it was made before another run prepared its
    data, while this one waited for `prepare_lock`: its info is then an empty folder's,
    which names TFDS's default file format, not the array_record every task writes."""
    written = epath.Path(builder.data_dir) / "dataset_info.json"  # is_prepared() warns
    if builder.info.file_format != ARRAY_RECORD and written.exists():
        return make() if make is not None else type(builder)(**builder._original_state)
    return builder


def _prepare(task: tasks.Task, data_dir, options: dict[str, Any], prompt_check=None):
    """The task's ``prepare(data_dir, **options)`` (`Task.prepare`), with a ValueError
    naming an option the task does not take (and the tasks that take it) or a required
    one not given; with ``prompt_check=`` where the task's ``prepare`` takes it."""
    params = list(inspect.signature(task.prepare).parameters.values())[1:]
    if prompt_check is not None and "prompt_check" in [p.name for p in params]:
        options = {**options, "prompt_check": prompt_check}
    for key in options:
        if key not in [p.name for p in params]:
            takers = [n for n in tasks.names() if key in _option_names(tasks.get(n))]
            raise ValueError(f"{key} is only for task {takers}, got task {task.name!r}")
    for p in params:
        if p.default is inspect.Parameter.empty and p.name not in options:
            raise ValueError(f"task {task.name!r} needs the option {p.name}")
    return task.prepare(data_dir, **options)


def _option_names(task: tasks.Task) -> list[str]:
    return list(inspect.signature(task.prepare).parameters)[1:]


class PromptSource:
    """Random-access prompts of one task and split, in a seeded order per epoch.

    Args:
      task: a task name (:mod:`gspo_jax.tasks`): "countdown", "arithmetic", "gsm8k",
        "file" (a user's JSONL/Parquet file, :mod:`~gspo_jax.data.user_file`) or one
        registered since.
      split: "train" or "test" (GSM8K also "train_socratic", "test_socratic").
      data_dir: TFDS data dir; synthetic tasks and a user's file are prepared there on
        first use.
      style: prompt style, "compact" or "instruct" (a user's file has its own prompts).
      seed: seed of the epoch orders.
      shuffle: False keeps the stored order in every epoch (for evaluation).
      prompt_check: the run's tokenizer and prompt length
        (:class:`~gspo_jax.data.encoding.PromptCheck`), for a task that checks every
        prompt when its data is prepared ("file"); the others do not take it.
      **options: the task's own (its ``prepare``'s keywords; `Task.options` reads them
        from the config). Countdown and arithmetic: ``config``, the difficulty: a
        config name (``"easy"``, ``"digits3"`` ...) or a ``CountdownConfig.make(...)`` /
        ``ArithmeticConfig.make(...)``. GSM8K: ``gsm8k_files``, a folder with the
        GSM8K jsonl files when there is no network. "file": ``file_task``, its
        :class:`~gspo_jax.data.user_file.FileTask`.
    """

    def __init__(
        self,
        task: str,
        split: str = "train",
        *,
        data_dir: os.PathLike | str,
        style: str = "compact",
        seed: int = 0,
        shuffle: bool = True,
        prompt_check=None,
        **options,
    ):
        if style not in prompts.STYLES:
            raise ValueError(f"style must be one of {prompts.STYLES}, got {style!r}")
        self._task = tasks.get(task)
        builder = _prepare(self._task, data_dir, options, prompt_check)
        if split not in builder.info.splits:
            raise ValueError(f"split {split!r} not in {task}: {sorted(builder.info.splits)}")
        self.task, self.split, self.style = task, split, style
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.config_name = builder.builder_config.name if builder.builder_config else None
        self._ds = builder.as_data_source(split)
        self._size = len(self._ds)
        if self._size == 0:
            raise ValueError(f"{task}/{split} under {os.fspath(data_dir)!r} is empty")
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self._size

    def example(self, index: int) -> prompts.Example:
        """Example ``index`` of the split, in stored order."""
        if not 0 <= index < self._size:
            raise ValueError(f"index must be in [0, {self._size}), got {index}")
        return self._task.example(self._ds[int(index)], int(index), self.style)

    def order(self, epoch: int) -> np.ndarray:
        """int64[n]: the split indices in the order of ``epoch``."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.RandomState([self.seed, epoch]).permutation(self._size)
        else:
            order = np.arange(self._size)
        self._order_cache = (epoch, order)
        return order

    def indices(self, position: int, batch_size: int) -> np.ndarray:
        """int64[batch_size]: split indices of positions ``position .. position+batch_size-1``."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pos = np.arange(position, position + batch_size)
        out = np.empty(batch_size, np.int64)
        for epoch in np.unique(pos // self._size):
            sel = pos // self._size == epoch
            out[sel] = self.order(int(epoch))[pos[sel] % self._size]
        return out

    def stream_ids(self, position: int, batch_size: int) -> np.ndarray:
        """int64[batch_size]: ``epoch * len(self) + split index`` of each position.

        Distinct within any batch, including one that crosses an epoch boundary (where
        the tail of one epoch and the head of the next may hold the same example), and
        equal to the split index in epoch 0: ids for the sampler's per-prompt keys.
        """
        pos = np.arange(position, position + batch_size)
        return (pos // self._size) * self._size + self.indices(position, batch_size)

    def batch(self, position: int, batch_size: int) -> list[prompts.Example]:
        """The ``batch_size`` examples starting at data position ``position``.

        The next batch starts at ``position + batch_size``.
        """
        return [self.example(int(i)) for i in self.indices(position, batch_size)]

    def first(self, count: int) -> list[prompts.Example]:
        """The first ``count`` examples in stored order (a fixed evaluation set)."""
        return [self.example(i) for i in range(min(count, self._size))]
