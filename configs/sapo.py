r"""SAPO: a soft, temperature-controlled gate in place of the hard clip.

    python -m gspo_jax.train --config=configs/sapo.py --workdir=runs/sapo
    python -m gspo_jax.train --config=configs/sapo.py --config.objective.hparams.tau_neg=1.5 --workdir=runs/sapo_t

Defaults τ_pos = 1.0, τ_neg = 1.05 (the objective's). Arguments: ``smoke``.
"""

from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("smoke",))
    c = config_lib.base_config()
    config_lib.set_objective(c, "sapo", dict(tau_pos=1.0, tau_neg=1.05))
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
