"""Task "countdown": make a target from given numbers with + - * /, each once.

The task of TinyZero (and of Gandhi et al., "Stream of Search", 2024): given 3-4 numbers
and a target, write an arithmetic expression that equals the target. Rule (the one
TinyZero's verifier applies): **every given number is used exactly once**, with the
binary operators ``+ - * /`` and parentheses; no unary minus, no concatenation of digits.

Examples: generated in memory, seeded (:mod:`gspo_jax.tasks.synthetic`), one
`CountdownConfig` per difficulty level (`LEVELS`). Generation is forward, so every
example is solvable: numbers are drawn, combined pairwise in random order with random
operators into one expression tree, and the value of the tree becomes the target. The
generator keeps to the classic Countdown rules (every intermediate result a non-negative
integer, division only when exact), accepts the tree if the target lies in the
configured range, and otherwise draws again. The tree, printed with minimal parentheses,
is the example's reference solution.

Reward: the verifier never passes model output to ``eval``: the answer tag's content goes
through a small recursive-descent parser over ``+ - * /``, parentheses and ASCII
integers, with limits on length, nesting depth and literal size
(:class:`~gspo_jax.answers.Limits`), and is evaluated exactly with
:class:`fractions.Fraction` (so intermediate fractions are allowed in a model's answer).
The answer must be tagged (:mod:`gspo_jax.answers`).
"""

from __future__ import annotations

import dataclasses
import functools
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
from gspo_jax.tasks import prompts, synthetic

# ---------------------------------------------------------------------------
# The examples.

# Operator precedence for printing with minimal parentheses.
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclasses.dataclass(frozen=True)
class CountdownProblem:
    """One Countdown problem with a reference solution.

    Attributes:
      numbers: the given numbers, in presentation order.
      target: the value to reach.
      solution: an expression over ``numbers`` (each used exactly once) whose
        value is ``target``.
    """

    numbers: tuple[int, ...]
    target: int
    solution: str


def _combine(op: str, a: int, b: int) -> tuple[int, bool] | None:
    """Classic Countdown step on an unordered pair.

    Returns ``(value, swapped)`` with a non-negative integer value, trying
    ``a op b`` then ``b op a`` for the non-commutative operators, or None when
    neither order gives one (division without remainder impossible).
    """
    if op == "+":
        return a + b, False
    if op == "*":
        return a * b, False
    if op == "-":
        return (a - b, False) if a >= b else (b - a, True)
    if op == "/":
        if b != 0 and a % b == 0:
            return a // b, False
        if a != 0 and b % a == 0:
            return b // a, True
        return None
    raise ValueError(f"unknown operator {op!r}")


def _format(op: str, left: tuple[str, int], right: tuple[str, int]) -> tuple[str, int]:
    """Joins two (text, precedence) operands with minimal parentheses.

    Atoms have precedence 3. The left operand needs parentheses when it binds
    more loosely than ``op``; the right operand also when it binds equally and
    ``op`` is not associative (``a-(b-c)``, ``a/(b*c)``). Dropping the other
    parentheses (``a+(b-c)`` -> ``a+b-c``) keeps the exact rational value.
    """
    ltxt, lprec = left
    rtxt, rprec = right
    p = _PREC[op]
    if lprec < p:
        ltxt = f"({ltxt})"
    if rprec < p or (rprec == p and op in "-/"):
        rtxt = f"({rtxt})"
    return f"{ltxt}{op}{rtxt}", p


