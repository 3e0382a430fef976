"""Prompts and responses as token ids: the chat template, the prompt-length policy, padding.

Every prompt is left-padded to ``rollout.max_prompt_len`` (a longer one is refused or
truncated: ``rollout.long_prompts``), so one shape serves the whole run; responses are
right-padded to ``rollout.max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from gspo_jax.config import ConfigError
from gspo_jax.tokenizers import HFTokenizer


def encode_prompt(tokenizer, text: str, messages=None) -> list[int]:
    """Prompt text -> ids: the chat template where the tokenizer has one. ``messages``
    (an Example's, from a user's messages column) replace the one user message of
    ``text`` in the template; without a template ``text`` (their joined contents) is used."""
    if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages] if messages else [{"role": "user", "content": text}],
            add_generation_prompt=True,
        )
        return tokenizer.encode(text)
    ids = tokenizer.encode(text)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


@dataclasses.dataclass(frozen=True)
class PromptCheck:
    """The run's tokenizer and prompt-length policy, to check a data set's prompts when
    it is prepared (task "file": every row, up front) rather than when a batch draws
    one hours in. ``max_len``, ``long_prompts``: ``rollout.max_prompt_len`` and
    ``rollout.long_prompts`` (a long prompt is a problem only when it is refused)."""

    tokenizer: Any
    max_len: int
    long_prompts: str

    def problem(self, text: str, messages=None, solution: str | None = None) -> str | None:
        """Why the run could not use this prompt (and warm-start solution), or None."""
        try:
            ids = encode_prompt(self.tokenizer, text, messages)
        except ValueError as e:
            return f"the prompt cannot be encoded by config.tokenizer: {e}"
        if len(ids) > self.max_len and self.long_prompts != "truncate":
            return (
                f"the prompt is {len(ids)} tokens, longer than config.rollout.max_prompt_len"
                f"={self.max_len} (raise it, or set config.rollout.long_prompts='truncate')"
            )
        if solution is not None:
            try:
                self.tokenizer.encode(solution)
            except ValueError as e:
                return f"the solution cannot be encoded by config.tokenizer: {e}"
        return None

    def digest(self) -> str:
        """A hash of what decides `problem` (a data set checked with another differs)."""
        h = hashlib.sha256(self.tokenizer.fingerprint().encode())
        h.update(f"{self.max_len}/{self.long_prompts}".encode())
        return h.hexdigest()[:16]


def fit_prompts(
    prompts: Sequence[Sequence[int]], max_len: int, policy: str, where: str = "a prompt"
) -> tuple[list[list[int]], int]:
    """Prompts (token ids) that fit ``rollout.max_prompt_len`` = ``max_len``, and how
    many were truncated. ``policy`` (``rollout.long_prompts``): "refuse" raises a
    ConfigError naming the field and the prompt's length; "truncate" keeps a long
    prompt's last ``max_len`` tokens (its end holds the question's end, the answer
    format and the chat template's assistant turn; the start, a BOS or a system
    message, is what goes)."""
    out, cut = [], 0
    for i, p in enumerate(prompts):
        p = list(p)
        if len(p) > max_len:
            if policy != "truncate":
                raise ConfigError(
                    f"config.rollout.max_prompt_len: {where} of {len(p)} tokens (number {i} "
                    f"of its batch) is longer than max_prompt_len={max_len}; raise it, or set "
                    "config.rollout.long_prompts='truncate' to keep each long prompt's last "
                    f"{max_len} tokens"
                )
            p, cut = p[-max_len:], cut + 1
        out.append(p)
    return out, cut


def pad_left(seqs: Sequence[Sequence[int]], length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    toks = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        if len(s):
            toks[i, length - len(s) :] = s
            mask[i, length - len(s) :] = 1
    return toks, mask


def pad_right(
    seqs: Sequence[Sequence[int]], length: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    toks = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return toks, mask
