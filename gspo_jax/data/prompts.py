"""Moved to :mod:`gspo_jax.tasks.prompts`; this name is kept for one release."""

from gspo_jax.tasks.prompts import STYLES, Example, answer_span, as_text, in_style

__all__ = ["STYLES", "Example", "answer_span", "as_text", "in_style"]