def generate_problem(
    rng: np.random.Generator,
    *,
    num_numbers: int,
    min_number: int,
    max_number: int,
    min_target: int,
    max_target: int,
    operators: str = "+-*/",
    max_tries: int = 10_000,
) -> CountdownProblem:
    """Draws one solvable Countdown problem.

    Args:
      rng: numpy Generator, advanced in place.
      num_numbers: how many numbers are given (>= 2).
      min_number, max_number: inclusive range of the given numbers.
      min_target, max_target: inclusive range of the target.
      operators: allowed operators, a subset of "+-*/".
      max_tries: draws before giving up.

    Returns:
      A CountdownProblem whose solution uses every number exactly once.

    Raises:
      ValueError: if no problem in the target range is found in ``max_tries``
        draws (the ranges are probably incompatible).
    """
    for _ in range(max_tries):
        numbers = [int(x) for x in rng.integers(min_number, max_number + 1, size=num_numbers)]
        # Pool of (value, text, precedence); combine two random entries until one remains.
        # One vectorised draw drives every random choice of the tree (fast, and
        # deterministic for the seed): per merge, two for the pair, one for the
        # operator order.
        u = rng.random(3 * num_numbers)
        pool = [(n, str(n), 3) for n in numbers]
        ok = True
        for step_idx in range(num_numbers - 1):
            n = len(pool)
            i = int(u[3 * step_idx] * n)
            j = int(u[3 * step_idx + 1] * (n - 1))
            j += j >= i
            (va, ta, pa), (vb, tb, pb) = pool[i], pool[j]
            # Operators in a random rotation; the first giving a valid step is used.
            start = int(u[3 * step_idx + 2] * len(operators))
            for r in range(len(operators)):
                op = operators[(start + r) % len(operators)]
                step = _combine(op, va, vb)
                if step is not None:
                    break
            if step is None:
                ok = False
                break
            value, swapped = step
            left, right = ((tb, pb), (ta, pa)) if swapped else ((ta, pa), (tb, pb))
            text, prec = _format(op, left, right)
            pool = [e for k, e in enumerate(pool) if k not in (i, j)] + [(value, text, prec)]
        if not ok:
            continue
        target, solution, _ = pool[0]
        if min_target <= target <= max_target:
            return CountdownProblem(tuple(numbers), int(target), solution)
    raise ValueError(
        f"no Countdown problem with {num_numbers} numbers in [{min_number}, {max_number}] "
        f"reaches a target in [{min_target}, {max_target}] within {max_tries} draws; "
        "widen the target range"
    )


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    """Difficulty and size of a Countdown dataset (a level of `LEVELS`, or :meth:`make`).

    The number of given numbers is drawn uniformly from ``[min_count, max_count]`` per
    example. :meth:`make` names a custom difficulty after every field, so two different
    difficulties never share a name.
    """

    name: str = "custom"
    description: str = ""
    min_count: int = 3
    max_count: int = 4
    min_number: int = 1
    max_number: int = 99
    min_target: int = 1
    max_target: int = 100
    operators: str = "+-*/"
    train_size: int = 20_000
    test_size: int = 512
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if not 2 <= self.min_count <= self.max_count:
            raise ValueError(
                f"CountdownConfig.min_count/max_count must satisfy 2 <= min <= max, "
                f"got {self.min_count}, {self.max_count}"
            )
        if not 0 <= self.min_number <= self.max_number:
            raise ValueError(
                f"CountdownConfig.min_number/max_number must satisfy 0 <= min <= max, "
                f"got {self.min_number}, {self.max_number}"
            )
        if self.min_target > self.max_target:
            raise ValueError(
                f"CountdownConfig.min_target > max_target: {self.min_target} > {self.max_target}"
            )
        if not self.operators or set(self.operators) - set("+-*/"):
            raise ValueError(
                f"CountdownConfig.operators must be a non-empty subset of '+-*/', got {self.operators!r}"
            )
        if self.train_size < 0 or self.test_size < 1:
            raise ValueError(
                f"CountdownConfig.train_size must be >= 0 and test_size >= 1, "
                f"got {self.train_size}, {self.test_size}"
            )

    @classmethod
    def make(cls, **fields) -> "CountdownConfig":
        """A config named after its fields, e.g. ``n3-4_v1-99_t1-100_ops+-*d_tr20000_te512_s0``."""
        base = {f.name: f.default for f in dataclasses.fields(cls) if f.name in _COUNTDOWN_FIELDS}
        unknown = set(fields) - set(base)
        if unknown:
            raise ValueError(
                f"CountdownConfig.make: unknown field(s) {sorted(unknown)}; known: {sorted(base)}"
            )
        base.update(fields)
        ops = (
            base["operators"]
            .replace("/", "d")
            .replace("*", "x")
            .replace("+", "p")
            .replace("-", "m")
        )
        name = (
            f"n{base['min_count']}-{base['max_count']}_v{base['min_number']}-{base['max_number']}"
            f"_t{base['min_target']}-{base['max_target']}_{ops}"
            f"_tr{base['train_size']}_te{base['test_size']}_s{base['seed']}"
        )
        cfg = cls(name=name, description="custom Countdown difficulty", **base)
        cfg.validate()
        return cfg


