"""Hyperparameters: one frozen dataclass per objective, validated where it is made.

Each objective module declares its class (defaults and ``__post_init__`` checks) from
the building blocks here; the registry and the experiment config are derived from
those classes, so a new hyperparameter is added in one file. Values are static Python
numbers and strings (they are closed over by ``jax.jit``, never traced).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from typing import Any, ClassVar

from gspo_jax.objectives.common import AGG_MODES, KL_KINDS


def is_static_number(v) -> bool:
    """A Python real number (not a bool, not an array)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def fail(hp, key: str, what: str) -> None:
    raise ValueError(f"{hp.name}: {key} {what}, got {getattr(hp, key)!r}")


def check_number(
    hp, key: str, *, low=None, low_open=False, high=None, high_open=None, optional=False
) -> None:
    """``hp.key`` is a static finite number in the range (or None if ``optional``):
    >= low (> low if ``low_open``), <= high, < high_open."""
    v = getattr(hp, key)
    if v is None and optional:
        return
    if not (is_static_number(v) and math.isfinite(v)):
        fail(hp, key, "must be a static finite Python number" + (" or None" if optional else ""))
    if low is not None and (v <= low if low_open else v < low):
        fail(hp, key, f"must be {'>' if low_open else '>='} {low}")
    if high is not None and v > high:
        fail(hp, key, f"must be <= {high}")
    if high_open is not None and v >= high_open:
        fail(hp, key, f"must be < {high_open}")


def check_choice(hp, key: str, choices) -> None:
    if getattr(hp, key) not in choices:
        fail(hp, key, f"must be one of {choices}")


@dataclasses.dataclass(frozen=True)
class Hparams:
    """Base of every objective's hyperparameters.

    ``name`` is the objective's registry name (used in error messages);
    ``sequence_level`` and ``needs_router_shift`` describe its inputs. Subclasses
    check their fields in ``__post_init__``; this base checks the KL term, which every
    objective has.
    """

    name: ClassVar[str] = "objective"
    sequence_level: ClassVar[bool] = False  # one loss per sequence: advantages f32[N]
    needs_router_shift: ClassVar[bool] = False  # RSPO

    kl_coef: float = 0.0  # beta of the KL term; 0 turns it (and the reference pass) off
    kl_estimator: str = "k3"  # k1, k2 or k3 (docs/objectives.md, "KL to a reference policy")

    def __post_init__(self):
        check_number(self, "kl_coef", low=0.0)
        check_choice(self, "kl_estimator", KL_KINDS)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TokenHparams(Hparams):
    """Adds the aggregation of a token-level objective."""

    agg: str = "seq-mean-token-mean"  # one of AGG_MODES ("Aggregation")
    norm_len: int | None = None  # seq-mean-token-sum-norm's constant; None: T

    def __post_init__(self):
        super().__post_init__()
        check_choice(self, "agg", AGG_MODES)
        v = self.norm_len
        if v is not None and not (
            isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0
        ):
            fail(self, "norm_len", "must be None or a positive int")


def check_ratio_eps(hp, *, low_optional: bool = False) -> None:
    """eps_low in [0, 1) (the ratio's lower bound 1 - eps_low stays positive); eps_high >= 0."""
    check_number(hp, "eps_low", low=0.0, high_open=1.0, optional=low_optional)
    check_number(hp, "eps_high", low=0.0)


def field_types(cls) -> dict[str, type]:
    """Each field's Python type, with ``X | None`` read as X (for the config's
    placeholders of None defaults)."""
    out = {}
    for key, tp in typing.get_type_hints(cls).items():
        if key in ("name", "sequence_level", "needs_router_shift"):
            continue
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        out[key] = tp
    return out
