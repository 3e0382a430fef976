"""Task "gsm8k": grade-school word problems (Cobbe et al., 2021).

The data are TFDS's own ``gsm8k`` builder, from the network or from supplied files
(:mod:`gspo_jax.data.gsm8k`); the answer is a number, read and compared exactly by
:func:`gspo_jax.answers.verify_numeric`. The warm start trains on the worked solutions.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from gspo_jax import tasks
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN
from gspo_jax.data import gsm8k as gsm8k_data
from gspo_jax.data import prompts


def prompt(question: str, style: str = "compact") -> str:
    """Prompt for a GSM8K word problem."""
    question = question.strip()
    return prompts.in_style(
        style,
        compact=f"{question}\n",
        instruct=(
            f"{question}\nSolve the problem step by step, then give the final number "
            f"inside {ANSWER_OPEN}{ANSWER_CLOSE}, for example {prompts.answer_span('42')}."
        ),
    )


_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


def reference(annotation: str, answer: str) -> str:
    """Warm-start completion for GSM8K: the worked solution without its
    ``<<48/2=24>>`` calculator annotations, then the answer span."""
    steps = _CALCULATOR_RE.sub("", annotation).strip()
    return f"{steps}\n{prompts.answer_span(answer)}"


def _prepare(data_dir, gsm8k_files=None):
    return gsm8k_data.prepare_gsm8k(data_dir, files_dir=gsm8k_files)


def _example(record: Mapping[str, Any], index: int, style: str) -> prompts.Example:
    answer = gsm8k_data.gsm8k_final_answer(prompts.as_text(record["answer"]))
    return prompts.Example(
        "gsm8k",
        prompt(prompts.as_text(record["question"]), style),
        {"answer": answer},
        reference(prompts.as_text(record["annotation"]), answer),
        index,
    )


TASK = tasks.register(
    tasks.numeric_task(
        "gsm8k",
        prepare=_prepare,
        example=_example,
        options=lambda task_config: {"gsm8k_files": task_config.gsm8k_files or None},
    )
)
