"""Prompts and responses as token ids: the chat template, the prompt-length policy, padding.

Every prompt is left-padded to ``rollout.max_prompt_len`` (a longer one is refused or
truncated: ``rollout.long_prompts``), so one shape serves the whole run; responses are
right-padded to ``rollout.max_new_tokens``.
"""

from __future__ import annotations

from typing import Sequence

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
