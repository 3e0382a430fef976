"""Rewards for a batch of responses: each task's verifier, and the optional format reward.

The entry point is :func:`score`. The verifier is the task's (:mod:`gspo_jax.tasks`,
by name); the answer format and the shared answer reading are in
:mod:`gspo_jax.answers`; a user's file picks its verifier by name
(:mod:`gspo_jax.verifiers`) or a plug-in reward ``module:function``
(:mod:`gspo_jax.reward_plugins`), whose value replaces ``correct`` below; a
plug-in's calls run under a time limit and its failures are summarised once per batch
(`gspo_jax.reward_plugins.RewardFnCalls`).

Every response gets a reward and a status (:class:`~gspo_jax.answers.Status`); garbage
text gets reward 0 and a failure status, never an exception. A verifier that raises
(a bug) gives ``verifier_error``, logged, and the run goes on.

Reward, per response::

    reward = correct + format_weight * formatted

``correct`` is 1 when the answer is right; ``formatted`` is 1 when an answer
span exists and its content parses (an expression for Countdown, a number
otherwise). With ``format_weight=0`` (the default) the reward is the 0/1
correctness of DeepSeek-R1 and TinyZero.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from gspo_jax import reward_plugins, tasks
from gspo_jax.answers import DEFAULT_LIMITS, Limits, Status, Verdict

_log = logging.getLogger(__name__)


def verify(
    task: str,
    text: str,
    meta: Mapping[str, Any],
    limits: Limits = DEFAULT_LIMITS,
    *,
    reward_fns: reward_plugins.RewardFnCalls | None = None,
    response: int = 0,
) -> Verdict:
    """Verdict for one response. ``meta`` as the task's examples carry it
    (:class:`~gspo_jax.data.Example`): Countdown ``{"numbers", "target"}``; arithmetic
    and GSM8K ``{"answer"}``; a user's file (task "file") ``{"verifier", "answer",
    "row"}`` (plus Countdown's fields), ``verifier`` a name of
    :mod:`gspo_jax.verifiers` or a plug-in ``module:function``. ``reward_fns``: how a
    plug-in is called (its time limit; ``response``: the row in the batch); without
    it, a plug-in is called as a verifier (the default time limit, failures logged).

    Raises:
      ValueError: for an unknown task, a non-str text, or meta missing a field
        (caller bugs). Never for the content of ``text``.
      RewardFnError: a plug-in keeps hanging (`gspo_jax.reward_plugins`).
    """
    if not isinstance(text, str):
        raise ValueError(f"texts must be str, got {type(text).__name__}")
    t = tasks.get(task)
    t.check_meta(meta)
    if reward_fns is not None and (spec := reward_plugins.reward_fn_of(meta)) is not None:
        return reward_fns.verdict(spec, text, meta, response)
    try:
        return t.verify(text, meta, limits)
    except Exception:  # A verifier bug must not end a training run: count it.
        _log.exception("verifier error on task %s, text %r", task, text[:200])
        return Verdict(False, False, Status.VERIFIER_ERROR)


def score(
    task: str,
    texts: Sequence[str],
    metas: Sequence[Mapping[str, Any]],
    *,
    format_weight: float = 0.0,
    limits: Limits = DEFAULT_LIMITS,
    reward_fns: reward_plugins.RewardFnCalls | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
    """Rewards for a batch of responses.

    Args:
      task: a task name (:func:`gspo_jax.tasks.names`).
      texts: N decoded responses.
      metas: N task metadata dicts (one per response; repeat a prompt's meta
        for its G samples).
      format_weight: weight of the format component.
      limits: parser bounds.
      reward_fns: how plug-in rewards are called, and what a batch in which each of
        their calls failed does (default: `gspo_jax.reward_plugins.default_calls`).

    Returns:
      rewards: f32[N], ``correct + format_weight * format``.
      components: ``{"correct": f32[N], "format": f32[N]}``.
      counts: number of responses per :class:`Status` value, every status
        present (zeros included) so logged keys are stable across steps.

    Raises:
      RewardFnError: every plug-in call failed (``reward_fns.all_failed="stop"``), or
        a plug-in keeps hanging.
    """
    if len(texts) != len(metas):
        raise ValueError(
            f"texts and metas must have the same length, got {len(texts)} and {len(metas)}"
        )
    correct = np.zeros(len(texts), np.float32)
    formatted = np.zeros(len(texts), np.float32)
    counts = {s.value: 0 for s in Status}
    calls = reward_fns or reward_plugins.default_calls()
    with calls.batch():
        for i, (text, meta) in enumerate(zip(texts, metas)):
            v = verify(task, text, meta, limits, reward_fns=calls, response=i)
            correct[i] = v.correct if v.reward is None else v.reward
            formatted[i] = v.formatted
            counts[v.status.value] += 1
    rewards = (correct + np.float32(format_weight) * formatted).astype(np.float32)
    return rewards, {"correct": correct, "format": formatted}, counts
