"""Held-out metrics that compare across runs: pass@k, maj@k, mean@n and greedy accuracy.

:func:`evaluate` samples a run's held-out prompts and scores them; every other function
here is pure numpy on the host. The inputs are per-sample arrays shaped
``[prompts, n]``: ``correct`` (the verifier's 0/1, :func:`gspo_jax.rewards.score`) and
``answers`` (each sample's extracted final answer as a string, or None when it states
none; :func:`final_answers`). :func:`eval_metrics` turns them into the logged dict:

* ``eval/pass@k``: the unbiased estimator of Chen et al. (2021), per prompt with ``c``
  correct of ``n >= k`` samples ``1 - C(n - c, k) / C(n, k)``, averaged over prompts.
  Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``: no binomial coefficient is
  ever formed, so it is exact to float precision for any n.
* ``eval/maj@k``: majority vote over the first ``k`` samples' final answers; the
  prompt scores the correctness of the most common answer (ties: the answer that occurs
  first). Samples that state no answer do not vote; a prompt with no answer among its
  ``k`` samples scores 0. For numeric tasks (arithmetic, GSM8K) the answers are numbers,
  compared as exact rationals (``72``, ``72.0`` and ``$72`` are one answer). For
  Countdown many different expressions are correct, so maj@k is the correctness of the
  most common answer *string* (the content of the answer tag with its whitespace
  removed): it rewards a policy that concentrates on one solution, and is not a vote
  over values (every correct expression has the target's value).
* ``eval/mean@n`` (``n`` the number of samples, e.g. ``eval/mean@4``): the mean
  correctness of all samples; it equals ``eval/pass@1``.
* ``eval/greedy``: the accuracy of greedy decoding (one sample per prompt).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np

from gspo_jax import multihost, tasks
from gspo_jax.answers import extract_answer, read_final_answer


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k per prompt (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``.

    Args:
      num_samples: n per prompt (int or int array), each ``>= k``.
      num_correct: c per prompt (broadcasts with ``num_samples``), ``0 <= c <= n``.
      k: the number of draws, ``>= 1``.

    Returns:
      float64 array of the broadcast shape: the probability that at least one of ``k``
      samples drawn without replacement from the ``n`` is correct. Computed in product
      form, ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (1 when ``n - c < k``).
    """
    n = np.asarray(num_samples, np.int64)
    c = np.asarray(num_correct, np.int64)
    n, c = np.broadcast_arrays(n, c)
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if np.any(n < k):
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got n={n.min()}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("num_correct must be in [0, num_samples]")
    if n.size == 0:
        return np.zeros(n.shape, np.float64)
    # Factor j (0 <= j < c) is 1 - k / (n - j); factors past c are 1.
    j = np.arange(int(c.max()) if c.size else 0)
    denom = n[..., None] - j  # >= 1 where j < c
    active = j < c[..., None]
    factors = np.where(active, 1.0 - k / np.where(active, denom, 1), 1.0)
    out = 1.0 - np.prod(factors, axis=-1)
    return np.where(n - c < k, 1.0, out)


def maj_at_k(answers: Sequence[Sequence[str | None]], correct, k: int) -> np.ndarray:
    """Majority vote per prompt over its first ``k`` samples.

    Args:
      answers: ``[prompts][n]`` final answers (hashable, e.g. strings); None = no answer,
        which does not vote.
      correct: ``[prompts, n]`` 0/1 correctness of each sample.
      k: how many of the first samples vote, ``1 <= k <= n``.

    Returns:
      float64 ``[prompts]``: the correctness of the most common answer among the first
      ``k`` (ties broken by first occurrence; its first sample's correctness), 0 for a
      prompt where none of them states an answer.
    """
    correct = np.asarray(correct)
    if correct.ndim != 2:
        raise ValueError(f"correct must be [prompts, n], got shape {correct.shape}")
    if len(answers) != correct.shape[0]:
        raise ValueError(f"{len(answers)} rows of answers for {correct.shape[0]} prompts")
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs 1 <= k <= n={n}")
    out = np.zeros(correct.shape[0], np.float64)
    for p, row in enumerate(answers):
        if len(row) != n:
            raise ValueError(f"prompt {p} has {len(row)} answers, expected {n}")
        counts: dict = {}
        first: dict = {}
        for i, a in enumerate(row[:k]):
            if a is None:
                continue
            counts[a] = counts.get(a, 0) + 1
            first.setdefault(a, i)
        if counts:
            # max keeps the first of equal counts; dicts iterate in first-occurrence order.
            best = max(counts, key=counts.__getitem__)
            out[p] = float(correct[p, first[best]])
    return out


# How final answers are compared, by a task's `answer_kind` (gspo_jax.tasks.Task).
ANSWER_KINDS = ("numeric", "tag")


