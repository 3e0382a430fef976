"""Plug-in rewards: a user's function ``module:function`` in place of a verifier.

A user's file (task "file", ``config.task.verifier``) may name a function by import
path. Its signature is ``fn(response: str, reference: str, row: dict) -> float``
(``row``: the file's whole row); its value replaces the reward's ``correct`` component
(> 0 counts as correct). A plug-in that raises or returns anything but a finite real
number gives 0 and the status ``reward_fn_error`` (logged), never an exception.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Mapping

import numpy as np

from gspo_jax.answers import Status, Verdict, extract_answer

_log = logging.getLogger(__name__)


def is_reward_fn(verifier: str) -> bool:
    """Whether a ``task.verifier`` value names a plug-in ``module:function``."""
    return ":" in verifier


_REWARD_FNS: dict[str, Any] = {}


def load_reward_fn(spec: str):
    """The function ``module:function`` names (imported once, then cached).

    Raises:
      ValueError: if ``spec`` is malformed, the module cannot be imported, or the
        attribute is missing or not callable.
    """
    if spec in _REWARD_FNS:
        return _REWARD_FNS[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name or ":" in name:
        raise ValueError(f"a reward function is 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ValueError(f"cannot import module {module!r} of {spec!r}: {e}") from None
    fn = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"module {module!r} has no function {name!r}")
    _REWARD_FNS[spec] = fn
    return fn


def plugin_verdict(spec: str, text: str, meta: Mapping[str, Any]) -> Verdict:
    """A plug-in reward ``fn(response, reference, row) -> float``: the value is the
    reward's correctness component; > 0 counts as CORRECT. Raising, or returning
    anything but a finite real number, gives reward 0 and REWARD_FN_ERROR."""
    formatted = extract_answer(text) is not None
    try:
        value = load_reward_fn(spec)(text, str(meta["answer"]), dict(meta.get("row", {})))
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"returned {type(value).__name__}, not a float")
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"returned {value}")
    except Exception:
        _log.exception("reward function %s failed on text %r", spec, text[:200])
        return Verdict(False, formatted, Status.REWARD_FN_ERROR, 0.0)
    return Verdict(
        value > 0, formatted, Status.CORRECT if value > 0 else Status.WRONG_ANSWER, value
    )
