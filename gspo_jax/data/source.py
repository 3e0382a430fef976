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

import os
from typing import Any

import numpy as np

from gspo_jax import rewards
from gspo_jax.data import arithmetic, countdown, prompts, user_file
from gspo_jax.data import gsm8k as gsm8k_lib

TASKS = ("countdown", "arithmetic", "gsm8k", "file")


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def make_builder(task: str, data_dir: os.PathLike | str, config=None):
    """The TFDS builder of a task. ``config``: a config name, a config object, or None (default)."""
    data_dir = os.fspath(data_dir)
    if task == "countdown":
        return countdown.GspoCountdown(data_dir=data_dir, config=config)
    if task == "arithmetic":
        return arithmetic.GspoArithmetic(data_dir=data_dir, config=config)
    if task == "gsm8k":
        if config is not None:
            raise ValueError(f"gsm8k has no configs, got config={config!r}")
        return gsm8k_lib.gsm8k_builder(data_dir)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def to_example(task: str, record: dict[str, Any], index: int, style: str) -> prompts.Example:
    """A decoded TFDS record as an :class:`Example`."""
    if task == "countdown":
        numbers = tuple(int(n) for n in np.asarray(record["numbers"]))
        target = int(record["target"])
        return prompts.Example(
            task,
            prompts.countdown_prompt(numbers, target, style),
            {"numbers": numbers, "target": target},
            prompts.answer_span(_text(record["solution"])),
            index,
        )
    if task == "arithmetic":
        question, answer = _text(record["question"]), _text(record["answer"])
        return prompts.Example(
            task,
            prompts.arithmetic_prompt(question, style),
            {"answer": answer},
            prompts.answer_span(answer),
            index,
        )
    if task == "gsm8k":
        full = _text(record["answer"])
        answer = rewards.gsm8k_final_answer(full)
        return prompts.Example(
            task,
            prompts.gsm8k_prompt(_text(record["question"]), style),
            {"answer": answer},
            prompts.gsm8k_reference(_text(record["annotation"]), answer),
            index,
        )
    if task == "file":
        return user_file.from_record(record, index)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


class PromptSource:
    """Random-access prompts of one task and split, in a seeded order per epoch.

    Args:
      task: "countdown", "arithmetic", "gsm8k" or "file" (a user's JSONL/Parquet
        file, :mod:`~gspo_jax.data.user_file`; ``file_task``).
      split: "train" or "test" (GSM8K also "train_socratic", "test_socratic").
      data_dir: TFDS data dir; synthetic tasks and a user's file are prepared there on
        first use.
      config: synthetic difficulty: a config name (``"easy"``, ``"digits3"``
        ...) or a ``CountdownConfig.make(...)`` / ``ArithmeticConfig.make(...)``.
      style: prompt style, "compact" or "instruct".
      seed: seed of the epoch orders.
      shuffle: False keeps the stored order in every epoch (for evaluation).
      gsm8k_files: folder with the GSM8K jsonl files when there is no network.
      file_task: the :class:`~gspo_jax.data.user_file.FileTask` of task "file"
        (``config`` and ``style`` are then unused).
    """

    def __init__(
        self,
        task: str,
        split: str = "train",
        *,
        data_dir: os.PathLike | str,
        config=None,
        style: str = "compact",
        seed: int = 0,
        shuffle: bool = True,
        gsm8k_files: os.PathLike | str | None = None,
        file_task: user_file.FileTask | None = None,
    ):
        if style not in prompts.STYLES:
            raise ValueError(f"style must be one of {prompts.STYLES}, got {style!r}")
        if (task == "file") != (file_task is not None):
            raise ValueError(f"file_task is for task 'file' (and needed there), got task {task!r}")
        if task == "file":
            builder = user_file.prepare(file_task, data_dir)
        elif task == "gsm8k":
            if config is not None:
                raise ValueError(f"gsm8k has no configs, got config={config!r}")
            builder = gsm8k_lib.prepare_gsm8k(data_dir, files_dir=gsm8k_files)
        else:
            if gsm8k_files is not None:
                raise ValueError(f"gsm8k_files is only for task 'gsm8k', got task {task!r}")
            builder = make_builder(task, data_dir, config)
            builder.download_and_prepare(file_format="array_record")
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
        return to_example(self.task, self._ds[int(index)], int(index), self.style)

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
