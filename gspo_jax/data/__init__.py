"""Prompts for RL and the supervised warm start.

* :mod:`~gspo_jax.data.countdown`, :mod:`~gspo_jax.data.arithmetic`: TFDS
  builders generated offline and deterministically (seeded numpy), each with
  difficulty configs; every example carries a reference solution.
* :mod:`~gspo_jax.data.gsm8k`: TFDS's own ``gsm8k`` builder, from the network
  or from supplied files.
* :mod:`~gspo_jax.data.user_file`: task "file", a user's prompts and answers from a
  JSONL or Parquet file, checked row by row and prepared as a TFDS dataset.
* :mod:`~gspo_jax.data.prompts`: :class:`Example` (a prompt with its verifier's meta)
  and the prompt styles; each task words its prompts (:mod:`gspo_jax.tasks`).
* :mod:`~gspo_jax.data.source`: :class:`PromptSource` (batches as a pure
  function of the data position).
"""

from gspo_jax.data import _tfds_compat  # noqa: F401  (must precede TFDS use)
from gspo_jax.data.arithmetic import ArithmeticConfig, GspoArithmetic
from gspo_jax.data.countdown import CountdownConfig, GspoCountdown
from gspo_jax.data.gsm8k import prepare_gsm8k, supply_gsm8k_files
from gspo_jax.data.prompts import Example, answer_span
from gspo_jax.data.source import PromptSource

__all__ = [
    "ArithmeticConfig",
    "CountdownConfig",
    "Example",
    "GspoArithmetic",
    "GspoCountdown",
    "PromptSource",
    "answer_span",
    "prepare_gsm8k",
    "supply_gsm8k_files",
]
