"""Task "arithmetic": compute an integer expression such as ``12*34``.

The data are :mod:`gspo_jax.data.arithmetic`'s TFDS builder (one config per difficulty
level); the answer is a number, read and compared exactly by
:func:`gspo_jax.answers.verify_numeric`.
"""

from __future__ import annotations

from typing import Any, Mapping

from gspo_jax import answers, tasks
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN
from gspo_jax.data import arithmetic as arithmetic_data
from gspo_jax.data import prompts


def prompt(question: str, style: str = "compact") -> str:
    """Prompt for an arithmetic question like ``"12*34"``."""
    if style == "compact":
        return f"Compute {question}.\n"
    if style == "instruct":
        return (
            f"Compute {question}. Give only the final integer inside "
            f"{ANSWER_OPEN}{ANSWER_CLOSE}, for example {prompts.answer_span('42')}."
        )
    raise ValueError(f"style must be one of {prompts.STYLES}, got {style!r}")


def _prepare(data_dir, config=None):
    builder = arithmetic_data.GspoArithmetic(data_dir=str(data_dir), config=config)
    builder.download_and_prepare(file_format="array_record")
    return builder


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
    tasks.Task(
        name="arithmetic",
        prepare=_prepare,
        example=_example,
        check_meta=lambda meta: answers.check_numeric_meta("arithmetic", meta),
        verify=answers.verify_numeric_meta,
        levels=lambda: [b.name for b in arithmetic_data.GspoArithmetic.BUILDER_CONFIGS],
        options=lambda task_config: {"config": task_config.difficulty},
        answer_kind=lambda task_config: "numeric",
    )
)
