r"""Verifiers by name, for a user's own data (task "file", ``config.task.verifier``).

Each is a :class:`Verifier`: how a response is checked against a row's reference
answer, what a reference must look like, and how evaluation compares its answers.

  numeric      the final number equals the reference exactly
               (:func:`gspo_jax.answers.verify_numeric`)
  countdown    an expression that makes the target from the row's numbers
               (:func:`gspo_jax.tasks.countdown.verify_countdown`)
  exact_match  the answer-tag content, else the whole response, equals the reference
               after whitespace normalisation
  boxed_math   the last ``\\boxed{...}``, else the answer tag, equals the reference after
               :func:`~gspo_jax.answers.normalize_math`, as strings or as the same
               exact number; lists and tuples element by element
               (:func:`verify_boxed_math`)

Any other name with a ``:`` is a plug-in reward ``module:function``
(:mod:`gspo_jax.reward_plugins`).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any, Callable, Mapping

from gspo_jax import answers, reward_plugins
from gspo_jax.answers import (
    DEFAULT_LIMITS,
    REFERENCE_LIMITS,
    Limits,
    Status,
    Verdict,
    boxed_answer,
    extract_answer,
    normalize_math,
    normalize_text,
    parse_number,
)
from gspo_jax.registry import Registry
from gspo_jax.tasks import countdown


def verify_exact_match(text: str, answer: str, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """The answer (the last ``<answer>`` span's content, else the whole response)
    equals ``answer`` after :func:`normalize_text`. ``formatted``: the span exists."""
    content = extract_answer(text)
    tagged = content is not None
    got = normalize_text(content if tagged else text)
    if not got:
        return Verdict(False, False, Status.NO_ANSWER)
    if got != normalize_text(str(answer)):
        return Verdict(False, tagged, Status.WRONG_ANSWER)
    return Verdict(True, tagged, Status.CORRECT)


_MATH_NUMBER_RE = re.compile(r"(-?)(\d+(?:\.\d+)?)(?:/(-?)(\d+(?:\.\d+)?))?", re.ASCII)


def _math_number(s: str, limits: Limits) -> Fraction | None:
    """The exact value of a normalised answer that is one number or a ratio of two."""
    m = _MATH_NUMBER_RE.fullmatch(s)
    if m is None or sum(map(str.isdigit, s)) > limits.max_digits:
        return None
    value = Fraction(m.group(2))
    if m.group(4) is not None:
        den = Fraction(m.group(4))
        if den == 0:
            return None
        value /= den
    return -value if (m.group(1) == "-") != (m.group(3) == "-") else value


# An assignment ``x = 3``, ``a_1 = 3``, ``x_{10} = 3`` (normalised: no spaces): a
# one-letter name, one ``=``.
_ASSIGNMENT_RE = re.compile(r"([A-Za-z](?:_\{?\w+\}?)?)=(?=[^=]+$)", re.ASCII)
_CLOSING = {"(": ")]", "[": "])", "{": "}"}


def _elements(s: str) -> tuple[str, list[str]] | None:
    """(brackets, elements) of a normalised list or tuple answer: ``(1,234)`` is
    ``("()", ["1", "234"])``, ``[0,1)`` ``("[)", ["0", "1"])``, ``\\{1,2\\}``
    ``("{}", …)``, a bare ``3,4`` ``("", ["3", "4"])``; None for an answer with no
    comma outside brackets (one element)."""
    brackets, cut = "", 0
    if s.startswith("\\{") and s.endswith("\\}"):
        brackets, cut = "{}", 2
    elif s[:1] in _CLOSING and s[-1:] in _CLOSING[s[0]]:
        brackets, cut = s[0] + s[-1], 1
    depth = 0  # the first bracket must close at the end: not "(1)+(2)"
    for i, ch in enumerate(s[:-1] if cut else ""):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 and i >= cut - 1:
            brackets, cut = "", 0
            break
    s = s[cut : len(s) - cut]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    if not parts:
        return None
    return brackets, parts + [s[start:]]


def _same_math(got: str, truth: str, limits: Limits, depth: int = 0) -> bool:
    """Whether two normalised answers are the same: equal strings, the same exact
    number, or lists in the same brackets whose elements are the same in order.
    An assignment's right-hand side is compared (``x=3`` is ``3``), and its name
    too when both are assignments."""
    if got == truth:
        return True
    a, b = _ASSIGNMENT_RE.match(got), _ASSIGNMENT_RE.match(truth)
    if a and b and a.group(1) != b.group(1):
        return False
    got, truth = got[a.end() :] if a else got, truth[b.end() :] if b else truth
    if got == truth:
        return True
    la = _elements(got) if depth < limits.max_depth else None
    lb = _elements(truth) if depth < limits.max_depth else None
    if la is not None or lb is not None:  # a single answer never equals a list
        return (
            la is not None
            and lb is not None
            and la[0] == lb[0]
            and len(la[1]) == len(lb[1])
            and all(_same_math(x, y, limits, depth + 1) for x, y in zip(la[1], lb[1]))
        )
    x, y = _math_number(got, limits), _math_number(truth, REFERENCE_LIMITS)
    return x is not None and x == y


def verify_boxed_math(text: str, answer: str, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    r"""The answer of :func:`boxed_answer` equals ``answer`` (itself read from its last
    ``\boxed{}`` if it has one) after :func:`normalize_math`, as strings, as the same
    exact number (``\frac{1}{2}`` = ``1/2`` = ``0.5`` = ``.5``), or, for lists and
    tuples, element by element in the same brackets (``(1, 234)`` = ``(1,234)``, but
    not ``1234``, ``1,234`` or ``[1, 234]``). ``x = 3`` is read as ``3`` (but not
    against ``y = 3``). ``formatted``: an answer was found."""
    got = boxed_answer(text, limits)
    if isinstance(got, Status):
        return Verdict(False, False, got)
    got = normalize_math(got)
    if not got:
        return Verdict(False, False, Status.NO_ANSWER)
    if _same_math(got, _math_reference(str(answer)), limits):
        return Verdict(True, True, Status.CORRECT)
    return Verdict(False, True, Status.WRONG_ANSWER)


def _math_reference(answer: str) -> str:
    ref = boxed_answer(answer, REFERENCE_LIMITS) if "\\boxed" in answer else answer
    return normalize_math(ref) if isinstance(ref, str) else ""


def _numeric_problem(meta: Mapping[str, Any]) -> str | None:
    if parse_number(str(meta["answer"]), REFERENCE_LIMITS) is None:
        return f"answer {meta['answer']!r} is not a plain number (verifier 'numeric')"
    return None


def _countdown_problem(meta: Mapping[str, Any]) -> str | None:
    nums, target = meta.get("numbers"), meta.get("target")
    if not isinstance(target, int) or isinstance(target, bool):
        return f"countdown target must be an integer, got {target!r}"
    if (
        not isinstance(nums, (list, tuple))
        or not nums
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in nums)
    ):
        return f"countdown 'numbers' must be a non-empty list of positive integers, got {nums!r}"
    return None


def _exact_match_problem(meta: Mapping[str, Any]) -> str | None:
    return None if normalize_text(str(meta["answer"])) else "answer is empty"


def _boxed_math_problem(meta: Mapping[str, Any]) -> str | None:
    if not _math_reference(str(meta["answer"])):
        return f"answer {meta['answer']!r} is empty after normalisation"
    return None


@dataclasses.dataclass(frozen=True)
class Verifier:
    """A verifier by name.

    Attributes:
      verify: ``verify(text, meta, limits)`` -> Verdict; ``meta`` holds ``"answer"``
        (countdown: ``"numbers"`` and ``"target"``) and the file's ``"row"``.
      reference_problem: ``reference_problem(meta)`` -> why a row's reference cannot
        be verified, or None.
      answer_kind: how evaluation compares final answers: "numeric" or "tag"
        (`gspo_jax.heldout.ANSWER_KINDS`).
    """

    verify: Callable[[str, Mapping[str, Any], Limits], Verdict]
    reference_problem: Callable[[Mapping[str, Any]], str | None]
    answer_kind: str = "tag"


def _exact_match(text: str, meta: Mapping[str, Any], limits: Limits) -> Verdict:
    return verify_exact_match(text, meta["answer"], limits)


def _boxed_math(text: str, meta: Mapping[str, Any], limits: Limits) -> Verdict:
    return verify_boxed_math(text, meta["answer"], limits)


# The verifiers of task "file" by name (config.task.verifier).
VERIFIERS: Registry[Verifier] = Registry("verifier")
VERIFIERS.register("numeric", Verifier(answers.verify_numeric_meta, _numeric_problem, "numeric"))
VERIFIERS.register("countdown", Verifier(countdown.verify, _countdown_problem))
VERIFIERS.register("exact_match", Verifier(_exact_match, _exact_match_problem))
VERIFIERS.register("boxed_math", Verifier(_boxed_math, _boxed_math_problem))


def register(name: str, verifier: Verifier) -> Verifier:
    """Add ``verifier`` as ``name`` (a second one of one name is refused)."""
    return VERIFIERS.register(name, verifier)


def names() -> tuple[str, ...]:
    """Every verifier name (a plug-in ``module:function`` besides)."""
    return VERIFIERS.names()


def _plugin(spec: str) -> Verifier:
    return Verifier(
        lambda text, meta, limits: reward_plugins.plugin_verdict(spec, text, meta),
        lambda meta: None,  # a plug-in reward function takes any reference
    )


def get(name: str) -> Verifier:
    """The verifier ``name``, or the plug-in ``module:function`` it names (imported on
    the first call of its ``verify``)."""
    if reward_plugins.is_reward_fn(name):
        return _plugin(name)
    return VERIFIERS.get(name)
