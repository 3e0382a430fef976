"""A task's prompts as batches, and prompts and responses as token ids.

* :mod:`~gspo_jax.data.source`: :class:`PromptSource`, the batches of any task
  (:mod:`gspo_jax.tasks`) as a pure function of the data position: a
  ``grain.MapDataset`` over the task's examples, shuffled per epoch with the run's seed.
* :mod:`~gspo_jax.data.encoding`: the chat template, the prompt-length policy, padding.

The tasks' examples are in their own modules (:mod:`gspo_jax.tasks`); the names below
that come from there (the difficulty configs, GSM8K's preparation, `Example`) are kept
here for one release.
"""

from gspo_jax.data.source import PromptSource
from gspo_jax.tasks.arithmetic import ArithmeticConfig
from gspo_jax.tasks.countdown import CountdownConfig
from gspo_jax.tasks.gsm8k import prepare_gsm8k, supply_gsm8k_files
from gspo_jax.tasks.prompts import Example, answer_span

__all__ = [
    "ArithmeticConfig",
    "CountdownConfig",
    "Example",
    "PromptSource",
    "answer_span",
    "prepare_gsm8k",
    "supply_gsm8k_files",
]

_REMOVED = {
    "GspoCountdown": "gspo_jax.tasks.countdown.generated(config)",
    "GspoArithmetic": "gspo_jax.tasks.arithmetic.generated(config)",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(
            f"gspo_jax.data.{name}, a TFDS builder, was removed: the task's examples are "
            f"generated in memory, with no data dir; its splits are {_REMOVED[name]}"
        )
    raise AttributeError(f"module 'gspo_jax.data' has no attribute {name!r}")
