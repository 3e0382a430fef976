"""Prompt text and reference answers, shared by the SFT warm start and RL.

Two styles:

* ``"compact"``: one short line per task, for the character-level tiny
  models trained from scratch (every character is a token there).
* ``"instruct"``: a full instruction for pretrained chat models; the caller
  wraps it in the checkpoint's chat template.

Both ask for the final answer inside ``<answer>...</answer>``, the span the
verifiers in :mod:`gspo_jax.rewards` read. The reference answer is the exact
completion the SFT warm start trains on, e.g. ``<answer>(3+5)*2</answer>``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from gspo_jax.rewards import ANSWER_CLOSE, ANSWER_OPEN

STYLES = ("compact", "instruct")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with what the verifier and the warm start need.

    Attributes:
      task: "countdown", "arithmetic", "gsm8k" or "file".
      prompt: the prompt text (not yet chat-templated or tokenized).
      meta: the verifier's metadata: Countdown ``{"numbers": tuple[int],
        "target": int}``, arithmetic/GSM8K ``{"answer": str}``.
      reference: the completion for supervised warm start (the answer in the
        answer format), or None where the dataset has none.
      index: the example's index in its split (stable across runs).
      messages: chat messages ``({"role", "content"}, ...)`` to render with the
        tokenizer's chat template instead of ``prompt`` (a user's file with a
        messages column); ``prompt`` then holds their contents joined by newlines.
    """

    task: str
    prompt: str
    meta: Mapping[str, Any]
    reference: str | None
    index: int
    messages: tuple[Mapping[str, str], ...] | None = None


def answer_span(content: str) -> str:
    """``<answer>content</answer>``."""
    return f"{ANSWER_OPEN}{content}{ANSWER_CLOSE}"


def countdown_prompt(numbers, target: int, style: str = "compact") -> str:
    """Prompt for a Countdown problem."""
    nums = " ".join(str(int(n)) for n in numbers)
    if style == "compact":
        return f"Make {int(target)} from {nums} with + - * /, each once.\n"
    if style == "instruct":
        return (
            f"Using the numbers {nums}, write an expression that equals {int(target)}. "
            "You may use + - * / and parentheses, and must use each number exactly once. "
            f"Give only the final expression inside {ANSWER_OPEN}{ANSWER_CLOSE}, "
            f"for example {answer_span('(1+2)*3')}."
        )
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def arithmetic_prompt(question: str, style: str = "compact") -> str:
    """Prompt for an arithmetic question like ``"12*34"``."""
    if style == "compact":
        return f"Compute {question}.\n"
    if style == "instruct":
        return (
            f"Compute {question}. Give only the final integer inside "
            f"{ANSWER_OPEN}{ANSWER_CLOSE}, for example {answer_span('42')}."
        )
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def gsm8k_prompt(question: str, style: str = "compact") -> str:
    """Prompt for a GSM8K word problem."""
    question = question.strip()
    if style == "compact":
        return f"{question}\n"
    if style == "instruct":
        return (
            f"{question}\nSolve the problem step by step, then give the final number "
            f"inside {ANSWER_OPEN}{ANSWER_CLOSE}, for example {answer_span('42')}."
        )
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


def gsm8k_reference(annotation: str, answer: str) -> str:
    """Warm-start completion for GSM8K: the worked solution without its
    ``<<48/2=24>>`` calculator annotations, then the answer span."""
    steps = _CALCULATOR_RE.sub("", annotation).strip()
    return f"{steps}\n{answer_span(answer)}"
