"""Task "arithmetic": compute an integer expression such as ``12*34``.

The data are :mod:`gspo_jax.data.arithmetic`'s TFDS builder (one config per difficulty
level); the answer is a number, read and compared exactly by
:func:`gspo_jax.answers.verify_numeric`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from gspo_jax import tasks
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN
from gspo_jax.data import arithmetic as arithmetic_data
from gspo_jax.data import prompts, source


def prompt(question: str, style: str = "compact") -> str:
    """Prompt for an arithmetic question like ``"12*34"``."""
    return prompts.in_style(
        style,
        compact=f"Compute {question}.\n",
        instruct=(
            f"Compute {question}. Give only the final integer inside "
            f"{ANSWER_OPEN}{ANSWER_CLOSE}, for example {prompts.answer_span('42')}."
        ),
    )


def _prepare(data_dir, config=None):
    builder = arithmetic_data.GspoArithmetic(data_dir=os.fspath(data_dir), config=config)
    return source.prepared(builder)


def _example(record: Mapping[str, Any], index: int, style: str) -> prompts.Example:
    question, answer = prompts.as_text(record["question"]), prompts.as_text(record["answer"])
    return prompts.Example(
        "arithmetic",
        prompt(question, style),
        {"answer": answer},
        prompts.answer_span(answer),
        index,
    )


TASK = tasks.register(
    tasks.numeric_task(
        "arithmetic",
        prepare=_prepare,
        example=_example,
        levels=lambda: [b.name for b in arithmetic_data.GspoArithmetic.BUILDER_CONFIGS],
        options=lambda task_config: {"config": task_config.difficulty},
    )
)
