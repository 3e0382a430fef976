"""Rule-based verifiers: Countdown, integer arithmetic, GSM8K.

Model output is never passed to ``eval`` or ``exec``. A Countdown answer goes
through a small recursive-descent parser over ``+ - * /``, parentheses and
ASCII integers, with limits on length, nesting depth and literal size, and is
evaluated exactly with :class:`fractions.Fraction`. Numeric answers are
normalised (``$``, thousands commas, a trailing period, surrounding text) and
compared exactly as rationals.

Every response gets a reward and a status; garbage text gets reward 0 and a
failure status, never an exception. The batch entry point is :func:`score`.

Answer format (shared with the prompts in :mod:`gspo_jax.data`): the last
``<answer>...</answer>`` span of the response holds the answer. The closing
tag is required, so a sampler that stops on ``</answer>`` must keep the stop
string in the response text.

Reward, per response::

    reward = correct + format_weight * formatted

``correct`` is 1 when the answer is right; ``formatted`` is 1 when an answer
span exists and its content parses (an expression for Countdown, a number
otherwise). With ``format_weight=0`` (the default) the reward is the 0/1
correctness of DeepSeek-R1 and TinyZero.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


class Status(str, enum.Enum):
    """Outcome of verifying one response. Everything but CORRECT is a failure."""

    CORRECT = "correct"
    WRONG_ANSWER = "wrong_answer"  # parsed, valid, but not the right value
    NO_ANSWER = "no_answer"  # no <answer>...</answer> span
    PARSE_ERROR = "parse_error"  # content is not a valid expression/number
    WRONG_NUMBERS = "wrong_numbers"  # Countdown: not each given number exactly once
    DIV_BY_ZERO = "div_by_zero"  # Countdown: division by zero
    TOO_LONG = "too_long"  # answer content longer than the limit
    TOO_DEEP = "too_deep"  # parenthesis nesting deeper than the limit
    NUMBER_TOO_LARGE = "number_too_large"  # a literal with more digits than the limit
    VERIFIER_ERROR = "verifier_error"  # an unexpected exception (a bug); logged


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds that keep verification time and memory small on any input.

    Attributes:
      max_answer_chars: longest answer content that is parsed at all.
      max_depth: deepest parenthesis nesting in a Countdown expression.
      max_digits: most digits in one literal.
    """

    max_answer_chars: int = 256
    max_depth: int = 32
    max_digits: int = 24


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Result for one response: correctness, format, and the status."""

    correct: bool
    formatted: bool
    status: Status


class _Reject(Exception):
    """Internal: verification stops with this status."""

    def __init__(self, status: Status):
        super().__init__(status.value)
        self.status = status


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` span, or None. O(len(text))."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN) : end]


# ---------------------------------------------------------------------------
# Countdown expressions.

_OPS = {"+": "+", "-": "-", "*": "*", "/": "/", "\u00d7": "*", "\u00f7": "/"}
_WHITESPACE = " \t\n\r"
_ASCII_DIGITS = "0123456789"


def _tokenize(expr: str, limits: Limits) -> list[tuple[str, Any]]:
    """Tokens ``("num", int)``, ``("op", "+-*/")``, ``("(", None)``, ``(")", None)``.

    Only ASCII digits make numbers (``str.isdigit`` would accept other scripts'
    digits); ``×`` and ``÷`` are read as ``*`` and ``/``. Any other character,
    including ``^`` and ``.``, is a parse error; ``**`` fails in the parser.
    """
    tokens = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in _WHITESPACE:
            i += 1
        elif c in _ASCII_DIGITS:
            j = i
            while j < n and expr[j] in _ASCII_DIGITS:
                j += 1
            if j - i > limits.max_digits:
                raise _Reject(Status.NUMBER_TOO_LARGE)
            tokens.append(("num", int(expr[i:j])))
            i = j
        elif c in _OPS:
            tokens.append(("op", _OPS[c]))
            i += 1
        elif c in "()":
            tokens.append((c, None))
            i += 1
        else:
            raise _Reject(Status.PARSE_ERROR)
    return tokens


class _Parser:
    """Recursive descent over the grammar::

        expr   := term (("+" | "-") term)*
        term   := factor (("*" | "/") factor)*
        factor := NUMBER | "(" expr ")"

    Binary operators only (no unary minus). Evaluates exactly with Fraction.
    Recursion happens only at "(", and is cut at ``limits.max_depth``.
    """

    def __init__(self, tokens, limits: Limits):
        self.tokens = tokens
        self.pos = 0
        self.limits = limits
        self.numbers: list[int] = []

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def parse(self) -> Fraction:
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise _Reject(Status.PARSE_ERROR)
        return value

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in (("op", "+"), ("op", "-")):
            op = self.tokens[self.pos][1]
            self.pos += 1
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in (("op", "*"), ("op", "/")):
            op = self.tokens[self.pos][1]
            self.pos += 1
            rhs = self._factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _Reject(Status.DIV_BY_ZERO)
            else:
                value = value / rhs
        return value

    def _factor(self, depth: int) -> Fraction:
        kind, val = self._peek()
        if kind == "num":
            self.pos += 1
            self.numbers.append(val)
            return Fraction(val)
        if kind == "(":
            if depth + 1 > self.limits.max_depth:
                raise _Reject(Status.TOO_DEEP)
            self.pos += 1
            value = self._expr(depth + 1)
            if self._peek()[0] != ")":
                raise _Reject(Status.PARSE_ERROR)
            self.pos += 1
            return value
        raise _Reject(Status.PARSE_ERROR)


def _evaluate(expr: str, limits: Limits) -> tuple[Fraction, list[int]]:
    """Exact value of a Countdown expression and the literals it uses, in order;
    raises `_Reject` with the failure status for an invalid expression."""
    if len(expr) > limits.max_answer_chars:
        raise _Reject(Status.TOO_LONG)
    parser = _Parser(_tokenize(expr, limits), limits)
    value = parser.parse()
    return value, parser.numbers


def verify_countdown(
    text: str, numbers: Sequence[int], target: int, limits: Limits = DEFAULT_LIMITS
) -> Verdict:
    """Countdown check: the expression uses each given number exactly once and equals target.

    The answer content may end with ``= N``; then N must be an integer literal
    equal to the target as well.
    """
    content = extract_answer(text)
    if content is None:
        return Verdict(False, False, Status.NO_ANSWER)
    try:
        if len(content) > limits.max_answer_chars:
            raise _Reject(Status.TOO_LONG)
        stated = None
        if "=" in content:
            lhs, _, rhs = content.partition("=")
            rhs = rhs.strip(_WHITESPACE)
            if not rhs or any(c not in _ASCII_DIGITS for c in rhs) or len(rhs) > limits.max_digits:
                raise _Reject(Status.PARSE_ERROR)
            content, stated = lhs, int(rhs)
        value, used = _evaluate(content, limits)
    except _Reject as e:
        return Verdict(
            False,
            e.status
            not in (Status.PARSE_ERROR, Status.TOO_LONG, Status.TOO_DEEP, Status.NUMBER_TOO_LARGE),
            e.status,
        )
    if sorted(used) != sorted(int(x) for x in numbers):
        return Verdict(False, True, Status.WRONG_NUMBERS)
    if value != target or (stated is not None and stated != target):
        return Verdict(False, True, Status.WRONG_ANSWER)
    return Verdict(True, True, Status.CORRECT)


# ---------------------------------------------------------------------------
# Numeric answers.

# A number token in free text: a signed decimal with an optional "$" and commas
# between digits ("1,200" but not the comma in "42," or "1,200, so"). Not a
# piece of another number: no digit or "." before it (".5" is not 5, "10-3" has
# no -3) and no exponent around it ("1e5" holds no number). Linear-time: fixed-width
# lookarounds, no nested quantifiers.
_NUMBER_RE = re.compile(
    r"(?<![0-9.])(?<![0-9][eE])(?<![0-9][eE][-+])"
    r"(?:-\$?|\$-?)?[0-9](?:[0-9]|,(?=[0-9]))*(?:\.[0-9]+)?"
    r"(?![eE][-+]?[0-9])",
    re.ASCII,
)
_UNICODE_MINUS = "\u2212"
_GROUPED_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+", re.ASCII)


def parse_number(s: str, limits: Limits = DEFAULT_LIMITS) -> Fraction | None:
    """Exact value of a number written like ``-1,234.50``, ``$18``, ``18.`` or ``7``.

    Accepts surrounding whitespace, one leading ``$`` (before or after the
    sign, which may be U+2212), thousands commas in correct groups of three, and
    a trailing period.
    Returns None for anything else (``1,23``, ``1e5``, ``½``, non-ASCII digits).
    """
    s = s.strip().replace(_UNICODE_MINUS, "-")
    if s.endswith("."):
        s = s[:-1]
    sign = 1
    for _ in range(2):  # "-$5", "$-5"
        if s.startswith("$"):
            s = s[1:]
        if s.startswith("-") and sign == 1:
            sign, s = -1, s[1:]
    if not s:
        return None
    intpart, dot, frac = s.partition(".")
    if "," in intpart:
        if not _GROUPED_RE.fullmatch(intpart):
            return None
        intpart = intpart.replace(",", "")
    if not intpart or any(c not in _ASCII_DIGITS for c in intpart):
        return None
    if dot and (not frac or any(c not in _ASCII_DIGITS for c in frac)):
        return None
    if len(intpart) + len(frac) > limits.max_digits:
        return None
    return sign * Fraction(f"{intpart}.{frac}" if frac else intpart)


def extract_number(content: str, limits: Limits = DEFAULT_LIMITS) -> tuple[Fraction | None, Status]:
    """The number an answer span states: the whole content if it is a number,
    else the last number-like token in it (``"The answer is $1,200."``)."""
    if len(content) > limits.max_answer_chars:
        return None, Status.TOO_LONG
    content = content.replace(_UNICODE_MINUS, "-")
    value = parse_number(content, limits)
    if value is not None:
        return value, Status.CORRECT
    matches = _NUMBER_RE.findall(content)
    if not matches:
        return None, Status.PARSE_ERROR
    value = parse_number(matches[-1], limits)
    if value is None:
        digits = sum(c in _ASCII_DIGITS for c in matches[-1])
        return None, Status.NUMBER_TOO_LARGE if digits > limits.max_digits else Status.PARSE_ERROR
    return value, Status.CORRECT


def verify_numeric(text: str, answer: str | int, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """Arithmetic / GSM8K check: the stated number equals ``answer`` exactly.

    Raises:
      ValueError: if ``answer`` (the dataset's ground truth, not model output)
        is not a number.
    """
    truth = parse_number(str(answer), Limits(max_answer_chars=10**6, max_digits=10**6))
    if truth is None:
        raise ValueError(f"meta 'answer' is not a number: {answer!r}")
    content = extract_answer(text)
    if content is None:
        return Verdict(False, False, Status.NO_ANSWER)
    value, status = extract_number(content, limits)
    if value is None:
        return Verdict(False, False, status)
    if value != truth:
        return Verdict(False, True, Status.WRONG_ANSWER)
    return Verdict(True, True, Status.CORRECT)


def gsm8k_final_answer(solution: str) -> str:
    """The ground-truth number of a GSM8K solution: the text after ``####``.

    Raises:
      ValueError: if the solution has no ``#### N`` line or N is not a number.
    """
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError(f"GSM8K answer has no '#### N' line: {solution[-80:]!r}")
    tail = tail.strip()
    if parse_number(tail, Limits(max_answer_chars=10**6, max_digits=10**6)) is None:
        raise ValueError(f"GSM8K final answer is not a number: {tail!r}")
    return tail.replace(",", "").replace("$", "")


# ---------------------------------------------------------------------------
# Batch API.

TASKS = ("countdown", "arithmetic", "gsm8k")
_log = logging.getLogger(__name__)


def verify(
    task: str, text: str, meta: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS
) -> Verdict:
    """Verdict for one response. ``meta`` as produced by :mod:`gspo_jax.data`:
    Countdown ``{"numbers", "target"}``; arithmetic and GSM8K ``{"answer"}``.

    Raises:
      ValueError: for an unknown task, a non-str text, or meta missing a field
        (caller bugs). Never for the content of ``text``.
    """
    if not isinstance(text, str):
        raise ValueError(f"texts must be str, got {type(text).__name__}")
    if task == "countdown":
        if "numbers" not in meta or "target" not in meta:
            raise ValueError(
                f"countdown meta needs 'numbers' and 'target', got keys {sorted(meta)}"
            )
        fn = lambda: verify_countdown(text, meta["numbers"], int(meta["target"]), limits)
    elif task in ("arithmetic", "gsm8k"):
        if "answer" not in meta:
            raise ValueError(f"{task} meta needs 'answer', got keys {sorted(meta)}")
        answer = meta["answer"]
        parse_ok = parse_number(str(answer), Limits(max_answer_chars=10**6, max_digits=10**6))
        if parse_ok is None:
            raise ValueError(f"{task} meta 'answer' is not a number: {answer!r}")
        fn = lambda: verify_numeric(text, answer, limits)
    else:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    try:
        return fn()
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
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
    """Rewards for a batch of responses.

    Args:
      task: "countdown", "arithmetic" or "gsm8k".
      texts: N decoded responses.
      metas: N task metadata dicts (one per response; repeat a prompt's meta
        for its G samples).
      format_weight: weight of the format component.
      limits: parser bounds.

    Returns:
      rewards: f32[N], ``correct + format_weight * format``.
      components: ``{"correct": f32[N], "format": f32[N]}``.
      counts: number of responses per :class:`Status` value, every status
        present (zeros included) so logged keys are stable across steps.
    """
    if len(texts) != len(metas):
        raise ValueError(
            f"texts and metas must have the same length, got {len(texts)} and {len(metas)}"
        )
    correct = np.zeros(len(texts), np.float32)
    formatted = np.zeros(len(texts), np.float32)
    counts = {s.value: 0 for s in Status}
    for i, (text, meta) in enumerate(zip(texts, metas)):
        v = verify(task, text, meta, limits)
        correct[i] = v.correct
        formatted[i] = v.formatted
        counts[v.status.value] += 1
    rewards = (correct + np.float32(format_weight) * formatted).astype(np.float32)
    return rewards, {"correct": correct, "format": formatted}, counts
