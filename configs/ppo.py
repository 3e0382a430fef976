r"""PPO with a critic: a value head on the policy, GAE advantages, clipped value loss.

    python -m gspo_jax.train --config=configs/ppo.py --workdir=runs/ppo

The seeds' baseline: token-level clipped surrogate (ε = 0.2) with per-token GAE
advantages (γ = 1, λ = 0.95) from a value head that shares the policy's trunk,
trained with the clipped value loss (ε_v = 0.2, coefficient 0.5).
Arguments: ``smoke``.
"""

from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("smoke",))
    c = config_lib.base_config()
    config_lib.set_objective(c, "ppo")
    c.advantage = "gae"
    c.gae.gamma = 1.0
    c.gae.lam = 0.95
    c.gae.value_coef = 0.5
    c.gae.value_clip = 0.2
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
