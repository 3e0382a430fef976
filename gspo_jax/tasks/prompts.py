"""What a prompt is (:class:`Example`), and its styles, shared by every task, the SFT
warm start and RL.

Each task words its prompts (its module in :mod:`gspo_jax.tasks`), in two styles:

* ``"compact"``: one short line per task, for the character-level tiny
  models trained from scratch (every character is a token there).
* ``"instruct"``: a full instruction for pretrained chat models; the caller
  wraps it in the checkpoint's chat template.

Both ask for the final answer inside ``<answer>...</answer>``, the span the
verifiers read (:mod:`gspo_jax.answers`). The reference answer is the exact
completion the SFT warm start trains on, e.g. ``<answer>(3+5)*2</answer>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN

STYLES = ("compact", "instruct")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with what the verifier and the warm start need.

    Attributes:
      task: the task's name (:mod:`gspo_jax.tasks`).
      prompt: the prompt text (not yet chat-templated or tokenized).
      meta: the verifier's metadata: Countdown ``{"numbers": tuple[int],
        "target": int}``, arithmetic/GSM8K ``{"answer": str}`` (each task's own).
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


def in_style(style: str, *, compact: str, instruct: str) -> str:
    """The prompt of ``style``: ``compact`` or ``instruct``."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return compact if style == "compact" else instruct


def answer_span(content: str) -> str:
    """``<answer>content</answer>``."""
    return f"{ANSWER_OPEN}{content}{ANSWER_CLOSE}"


def as_text(x) -> str:
    """A stored string field (bytes when read from TFDS) as str."""
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)
