"""Task "countdown": make a target from given numbers with + - * /, each once.

The data are :mod:`gspo_jax.data.countdown`'s TFDS builder (one config per difficulty
level). The verifier never passes model output to ``eval``: the answer tag's content
goes through a small recursive-descent parser over ``+ - * /``, parentheses and ASCII
integers, with limits on length, nesting depth and literal size
(:class:`~gspo_jax.answers.Limits`), and is evaluated exactly with
:class:`fractions.Fraction`. The answer must be tagged (:mod:`gspo_jax.answers`).
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

from gspo_jax import tasks
from gspo_jax.answers import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    DEFAULT_LIMITS,
    Limits,
    Status,
    Verdict,
    extract_answer,
)
from gspo_jax.data import countdown as countdown_data
from gspo_jax.data import prompts, source


class _Reject(Exception):
    """Internal: verification stops with this status."""

    def __init__(self, status: Status):
        super().__init__(status.value)
        self.status = status


# ---------------------------------------------------------------------------
# The expression verifier.

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
# The task record.


def prompt(numbers, target: int, style: str = "compact") -> str:
    """Prompt for a Countdown problem."""
    nums = " ".join(str(int(n)) for n in numbers)
    return prompts.in_style(
        style,
        compact=f"Make {int(target)} from {nums} with + - * /, each once.\n",
        instruct=(
            f"Using the numbers {nums}, write an expression that equals {int(target)}. "
            "You may use + - * / and parentheses, and must use each number exactly once. "
            f"Give only the final expression inside {ANSWER_OPEN}{ANSWER_CLOSE}, "
            f"for example {prompts.answer_span('(1+2)*3')}."
        ),
    )


def _prepare(data_dir, config=None):
    return source.prepared(
        countdown_data.GspoCountdown(data_dir=os.fspath(data_dir), config=config)
    )


def _example(record: Mapping[str, Any], index: int, style: str) -> prompts.Example:
    numbers = tuple(int(n) for n in np.asarray(record["numbers"]))
    target = int(record["target"])
    return prompts.Example(
        "countdown",
        prompt(numbers, target, style),
        {"numbers": numbers, "target": target},
        prompts.answer_span(prompts.as_text(record["solution"])),
        index,
    )


def _check_meta(meta: Mapping[str, Any]) -> None:
    if "numbers" not in meta or "target" not in meta:
        raise ValueError(f"countdown meta needs 'numbers' and 'target', got keys {sorted(meta)}")


def verify(text: str, meta: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """:func:`verify_countdown` against an example's ``meta`` ``{"numbers", "target"}``."""
    return verify_countdown(text, meta["numbers"], int(meta["target"]), limits)


TASK = tasks.register(
    tasks.Task(
        name="countdown",
        prepare=_prepare,
        example=_example,
        check_meta=_check_meta,
        verify=verify,
        levels=lambda: [b.name for b in countdown_data.GspoCountdown.BUILDER_CONFIGS],
        options=lambda task_config: {"config": task_config.difficulty},
    )
)
