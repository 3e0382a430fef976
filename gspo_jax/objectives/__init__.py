r"""Policy objectives: PPO, GRPO, Dr.GRPO, DAPO, GSPO, GSPO-token, CISPO, GMPO, RSPO, SAPO.

Every objective is a plain function of arrays, differentiated by ``jax.grad``, found by
name::

    from gspo_jax import objectives
    fn = objectives.get("gspo")            # objectives.names() lists them all
    loss, metrics = fn(logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4)
    grads = jax.grad(lambda lp: fn(lp, old_logp, advantages, mask)[0])(logp)

The registry checks the inputs (`common.check_inputs`: shapes and dtypes, chex at
trace time) and calls the plain function with them and its hyperparameter dataclass::

    from gspo_jax.objectives.gspo import gspo, GSPOHparams
    hp = GSPOHparams(eps_high=1e-3)
    loss, metrics = gspo(common.check_inputs(hp, logp, old_logp, advantages, mask), hp)

Where each one lives (one module per family):

  clipped.py    PPO, GRPO, Dr.GRPO, DAPO   (the token-level clipped surrogate)
  gspo.py       GSPO, GSPO-token           (one ratio per sequence)
  cispo.py      CISPO                      (clipped stop-gradient IS weight)
  geometric.py  GMPO, RSPO                 (geometric mean, log-space clip, router shift)
  sapo.py       SAPO                       (soft gate)
  critic.py     PPO's value loss, entropy bonus
  correction.py rollout correction: weights pi_old / pi_sampler for ``weight=``
  common.py     input checks, masking, the log-ratio, aggregation, the normaliser, KL
  hparams.py    the hyperparameter base classes and their checks
  registry.py   names -> objectives

Signature of every registered objective::

    fn(logp, old_logp, advantages, mask, *, ref_logp=None, router_shift=None,
       normalizer=None, weight=None, **hyperparameters) -> (loss, metrics)

``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``router_shift`` and ``weight`` are
f32[N,T] (f64 is kept as f64); ``advantages`` f32[N] or f32[N,T]. ``weight`` (a
constant, e.g. ``rollout_correction``'s) multiplies the per-token policy loss. ``loss`` is the scalar minimised
(L = -J); ``metrics`` a dict of f32 numbers (``fn.apply`` gives them as values that
merge across micro-batches, `gspo_jax.metrics`). The exact math, the conventions (the
+-20 log-ratio clamp, empty sequences, aggregation modes) and every metric are in
``docs/objectives.md``.

Exact gradient accumulation: pass the whole mini-batch's ``normalizer(mask)`` to each
micro-batch's call, and the micro-batch losses (and gradients) sum to the mini-batch's.
"""

from gspo_jax.objectives.common import (
    AGG_MODES,
    KL_KINDS,
    LOG_RATIO_CLIP,
    Normalizer,
    kl,
    normalizer,
)
from gspo_jax.objectives.correction import RolloutCorrection, rollout_correction
from gspo_jax.objectives.critic import entropy_bonus, token_entropy, value_loss
from gspo_jax.objectives.registry import REGISTRY, Objective, describe, get, names, register

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "LOG_RATIO_CLIP",
    "Normalizer",
    "Objective",
    "REGISTRY",
    "RolloutCorrection",
    "describe",
    "entropy_bonus",
    "get",
    "kl",
    "names",
    "normalizer",
    "register",
    "rollout_correction",
    "token_entropy",
    "value_loss",
]
