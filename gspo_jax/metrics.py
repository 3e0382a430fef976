"""Metrics that know how they merge.

A train step computes its metrics on micro-batches and reports those of the whole
mini-batch; an RL step reports those of several updates. A metric is therefore not a
number but a small pytree that carries what merging needs:

    Mean(total, count)      a weighted mean: totals and counts add up
    Sum(value)              a count or a quantity already scaled to the whole batch
    Max(value), Min(value)  extrema
    Std(total, total_sq, count)  a pooled standard deviation

``merge(a, b)`` of two values of one kind gives the value of the union, exactly;
``reduce(x)`` does the same over a leading (micro-batch) axis, which is what a
`jax.lax.scan` stacks; ``compute()`` gives the number to log. A new metric is added
where it is computed, by choosing its kind; nothing else needs to know its name.

    m = {"clip_frac": Mean.masked(clipped, mask), "ratio_max": Max.masked(r, mask)}
    merged = reduce_all(stacked_over_micro_batches)  # dict of metrics
    logged = compute_all(merged)                     # dict of f32 arrays
"""

from __future__ import annotations

from typing import Union

import flax
import jax
import jax.numpy as jnp

Array = jax.Array


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


@flax.struct.dataclass
class Mean:
    """A mean: ``total / count`` (0 when count is 0). ``total`` may be a vector
    (one mean per layer) over a scalar ``count``."""

    total: Array
    count: Array

    @classmethod
    def masked(cls, x, mask) -> Mean:
        """Mean of ``x`` over the positions where ``mask`` > 0."""
        valid = jnp.asarray(mask) > 0
        return cls(jnp.sum(jnp.where(valid, _f32(x), 0.0)), jnp.sum(_f32(valid)))

    @classmethod
    def of(cls, value, weight=1.0) -> Mean:
        """One value with a weight (a micro-batch's mean and its share)."""
        weight = _f32(weight)
        return cls(_f32(value) * weight, weight)

    def merge(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count)

    def reduce(self) -> Mean:
        return Mean(jnp.sum(self.total, axis=0), jnp.sum(self.count, axis=0))

    def compute(self) -> Array:
        has = self.count > 0
        return jnp.where(has, self.total / jnp.where(has, self.count, 1.0), 0.0)


@flax.struct.dataclass
class Sum:
    """A quantity whose parts add up (counts; losses already scaled to the batch)."""

    value: Array

    @classmethod
    def of(cls, value) -> Sum:
        return cls(_f32(value))

    def merge(self, other: Sum) -> Sum:
        return Sum(self.value + other.value)

    def reduce(self) -> Sum:
        return Sum(jnp.sum(self.value, axis=0))

    def compute(self) -> Array:
        return self.value


@flax.struct.dataclass
class Max:
    """A maximum. ``masked`` takes ``empty`` where no position is valid."""

    value: Array

    @classmethod
    def masked(cls, x, mask, empty: float = 0.0) -> Max:
        valid = jnp.asarray(mask) > 0
        top = jnp.max(jnp.where(valid, _f32(x), -jnp.inf), initial=-jnp.inf)
        return cls(jnp.where(jnp.any(valid), top, empty))

    @classmethod
    def of(cls, value) -> Max:
        return cls(_f32(value))

    def merge(self, other: Max) -> Max:
        return Max(jnp.maximum(self.value, other.value))

    def reduce(self) -> Max:
        return Max(jnp.max(self.value, axis=0))

    def compute(self) -> Array:
        return self.value


@flax.struct.dataclass
class Min:
    """A minimum. ``masked`` takes ``empty`` where no position is valid."""

    value: Array

    @classmethod
    def masked(cls, x, mask, empty: float = 0.0) -> Min:
        valid = jnp.asarray(mask) > 0
        low = jnp.min(jnp.where(valid, _f32(x), jnp.inf), initial=jnp.inf)
        return cls(jnp.where(jnp.any(valid), low, empty))

    @classmethod
    def of(cls, value) -> Min:
        return cls(_f32(value))

    def merge(self, other: Min) -> Min:
        return Min(jnp.minimum(self.value, other.value))

    def reduce(self) -> Min:
        return Min(jnp.min(self.value, axis=0))

    def compute(self) -> Array:
        return self.value


@flax.struct.dataclass
class Std:
    """A population standard deviation, pooled from sums of x and x^2."""

    total: Array
    total_sq: Array
    count: Array

    @classmethod
    def masked(cls, x, mask) -> Std:
        valid = jnp.asarray(mask) > 0
        x = jnp.where(valid, _f32(x), 0.0)
        return cls(jnp.sum(x), jnp.sum(x * x), jnp.sum(_f32(valid)))

    def merge(self, other: Std) -> Std:
        return Std(
            self.total + other.total, self.total_sq + other.total_sq, self.count + other.count
        )

    def reduce(self) -> Std:
        return Std(*(jnp.sum(x, axis=0) for x in (self.total, self.total_sq, self.count)))

    def compute(self) -> Array:
        n = jnp.maximum(self.count, 1.0)
        mean = self.total / n
        return jnp.sqrt(jnp.maximum(self.total_sq / n - mean * mean, 0.0))


Metric = Union[Mean, Sum, Max, Min, Std]
MetricDict = dict[str, Metric]


def reduce_all(stacked: MetricDict) -> MetricDict:
    """Merges metrics stacked along a leading axis (e.g. the ys of a `lax.scan`)."""
    return {k: v.reduce() for k, v in stacked.items()}


def compute_all(metrics: MetricDict) -> dict[str, Array]:
    """The numbers to log."""
    return {k: v.compute() for k, v in metrics.items()}