def final_answer(kind: str, text: str) -> str | None:
    """One response's final answer as a comparable string, or None when it states none.

    ``kind`` (`ANSWER_KINDS`; the task's ``answer_kind``): "numeric", the number
    :func:`gspo_jax.answers.read_final_answer` reads, as an exact rational (``"72"``,
    ``"1/2"``); "tag", the content of the last answer tag
    (:func:`gspo_jax.answers.extract_answer`) without its whitespace, but for one space
    where it stands between two words or numbers (None when empty).
    """
    if kind not in ANSWER_KINDS:
        raise ValueError(f"kind must be one of {ANSWER_KINDS}, got {kind!r}")
    if kind == "numeric":
        value = read_final_answer(text).value
        return None if value is None else str(value)
    content = extract_answer(text)
    if content is None:
        return None
    # Whitespace goes, but where it keeps two words or numbers apart ("1 2" is not 12).
    content = _SPACE_NOT_APART_RE.sub("", " ".join(content.split()))
    return content or None


_SPACE_NOT_APART_RE = re.compile(r"(?<!\w) | (?!\w)")  # a space not between two words


def final_answers(kind: str, texts: Sequence[str]) -> list[str | None]:
    """:func:`final_answer` of each response."""
    return [final_answer(kind, t) for t in texts]


def eval_metrics(
    correct,
    answers: Sequence[Sequence[str | None]] | None = None,
    ks: Sequence[int] = (1,),
    greedy_correct=None,
    prefix: str = "eval/",
) -> dict[str, float]:
    """The held-out metric dict from per-sample arrays shaped ``[prompts, n]``.

    Args:
      correct: ``[prompts, n]`` 0/1 correctness of the n samples of each prompt.
      answers: ``[prompts][n]`` final answers (:func:`final_answers`); None: no maj@k.
      ks: the k of pass@k and maj@k, each in ``[1, n]``.
      greedy_correct: ``[prompts]`` 0/1 correctness of greedy decoding; None: no greedy.
      prefix: prepended to every key.

    Returns:
      ``{prefix + "pass@k": ..., prefix + "maj@k": ... for k in ks, prefix + "mean@n": ...,
      prefix + "greedy": ...}`` as floats.
    """
    correct = np.asarray(correct, np.float64)
    if correct.ndim != 2:
        raise ValueError(f"correct must be [prompts, n], got shape {correct.shape}")
    num_prompts, n = correct.shape
    c = np.rint(correct).astype(np.int64).sum(axis=1)
    out: dict[str, float] = {}
    for k in ks:
        out[f"{prefix}pass@{k}"] = float(np.mean(pass_at_k(n, c, k))) if num_prompts else 0.0
    if answers is not None:
        for k in ks:
            out[f"{prefix}maj@{k}"] = (
                float(np.mean(maj_at_k(answers, correct, k))) if num_prompts else 0.0
            )
    out[f"{prefix}mean@{n}"] = float(correct.mean()) if correct.size else 0.0
    if greedy_correct is not None:
        g = np.asarray(greedy_correct, np.float64).reshape(-1)
        out[f"{prefix}greedy"] = float(g.mean()) if g.size else 0.0
    return out


# --------------------------------------------------------------------------
# The held-out evaluation of a run (the model samples; the rest above is numpy).


def evaluate(trainer, params, examples=None) -> dict[str, float]:
    """Held-out metrics of ``params`` on the first ``task.eval_size`` test prompts (or
    ``examples``); ``trainer``: the run's parts (`gspo_jax.run_parts.RunParts`).

    ``eval_reward_mean`` is the mean reward of ``task.eval_samples`` samples
    per prompt at the rollout's sampling settings: the RL objective itself,
    on prompts never trained on. ``eval_greedy_reward`` is greedy decoding's.
    Both use fixed keys, so every evaluation sees the same randomness. From the
    same samples, :func:`eval_metrics`: ``eval/pass@k`` and
    ``eval/maj@k`` for k in ``task.eval_pass_k``, ``eval/mean@n`` (n the samples
    per prompt) and ``eval/greedy``.
    """
    cfg = trainer.cfg
    if examples is None:
        examples = trainer.eval_data.first(cfg.task.eval_size)
    k = cfg.task.eval_samples
    ro, cut = trainer.rollout(params, examples, jax.random.key(cfg.seed + 2), num_samples=k)
    # Final answers are read as the task compares them (numeric: values; else the tag).
    kind = tasks.get(cfg.task.name).answer_kind(cfg.task)
    _, sampled, _, _ = trainer.score(examples, ro, num_samples=k, answers=kind)
    answers = multihost.codes_to_answers(sampled["answer_code"])
    ro, _ = trainer.rollout(params, examples, jax.random.key(0), greedy=True, num_samples=1)
    _, greedy, _, _ = trainer.score(examples, ro, num_samples=1)
    out = {
        "eval_reward_mean": float(np.mean(sampled["correct"])),
        "eval_greedy_reward": float(np.mean(greedy["correct"])),
        "eval_prompts_truncated": cut,
    }
    out.update(
        eval_metrics(
            np.asarray(sampled["correct"]).reshape(len(examples), k),
            [answers[i * k : (i + 1) * k] for i in range(len(examples))],
            ks=list(cfg.task.eval_pass_k),
            greedy_correct=greedy["correct"],
        )
    )
    return out
