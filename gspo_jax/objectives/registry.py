"""The registry: every objective by name, with its hyperparameter class."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Callable, Mapping

from gspo_jax.config_fields import err, from_dataclass_error, setting
from gspo_jax.metrics import MetricDict, compute_all
from gspo_jax.objectives import cispo, clipped, common, geometric, gspo, sapo
from gspo_jax.objectives.hparams import Hparams
from gspo_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered objective.

    Calling it validates the hyperparameters (keyword arguments, defaults from
    ``hparams_class``), runs ``fn`` and returns ``(loss, metrics)`` with the metrics
    as f32 numbers; `apply` returns them as mergeable values (`gspo_jax.metrics`).
    Its name, input contract and defaults are those of ``hparams_class``.

    Attributes:
      fn: the plain function of the checked inputs, fn(x: `common.Inputs`, hp) ->
        (loss, metrics).
      hparams_class: its frozen hyperparameter dataclass.
      description: one line on what it is.
    """

    fn: Callable
    hparams_class: type[Hparams]
    description: str

    @property
    def name(self) -> str:
        return self.hparams_class.name

    @property
    def sequence_level(self) -> bool:
        """One loss per sequence: advantages must be f32[N]."""
        return self.hparams_class.sequence_level

    @property
    def needs_router_shift(self) -> bool:
        return self.hparams_class.needs_router_shift

    @property
    def defaults(self) -> dict[str, Any]:
        """Every hyperparameter the objective takes, with its default."""
        return dict(self._defaults)

    @functools.cached_property
    def _defaults(self) -> dict[str, Any]:
        return self.hparams_class().as_dict()

    def hparams(self, **hyperparameters) -> Hparams:
        """The validated hyperparameters; ValueError naming any unknown or bad one."""
        accepted = self.defaults
        unknown = sorted(set(hyperparameters) - set(accepted))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown hyperparameter(s) {unknown}; accepted: {sorted(accepted)}"
            )
        return self.hparams_class(**hyperparameters)

    def validate_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults updated by ``hyperparameters``, validated, as a dict."""
        return self.hparams(**hyperparameters).as_dict()

    def apply(
        self,
        logp,
        old_logp,
        advantages,
        mask,
        *,
        ref_logp=None,
        router_shift=None,
        normalizer=None,
        weight=None,
        hp: Hparams | None = None,
        **hyperparameters,
    ) -> tuple[Any, MetricDict]:
        """(loss, metrics) with metrics that merge across micro-batches exactly.

        ``weight``: an optional f32[N,T] constant on the per-token policy loss, e.g.
        `correction.rollout_correction`'s (docs/objectives.md, "Rollout correction").
        ``hp``: the hyperparameters as this objective's dataclass, made already (a run's
        ``config.objective.hparams``), in place of keyword arguments.
        """
        if hp is None:
            hp = self.hparams(**hyperparameters)
        elif hyperparameters or type(hp) is not self.hparams_class:
            raise ValueError(
                f"{self.name}: hp must be a {self.hparams_class.__name__} and come without "
                f"keyword hyperparameters, got {type(hp).__name__} and {sorted(hyperparameters)}"
            )
        x = common.check_inputs(
            hp,
            logp,
            old_logp,
            advantages,
            mask,
            ref_logp=ref_logp,
            router_shift=router_shift,
            norm=normalizer,
            weight=weight,
        )
        return self.fn(x, hp)

    def __call__(self, logp, old_logp, advantages, mask, **kwargs):
        """As `apply` (same arguments), with the metrics computed to f32 numbers."""
        loss, metrics = self.apply(logp, old_logp, advantages, mask, **kwargs)
        return loss, compute_all(metrics)


# Every objective by name, in the order the papers came (docs/objectives.md).
REGISTRY: Registry[Objective] = Registry("objective")
for _o in (
    Objective(
        clipped.clipped_surrogate,
        clipped.PPOHparams,
        "PPO clipped surrogate (token-mean), optional dual clip c > 1 for A < 0.",
    ),
    Objective(
        clipped.clipped_surrogate,
        clipped.GRPOHparams,
        "GRPO (DeepSeekMath): clipped surrogate, seq-mean-token-mean, k3 KL with beta 0.04.",
    ),
    Objective(
        clipped.clipped_surrogate,
        clipped.DrGRPOHparams,
        "Dr.GRPO: clipped surrogate, seq-mean-token-sum-norm (no 1/|o| factor), no KL.",
    ),
    Objective(
        clipped.clipped_surrogate,
        clipped.DAPOHparams,
        "DAPO: clipped surrogate with clip-higher (0.2, 0.28), token-mean, no KL.",
    ),
    Objective(
        gspo.gspo,
        gspo.GSPOHparams,
        "GSPO: sequence-level ratio s_i = exp(mean_t delta), clipped per sequence.",
    ),
    Objective(
        gspo.gspo_token,
        gspo.GSPOTokenHparams,
        "GSPO-token: s_i with a per-token gradient path, for per-token advantages.",
    ),
    Objective(
        cispo.cispo,
        cispo.CISPOHparams,
        "CISPO (MiniMax-M1): REINFORCE with a stop-gradient clipped IS weight.",
    ),
    Objective(
        geometric.gmpo,
        geometric.GMPOHparams,
        "GMPO: geometric mean of one-sided log-space-clipped token ratios.",
    ),
    Objective(
        geometric.rspo,
        geometric.RSPOHparams,
        "RSPO: GMPO times the geometric mean of the router shift gamma (outside the "
        "sgn(A) power, so routing drift damps the update for either sign of A).",
    ),
    Objective(
        sapo.sapo,
        sapo.SAPOHparams,
        "SAPO: soft sigmoid gate with temperatures tau_pos / tau_neg.",
    ),
):
    REGISTRY.register(_o.name, _o)


def register(objective: Objective) -> Objective:
    """Add ``objective`` under its name (`Objective.name`, its hyperparameter class's);
    a second objective of one name is refused."""
    return REGISTRY.register(objective.name, objective)


def get(name: str) -> Objective:
    """The objective registered as ``name`` (see `names`)."""
    return REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered objective name."""
    return REGISTRY.names()


def describe(name: str) -> str:
    """One line on what the objective is."""
    return get(name).description


DEFAULT = "gspo"


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """``config.objective``: the objective and its hyperparameters (written by
    `gspo_jax.config.set_objective`, checked by its hyperparameter dataclass). Built from
    a config, ``hparams`` is that dataclass: made once, when the config is loaded, and
    read as it is by the train step and the objective's formula."""

    name: str = setting(DEFAULT, choices=names, doc="a registered objective")
    hparams: Hparams = setting(
        factory=lambda: get(DEFAULT).defaults,
        open_group=True,
        domain="the objective's hyperparameter dataclass (docs/objectives.md)",
        doc="every hyperparameter the objective takes",
    )
    hparams_of: str = setting(
        DEFAULT, doc="the objective whose hyperparameters `hparams` holds (set_objective's)"
    )

    def __post_init__(self):
        if isinstance(self.hparams, Mapping):  # built from a config: made here, once
            hparams = dict(self.hparams)
            try:
                made = get(self.name).hparams(**hparams)
            except (TypeError, ValueError) as e:
                raise from_dataclass_error(e, self.name, "objective.hparams", hparams) from None
            object.__setattr__(self, "hparams", made)

    @classmethod
    def check_node(cls, node) -> None:
        """``config.objective``'s hyperparameters: those of ``objective.name``, each
        known to it (errors name ``config.objective.hparams.<key>``); their values are
        checked where the dataclass is made, once, as the config is loaded."""
        if node.hparams_of != node.name:
            raise err(
                "objective.name",
                f"is {node.name!r} but objective.hparams hold "
                f"{node.hparams_of!r}'s; pick the objective with the config's argument "
                "(configs/default.py:objective=<name>) or config.set_objective",
            )
        objective = get(node.name)
        hparams = dict(node.hparams)
        known = [f.name for f in dataclasses.fields(objective.hparams_class)]
        for key in hparams:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean config.objective.hparams.{near[0]}?" if near else ""
                raise err(
                    f"objective.hparams.{key}",
                    f"{node.name} takes no such hyperparameter{hint} (it takes {sorted(known)})",
                )
