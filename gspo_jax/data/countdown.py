"""Countdown: reach a target from given numbers with + - * /.

The task of TinyZero (and of Gandhi et al., "Stream of Search", 2024): given
3-4 numbers and a target, write an arithmetic expression that equals the
target.

Rule (the one TinyZero's verifier applies): **every given number is used
exactly once**, with the binary operators ``+ - * /`` and parentheses. There
is no unary minus and no concatenation of digits. The verifier in
:mod:`gspo_jax.tasks.countdown` evaluates with exact rational arithmetic, so
intermediate fractions are allowed in a model's answer.

Generation is forward and therefore every example is solvable: numbers are
drawn, combined pairwise in random order with random operators into one
expression tree, and the value of the tree becomes the target. The generator
keeps to the classic Countdown rules (every intermediate result a
non-negative integer, division only when exact), accepts the tree if the
target lies in the configured range, and otherwise draws again. The tree,
printed with minimal parentheses, is the example's reference solution.

Everything is seeded numpy: the same config gives the same examples on every
machine, with no network.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds

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


@dataclasses.dataclass
class CountdownConfig(tfds.core.BuilderConfig):
    """Difficulty and size of a Countdown dataset.

    The number of given numbers is drawn uniformly from
    ``[min_count, max_count]`` per example. Use :meth:`make` for a custom
    difficulty: it names the config after every field, so two different
    difficulties never share a prepared directory.
    """

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


def generate_split(config: CountdownConfig, split: str) -> list[CountdownProblem]:
    """The problems of one split, deterministic in ``config``.

    The test split is drawn first, without duplicates; the train split is drawn
    from an independent stream and never contains a test problem, so held-out
    reward measures generalisation.
    """
    config.validate()

    def draw(rng: np.random.Generator) -> CountdownProblem:
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

    def draw_unique(rng, size, exclude):
        out, seen = [], set(exclude)
        for _ in range(50 * size + 100):
            if len(out) == size:
                break
            p = draw(rng)
            key = problem_key(p.numbers, p.target)
            if key in seen:
                continue
            seen.add(key)
            out.append(p)
        if len(out) < size:
            raise ValueError(
                f"Countdown config {config.name!r}: could only draw {len(out)} distinct "
                f"problems of {size}; the difficulty range is too small for this size"
            )
        return out

    test = draw_unique(np.random.default_rng([config.seed, 0]), config.test_size, ())
    if split == "test":
        return test
    if split == "train":
        test_keys = {problem_key(p.numbers, p.target) for p in test}
        rng = np.random.default_rng([config.seed, 1])
        out = []
        for _ in range(50 * config.train_size + 100):
            if len(out) == config.train_size:
                break
            p = draw(rng)
            if problem_key(p.numbers, p.target) not in test_keys:
                out.append(p)
        if len(out) < config.train_size:
            raise ValueError(
                f"Countdown config {config.name!r}: train split could not avoid the "
                "test problems; the difficulty range is too small"
            )
        return out
    raise ValueError(f"Countdown split must be 'train' or 'test', got {split!r}")


class GspoCountdown(tfds.core.GeneratorBasedBuilder):
    """TFDS builder for Countdown, generated offline and deterministically.

    Configs ``small`` (3 numbers in 1..9, target 1..30; about 1,500 distinct
    problems), ``easy`` (3 numbers in 1..20, target 1..50), ``tinyzero`` (3-4
    numbers in 1..99, target 1..100) and ``hard`` (4 numbers in 1..99, target
    100..999); or pass ``config=CountdownConfig.make(...)``.

    Features: ``numbers`` int64[None], ``target`` int64, ``solution`` text.
    """

    name = "gspo_countdown"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        CountdownConfig(
            name="small",
            description="3 numbers in 1..9, target 1..30",
            min_count=3,
            max_count=3,
            min_number=1,
            max_number=9,
            min_target=1,
            max_target=30,
            test_size=256,
        ),
        CountdownConfig(
            name="easy",
            description="3 numbers in 1..20, target 1..50",
            min_count=3,
            max_count=3,
            min_number=1,
            max_number=20,
            min_target=1,
            max_target=50,
        ),
        CountdownConfig(
            name="tinyzero",
            description="3-4 numbers in 1..99, target 1..100",
            min_count=3,
            max_count=4,
            min_number=1,
            max_number=99,
            min_target=1,
            max_target=100,
        ),
        CountdownConfig(
            name="hard",
            description="4 numbers in 1..99, target 100..999",
            min_count=4,
            max_count=4,
            min_number=1,
            max_number=99,
            min_target=100,
            max_target=999,
        ),
    ]
    DEFAULT_CONFIG_NAME = "easy"

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "numbers": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                    "target": tfds.features.Scalar(dtype=np.int64),
                    "solution": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
            homepage="https://github.com/Jiayi-Pan/TinyZero",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated offline.
        return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict]]:
        for i, p in enumerate(generate_split(self.builder_config, split)):
            yield (
                i,
                {
                    "numbers": np.asarray(p.numbers, np.int64),
                    "target": p.target,
                    "solution": p.solution,
                },
            )
