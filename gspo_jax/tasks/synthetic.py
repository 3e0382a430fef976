"""The splits of a synthetic task (countdown, arithmetic), generated in memory from a seed.

Split "test" is ``test_size`` distinct problems, drawn in turn from one stream,
``numpy.random.default_rng([seed, 0])``. Example ``i`` of split "train" is the first
problem of its own stream, ``default_rng([seed, 1, i])``, that is not a test problem
(the task's ``key`` tells two problems apart). So the splits never share a problem, the
test split is made once (milliseconds), a training example is made when it is read, and
every process, run and machine gets the same examples, with no file and no lock.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Hashable

import numpy as np

from gspo_jax import tasks

# Draws of one training example before its difficulty counts as too small to avoid the
# test problems (a share p of test problems among the draws fails with chance p**1000).
TRAIN_DRAWS = 1000


class Generated:
    """The two splits of one seeded generator.

    Args:
      draw: ``draw(rng)`` -> one problem (advances ``rng``, a numpy Generator).
      key: ``key(problem)`` -> what makes two problems the same.
      seed, train_size, test_size: the difficulty's seed and split sizes.
      what: names the difficulty in an error ("Countdown config 'easy'").

    Raises:
      ValueError: when the test split cannot be ``test_size`` distinct problems in
        ``50 * test_size + 100`` draws, or the first training example cannot avoid the
        test problems (the difficulty range is too small for the sizes).
    """

    def __init__(
        self,
        draw: Callable[[np.random.Generator], Any],
        key: Callable[[Any], Hashable],
        *,
        seed: int,
        train_size: int,
        test_size: int,
        what: str,
    ):
        self._draw, self._key, self._seed, self._what = draw, key, int(seed), what
        rng = np.random.default_rng([self._seed, 0])
        test, seen = [], set()
        for _ in range(50 * test_size + 100):
            if len(test) == test_size:
                break
            p = draw(rng)
            if key(p) not in seen:
                seen.add(key(p))
                test.append(p)
        if len(test) < test_size:
            raise ValueError(
                f"{what}: only {len(test)} distinct test problems of {test_size}; the "
                "difficulty range is too small for this test_size"
            )
        self.test: tuple[Any, ...] = tuple(test)
        self._test_keys = frozenset(seen)
        self.train = _Train(self, train_size)
        if train_size:
            self.train_example(0)  # a difficulty whose every problem is a test one fails here

    def train_example(self, index: int) -> Any:
        """Example ``index`` of the train split."""
        rng = np.random.default_rng([self._seed, 1, index])
        for _ in range(TRAIN_DRAWS):
            p = self._draw(rng)
            if self._key(p) not in self._test_keys:
                return p
        raise ValueError(
            f"{self._what}: train example {index} is a test problem in each of "
            f"{TRAIN_DRAWS} draws; the difficulty range is too small"
        )

    def split(self, name: str) -> collections.abc.Sequence:
        """The problems of split ``name`` ("train" or "test"), random access."""
        if name == "test":
            return self.test
        if name == "train":
            return self.train
        raise ValueError(f"split must be 'train' or 'test', got {name!r}")

    def splits(self, config_name: str | None = None) -> tasks.Splits:
        """Both splits as a task's ``prepare`` gives them (`gspo_jax.tasks.Splits`)."""
        return tasks.Splits(("train", "test"), self.split, config_name)


class _Train(collections.abc.Sequence):
    """The train split: example ``i`` made when it is read."""

    def __init__(self, generated: Generated, size: int):
        self._generated, self._size = generated, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        index = int(index)
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError(f"train index {index} out of range [0, {self._size})")
        return self._generated.train_example(index)


def pick_level(task: str, levels: dict, default: str, cls: type, config):
    """``config`` as a ``cls`` (a task's difficulty dataclass): one of ``levels`` by name
    (None: ``default``), or a ``cls`` itself."""
    if config is None:
        config = default
    if isinstance(config, str):
        if config not in levels:
            raise ValueError(f"{task} has no level {config!r}; known: {list(levels)}")
        return levels[config]
    if not isinstance(config, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(
            f"config must be a level's name or {article} {cls.__name__}, got {config!r}"
        )
    return config
