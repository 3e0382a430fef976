r"""MoE stability far off-policy: GRPO with and without routing replay, against GSPO and RSPO.

The GSPO and RSPO papers' setting, scaled to the 2-core CPU: a tiny MoE policy
(every layer MoE, 8 experts top-2) on Countdown, after the same supervised warm
start, trained with many optimizer steps per rollout (``minibatches=8``), so that
the policy, and its router, drift from the one that sampled. Every variant
differs only in its objective and routing replay:

  ``grpo``     token-level clipped ratio (GRPO's clip, seq-mean-token-mean, no KL)
  ``grpo_r2``  the same with R2 replay (the update reuses pi_old's routing)
  ``grpo_r3``  the same with R3 replay (the update reuses the sampler's routing)
  ``gspo``     sequence-level ratio (clip 0.02 / 0.03 for short responses)
  ``rspo``     geometric-mean ratio times the router-shift weight (gamma_min 0.5)
  ``gmpo``     RSPO without the router-shift weight

    python -m gspo_jax.train --config=configs/stability.py:variant=grpo --workdir=runs/stab/grpo
    python -m experiments.archive.stability_pilot --workdir runs/stab      # every variant, one warm start, plots

Arguments (comma-separated): ``variant`` (above), ``minibatches`` (optimizer steps
per rollout, default 8), ``lr`` (RL learning rate, default 2e-4), ``smoke``.
"""

from gspo_jax import config as config_lib

VARIANTS = {
    # name: (objective, hyperparameters, routing replay)
    "grpo": ("grpo", {"kl_coef": 0.0}, "none"),
    "grpo_r2": ("grpo", {"kl_coef": 0.0}, "R2"),
    "grpo_r3": ("grpo", {"kl_coef": 0.0}, "R3"),
    "gspo": ("gspo", {"eps_low": 0.02, "eps_high": 0.03}, "none"),
    "rspo": ("rspo", {}, "none"),
    "gmpo": ("gmpo", {}, "none"),
}


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("variant", "lr", "minibatches", "smoke"))
    variant = args.get("variant", "grpo")
    if variant not in VARIANTS:
        raise config_lib.ConfigError(
            f"configs/stability.py: variant must be one of {sorted(VARIANTS)}, got {variant!r}"
        )
    objective, hparams, replay = VARIANTS[variant]
    c = config_lib.base_config()
    config_lib.set_objective(c, objective, hparams)
    c.updates.routing_replay = replay
    c.updates.num_minibatches = int(args.get("minibatches", 8))
    c.optimizer.lr = float(args.get("lr", 2e-4))
    c.total_rl_steps = 40
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
