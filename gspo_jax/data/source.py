"""Deterministic, resumable prompt batches of any task, through grain.

The data position is one integer: the number of examples consumed so far. The batches
are a ``grain.MapDataset`` over a split's records (``grain.MapDataset.source``), each
turned into its task's `Example` (``map_with_index``), shuffled per epoch (``shuffle``)
and repeated (``repeat``): position ``p`` is example ``order(epoch)[p % n]`` with
``epoch = p // n``, where ``order(epoch)`` is grain's permutation of epoch ``epoch``
(an index shuffle of the split seeded with `shuffle_seed` + epoch). So a batch is a pure
function of ``(position, batch_size)``; the trainer derives the position from the step,
so a resumed run draws exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import grain
import numpy as np

from gspo_jax import tasks
from gspo_jax.tasks import prompts

# Kept here for one release: where the data are prepared on disk (gspo_jax.tasks.data_dir).
from gspo_jax.tasks.data_dir import DataDirNotWritable, prepared  # noqa: F401


def shuffle_seed(seed: int) -> int:
    """grain's shuffle seed for the run's ``seed``, in [0, 2**32). grain shuffles epoch
    ``e`` with seed ``s + e``; the run's seed is spread over the range first
    (``numpy.random.SeedSequence``), else the runs of seeds 0 and 1 would see the same epoch orders,
    one epoch apart."""
    return int(np.random.SeedSequence(int(seed)).generate_state(1, np.uint32)[0])


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
        "file" (a user's JSONL/Parquet file, :mod:`~gspo_jax.tasks.user_file`) or one
        registered since.
      split: "train" or "test" (GSM8K also "train_socratic", "test_socratic").
      data_dir: the data dir where GSM8K and a user's file are prepared on first use
        (:mod:`gspo_jax.tasks.data_dir`); the synthetic tasks are generated in memory
        and write nothing.
      style: prompt style, "compact" or "instruct" (a user's file has its own prompts).
      seed: the run's seed; it seeds the epoch orders (`shuffle_seed`).
      shuffle: False keeps the split's own order in every epoch (for evaluation).
      prompt_check: the run's tokenizer and prompt length
        (:class:`~gspo_jax.data.encoding.PromptCheck`), for a task that checks every
        prompt when its data is prepared ("file"); the others do not take it.
      **options: the task's own (its ``prepare``'s keywords; `Task.options` reads them
        from the config). Countdown and arithmetic: ``config``, the difficulty: a
        level's name (``"easy"``, ``"digits3"`` ...) or a ``CountdownConfig.make(...)``
        / ``ArithmeticConfig.make(...)``. GSM8K: ``gsm8k_files``, a folder with the
        GSM8K jsonl files when there is no network. "file": ``file_task``, its
        :class:`~gspo_jax.tasks.user_file.FileTask`.
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
        splits = tasks.Splits.of(_prepare(self._task, data_dir, options, prompt_check))
        if split not in splits.names:
            raise ValueError(f"split {split!r} not in {task}: {sorted(splits.names)}")
        self.task, self.split, self.style = task, split, style
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.config_name = splits.config_name
        records = splits.records(split)
        n = self._size = len(records)
        if n == 0:
            raise ValueError(f"{task}/{split} under {os.fspath(data_dir)!r} is empty")
        example = self._task.example
        # Split index -> Example; a repeated epoch reads index epoch * n + i.
        self._examples = grain.MapDataset.source(records).map_with_index(
            lambda i, record: example(record, i % n, style)
        )
        self._stream = self._in_order(self._examples)  # position -> Example
        self._positions = self._in_order(grain.MapDataset.range(n))  # position -> split index
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _in_order(self, ds: grain.MapDataset) -> grain.MapDataset:
        """``ds`` (one epoch) in the order of every epoch: shuffled per epoch, repeated."""
        if self.shuffle:
            ds = ds.shuffle(seed=shuffle_seed(self.seed))
        return ds.repeat()

    def __len__(self) -> int:
        return self._size

    def example(self, index: int) -> prompts.Example:
        """Example ``index`` of the split, in the split's own order."""
        if not 0 <= index < self._size:
            raise ValueError(f"index must be in [0, {self._size}), got {index}")
        return self._examples[int(index)]

    def order(self, epoch: int) -> np.ndarray:
        """int64[n]: the split indices in the order of ``epoch``."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            start = int(epoch) * self._size
            order = self._read(self._positions, start, self._size)
            self._order_cache = (epoch, np.asarray(order, np.int64))
        return self._order_cache[1]

    def indices(self, position: int, batch_size: int) -> np.ndarray:
        """int64[batch_size]: split indices of positions ``position .. position+batch_size-1``."""
        return np.asarray(self._read(self._positions, position, batch_size), np.int64)

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
        return self._read(self._stream, position, batch_size)

    def first(self, count: int) -> list[prompts.Example]:
        """The first ``count`` examples in the split's own order (a fixed evaluation set)."""
        return [self._examples[i] for i in range(min(count, self._size))]

    @staticmethod
    def _read(ds: grain.MapDataset, position: int, count: int) -> list:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if count < 1:
            raise ValueError(f"batch_size must be >= 1, got {count}")
        return [ds[p] for p in range(int(position), int(position) + int(count))]
