"""Metrics that know how they merge.

A train step computes its metrics on micro-batches and reports those of the whole
mini-batch; an RL step reports those of several updates. A metric is therefore not a
number but a small pytree that carries what merging needs:

    Mean(total, count)      a weighted mean: totals and counts add up
    Sum(value)              a count or a quantity already scaled to the whole batch
    Max(value), Min(value)  extrema
    Std(total, total_sq, count)  a pooled standard deviation
    Last(value)             the latest value (a learning rate)

``merge(a, b)`` of two values of one kind gives the value of the union, exactly;
``reduce(x)`` does the same over a leading (micro-batch) axis, which is what a
`jax.lax.scan` stacks; ``compute()`` gives the number to log. A new metric is added
where it is computed, by choosing its kind; nothing else needs to know its name.
The one rule serves both levels: the micro-batches of an update (`reduce_all`, in the
train step) and the updates of an RL step (`merge_all`, in `gspo_jax.rl`), so an RL
step's ``clip_frac`` is the fraction over all its updates' tokens and its
``logratio_std`` the pooled standard deviation.

    m = {"clip_frac": Mean.masked(clipped, mask), "ratio_max": Max.masked(r, mask)}
    merged = reduce_all(stacked_over_micro_batches)  # dict of metrics
    logged = compute_all(merged)                     # dict of f32 arrays
    step = compute_all(merge_all([update_1, update_2]))
"""

from __future__ import annotations

import functools
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


@flax.struct.dataclass
class Last:
    """The latest of the values merged (the learning rate an RL step ends at)."""

    value: Array

    @classmethod
    def of(cls, value) -> Last:
        return cls(_f32(value))

    def merge(self, other: Last) -> Last:
        return other

    def reduce(self) -> Last:
        return Last(self.value[-1])

    def compute(self) -> Array:
        return self.value


Metric = Union[Mean, Sum, Max, Min, Std, Last]
MetricDict = dict[str, Metric]


def nothing_like(metrics: MetricDict) -> MetricDict:
    """For each metric (arrays or shapes), the value that merges as nothing: zero totals
    and counts, -inf for a Max, +inf for a Min (a loop's first carry, to which every
    iteration's metrics merge; `Last` takes the other's value whatever it holds)."""

    def fill(x, v):
        return jnp.full(x.shape, v, x.dtype)

    def one(m):
        if isinstance(m, Max):
            return Max(fill(m.value, -jnp.inf))
        if isinstance(m, Min):
            return Min(fill(m.value, jnp.inf))
        return jax.tree.map(lambda x: fill(x, 0), m)

    return {k: one(m) for k, m in metrics.items()}


def reduce_all(stacked: MetricDict) -> MetricDict:
    """Merges metrics stacked along a leading axis (e.g. the ys of a `lax.scan`)."""
    return {k: v.reduce() for k, v in stacked.items()}


def compute_all(metrics: MetricDict) -> dict[str, Array]:
    """The numbers to log."""
    return {k: v.compute() for k, v in metrics.items()}


# `compute_all` compiled: the numbers are computed as the train step computed them in
# its own program (with the same fusion, so with the same rounding: a pooled std
# computed op by op differs in its last bit), and only numbers leave the devices.
compute_jit = jax.jit(compute_all)


def merge_all(records: list[MetricDict]) -> MetricDict:
    """Several records (one per update, in order) merged key by key, each by its kind."""
    return {
        k: functools.reduce(lambda a, b: a.merge(b), [r[k] for r in records]) for k in records[0]
    }


# `merge_all` then `compute_all`, in one compiled program (an RL step's summary).
merged_jit = jax.jit(lambda records: compute_all(merge_all(records)))
