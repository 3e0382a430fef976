"""Multi-digit integer arithmetic: ``a+b``, ``a*b``, ``a-b*c`` ...

A question is ``k`` operands of ``n`` digits each joined by operators from the
config, read with the usual precedence (``*`` before ``+``/``-``, left to
right otherwise). The answer is the exact integer, possibly negative.
Difficulty is the digit range, the operand count and the operator set.

Seeded numpy only: the same config gives the same examples everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds

from gspo_jax import answers

_MAX_DIGITS = 18  # numpy int64 draws.


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem. ``question`` like ``"123*45"``, ``answer`` like ``"5535"``."""

    question: str
    answer: str


def evaluate_integer_expression(operands: list[int], operators: list[str]) -> int:
    """Exact value of ``operands[0] op[0] operands[1] ...`` with ``*`` first.

    Args:
      operands: k Python ints.
      operators: k-1 operators from "+-*".
    """
    if len(operators) != len(operands) - 1:
        raise ValueError(
            f"need len(operators) == len(operands) - 1, got {len(operators)}, {len(operands)}"
        )
    # Collapse products, then sum the signed terms.
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        elif op in "+-":
            terms.append(x)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


def generate_problem(
    rng: np.random.Generator,
    *,
    min_digits: int,
    max_digits: int,
    min_operands: int,
    max_operands: int,
    operators: str,
) -> ArithmeticProblem:
    """Draws one problem; every operand has its own digit count in the range."""
    k = int(rng.integers(min_operands, max_operands + 1))
    operands = []
    for _ in range(k):
        n = int(rng.integers(min_digits, max_digits + 1))
        lo = 0 if n == 1 else 10 ** (n - 1)
        operands.append(int(rng.integers(lo, 10**n)))
    ops = [operators[int(rng.integers(len(operators)))] for _ in range(k - 1)]
    question = "".join(f"{x}{op}" for x, op in zip(operands, ops)) + str(operands[-1])
    return ArithmeticProblem(question, str(evaluate_integer_expression(operands, ops)))


@dataclasses.dataclass
class ArithmeticConfig(tfds.core.BuilderConfig):
    """Difficulty and size. Use :meth:`make` for a custom difficulty."""

    min_digits: int = 1
    max_digits: int = 3
    min_operands: int = 2
    max_operands: int = 2
    operators: str = "+-*"
    train_size: int = 20_000
    test_size: int = 512
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if not 1 <= self.min_digits <= self.max_digits <= _MAX_DIGITS:
            raise ValueError(
                f"ArithmeticConfig.min_digits/max_digits must satisfy "
                f"1 <= min <= max <= {_MAX_DIGITS}, got {self.min_digits}, {self.max_digits}"
            )
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"ArithmeticConfig.min_operands/max_operands must satisfy 2 <= min <= max, "
                f"got {self.min_operands}, {self.max_operands}"
            )
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(
                f"ArithmeticConfig.operators must be a non-empty subset of '+-*', "
                f"got {self.operators!r}"
            )
        if self.train_size < 0 or self.test_size < 1:
            raise ValueError(
                f"ArithmeticConfig.train_size must be >= 0 and test_size >= 1, "
                f"got {self.train_size}, {self.test_size}"
            )
        # Every answer must be one the verifier reads: a product of k n-digit operands has
        # up to k * n digits; a sum or difference of k of them up to n + len(str(k)).
        if "*" in self.operators:
            answer_digits = self.max_operands * self.max_digits
        else:
            answer_digits = self.max_digits + len(str(self.max_operands))
        limit = answers.DEFAULT_LIMITS.max_digits
        if answer_digits > limit:
            raise ValueError(
                f"ArithmeticConfig: answers can reach {answer_digits} digits "
                f"(max_digits={self.max_digits}, max_operands={self.max_operands}, "
                f"operators={self.operators!r}), over the verifier's {limit} "
                f"(answers.Limits.max_digits)"
            )

    @classmethod
    def make(cls, **fields) -> "ArithmeticConfig":
        """A config named after its fields, so different difficulties never collide on disk."""
        base = {name: getattr(cls, name) for name in _ARITHMETIC_FIELDS}
        unknown = set(fields) - set(base)
        if unknown:
            raise ValueError(
                f"ArithmeticConfig.make: unknown field(s) {sorted(unknown)}; known: {sorted(base)}"
            )
        base.update(fields)
        ops = base["operators"].replace("*", "x").replace("+", "p").replace("-", "m")
        name = (
            f"d{base['min_digits']}-{base['max_digits']}_k{base['min_operands']}-{base['max_operands']}"
            f"_{ops}_tr{base['train_size']}_te{base['test_size']}_s{base['seed']}"
        )
        cfg = cls(name=name, description="custom arithmetic difficulty", **base)
        cfg.validate()
        return cfg


_ARITHMETIC_FIELDS = (
    "min_digits",
    "max_digits",
    "min_operands",
    "max_operands",
    "operators",
    "train_size",
    "test_size",
    "seed",
)


def generate_split(config: ArithmeticConfig, split: str) -> list[ArithmeticProblem]:
    """The problems of one split. Test: distinct questions; train: never a test question."""
    config.validate()
    kw = dict(
        min_digits=config.min_digits,
        max_digits=config.max_digits,
        min_operands=config.min_operands,
        max_operands=config.max_operands,
        operators=config.operators,
    )
    rng = np.random.default_rng([config.seed, 0])
    test, seen = [], set()
    for _ in range(50 * config.test_size + 100):
        if len(test) == config.test_size:
            break
        p = generate_problem(rng, **kw)
        if p.question not in seen:
            seen.add(p.question)
            test.append(p)
    if len(test) < config.test_size:
        raise ValueError(
            f"arithmetic config {config.name!r}: only {len(test)} distinct test questions "
            f"of {config.test_size}; the difficulty range is too small for this test_size"
        )
    if split == "test":
        return test
    if split != "train":
        raise ValueError(f"arithmetic split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng([config.seed, 1])
    train = []
    for _ in range(50 * config.train_size + 100):
        if len(train) == config.train_size:
            break
        p = generate_problem(rng, **kw)
        if p.question not in seen:
            train.append(p)
    if len(train) < config.train_size:
        raise ValueError(
            f"arithmetic config {config.name!r}: train split could not avoid the test "
            "questions; the difficulty range is too small"
        )
    return train


class GspoArithmetic(tfds.core.GeneratorBasedBuilder):
    """TFDS builder for multi-digit arithmetic, generated offline.

    Configs ``add2`` (2-digit a+b), ``digits3`` (1-3 digits, a op b with + - *),
    ``digits5`` (3-5 digits, 2-3 operands); or ``config=ArithmeticConfig.make(...)``.
    Features: ``question`` text, ``answer`` text (an exact integer).
    """

    name = "gspo_arithmetic"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        ArithmeticConfig(
            name="add2",
            description="2-digit a+b",
            min_digits=2,
            max_digits=2,
            operators="+",
            test_size=256,
        ),
        ArithmeticConfig(
            name="digits3", description="1-3 digit a op b, ops + - *", min_digits=1, max_digits=3
        ),
        ArithmeticConfig(
            name="digits5",
            description="3-5 digits, 2-3 operands, ops + - *",
            min_digits=3,
            max_digits=5,
            min_operands=2,
            max_operands=3,
        ),
    ]
    DEFAULT_CONFIG_NAME = "digits3"

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "question": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated offline.
        return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict]]:
        for i, p in enumerate(generate_split(self.builder_config, split)):
            yield i, {"question": p.question, "answer": p.answer}