_COUNTDOWN_FIELDS = (
    "min_count",
    "max_count",
    "min_number",
    "max_number",
    "min_target",
    "max_target",
    "operators",
    "train_size",
    "test_size",
    "seed",
)


def problem_key(numbers, target) -> tuple:
    """Identity of a problem for de-duplication: the multiset of numbers and the target."""
    return (tuple(sorted(int(n) for n in numbers)), int(target))


LEVELS = {
    c.name: c
    for c in (
        CountdownConfig(
            name="small",
            description="3 numbers in 1..9, target 1..30 (about 1,500 distinct problems)",
            min_count=3,
            max_count=3,
            max_number=9,
            max_target=30,
            test_size=256,
        ),
        CountdownConfig(
            name="easy",
            description="3 numbers in 1..20, target 1..50",
            min_count=3,
            max_count=3,
            max_number=20,
            max_target=50,
        ),
        CountdownConfig(name="tinyzero", description="3-4 numbers in 1..99, target 1..100"),
        CountdownConfig(
            name="hard",
            description="4 numbers in 1..99, target 100..999",
            min_count=4,
            min_target=100,
            max_target=999,
        ),
    )
}
DEFAULT_LEVEL = "easy"


def level(config: CountdownConfig | str | None) -> CountdownConfig:
    """``config`` as a CountdownConfig: a level's name (None: `DEFAULT_LEVEL`) or itself."""
    return synthetic.pick_level("countdown", LEVELS, DEFAULT_LEVEL, CountdownConfig, config)


def _draw(config: CountdownConfig, rng: np.random.Generator) -> CountdownProblem:
    count = int(rng.integers(config.min_count, config.max_count + 1))
    return generate_problem(
        rng,
        num_numbers=count,
        min_number=config.min_number,
        max_number=config.max_number,
        min_target=config.min_target,
        max_target=config.max_target,
        operators=config.operators,
    )


@functools.lru_cache(maxsize=16)
def generated(config: CountdownConfig) -> synthetic.Generated:
    """The splits of ``config`` (its test split made here; the same object for one config)."""
    config.validate()
    return synthetic.Generated(
        functools.partial(_draw, config),
        lambda p: problem_key(p.numbers, p.target),
        seed=config.seed,
        train_size=config.train_size,
        test_size=config.test_size,
        what=f"Countdown config {config.name!r}",
    )


def generate_split(config: CountdownConfig, split: str) -> list[CountdownProblem]:
    """Every problem of one split, deterministic in ``config``: the test split distinct,
    the train split never holding a test problem (:mod:`gspo_jax.tasks.synthetic`)."""
    if split not in ("train", "test"):
        raise ValueError(f"Countdown split must be 'train' or 'test', got {split!r}")
    return list(generated(config).split(split))


# ---------------------------------------------------------------------------
# The expression verifier.


class _Reject(Exception):
    """Internal: verification stops with this status."""

    def __init__(self, status: Status):
        super().__init__(status.value)
        self.status = status


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


def _prepare(data_dir, config=None) -> tasks.Splits:
    del data_dir  # generated in memory
    config = level(config)
    return generated(config).splits(config.name)


def _example(record: CountdownProblem, index: int, style: str) -> prompts.Example:
    numbers, target = record.numbers, record.target
    return prompts.Example(
        "countdown",
        prompt(numbers, target, style),
        {"numbers": numbers, "target": target},
        prompts.answer_span(record.solution),
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
        levels=lambda: list(LEVELS),
        options=lambda task_config: {"config": task_config.difficulty},
    )
)
